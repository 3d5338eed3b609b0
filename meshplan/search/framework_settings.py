"""The frameworks' language: the settings of Megatron-LM / TransformerEngine, yunchang and torchtitan that run
a meshplan plan, and the plan a setting runs.

A *choice* is what identifies a plan in a search: (algorithm, layout, knobs). Each framework maps its
settings to a choice (:meth:`candidate`) and back (:meth:`settings`); :meth:`offered` lists every setting it
has for N ranks and a workload. What a framework cannot run, or meshplan cannot model, raises
:class:`NotExpressible` with the reason. Backward-only knobs (``dkv_dtype``, ``dkv_hops``) are compared only
when the workload has a backward. Read from the frameworks' code:

- **Megatron-LM** (megatron/training/arguments.py): ``--context-parallel-size N``, ``--cp-comm-type
  p2p|a2a|all_gather|a2a+p2p``, ``--hierarchical-context-parallel-sizes A P`` (a2a+p2p: the first size is the
  inner group of consecutive ranks). Megatron's ``get_batch_on_this_cp_rank`` always cuts the sequence into
  2·N chunks and gives rank r chunks r and 2N−1−r: the zigzag layout. TransformerEngine
  (``DotProductAttention.set_context_parallel_group(cp_group, cp_global_ranks, cp_stream, cp_comm_type)``;
  a2a+p2p takes the groups [a2a group, p2p group]): *p2p* (``AttnFuncWithCPAndKVP2P``) is Ring pass-KV whose
  backward sends KV at steps 0…N−2 and dK/dV at 1…N−1 in one buffer of KV's dtype — ``dkv_hops = n-1``,
  ``dkv_dtype`` = the input dtype; *a2a* is Ulysses, which asserts that the query and the KV heads divide
  by the CP size (no KV replication); *a2a+p2p* is USP with Ulysses groups inside (``rank_order =
  ulysses-first``) and p2p's ring; *all_gather* gathers KV before attention — meshplan has no all-gather-KV
  algorithm (``tasp`` decomposes that all-gather into concurrent rings, forward only), so it is not expressible.
- **yunchang** (``set_seq_parallel_pg(ulysses_degree, ring_degree, rank, world_size, use_ulysses_low=True)``,
  ``LongContextAttention(ring_impl_type=basic|zigzag|strip)``): USP; ``use_ulysses_low=True`` puts a Ulysses
  group on consecutive ranks (``rank_order = ulysses-first``), False the ring group (``ring-first``);
  basic/zigzag/strip are the contiguous/zigzag/striped layouts (ring-flash-attention's zigzag and stripe
  kernels assert causal). Its ring is ring-flash-attention's: dK/dV in fp32 over N hops (meshplan's
  defaults); it repeats KV heads when the Ulysses degree exceeds them ("KV Replication for GQA"), which is
  meshplan's rule. Zigzag over the ring degree gives each Ulysses group the same tokens as meshplan's zigzag
  over N. ulysses_degree = 1 is Ring, ring_degree = 1 is Ulysses (then ``use_ulysses_low`` is True).
- **torchtitan** (``parallelism.context_parallel_degree``, ``parallelism.context_parallel_rotate_method
  allgather|alltoall``) runs ``torch.distributed.tensor.experimental.context_parallel``: *alltoall* passes
  KV by send/recv (Ring pass-KV; backward: KV N−1 times, dK/dV in fp32 every step, N hops), *allgather*
  all-gathers KV first (not expressible, as TE's all_gather). Its load balancer for causal SDPA is head-tail
  (zigzag); load balancing requires ``is_causal``, so a full mask shards contiguously.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan import algorithms
from meshplan.algorithms.headsplit import head_degree_problem
from meshplan.model.workload import Workload

BWD_KNOBS = ("dkv_dtype", "dkv_hops")
ALL_GATHER = ("meshplan has no all-gather-KV algorithm (tasp decomposes that all-gather into concurrent rings, "
              "forward only)")


class NotExpressible(Exception):
    """A plan a framework cannot run, or a framework setting meshplan cannot model; ``reason`` says why."""

    reason = property(lambda self: self.args[0])


@dataclass(frozen=True)
class Choice:
    """A plan as search identifies it: algorithm, token layout and the algorithm's full knobs."""

    algorithm: str
    layout: str
    knobs: dict[str, Any]

    @classmethod
    def of(cls, cand) -> Choice:
        """The choice of a :class:`~meshplan.search.candidate.Candidate`."""
        return cls(cand.algorithm, cand.workload.layout, dict(cand.knobs))

    def key(self, w: Workload) -> tuple:
        """What decides the plan's time on ``w`` (backward-only knobs dropped without a backward)."""
        drop = () if "bwd" in w.pass_list else BWD_KNOBS
        return self.algorithm, self.layout, tuple(sorted((k, str(v)) for k, v in self.knobs.items() if k not in drop))


def _choice(name: str, layout: str, **knobs) -> Choice:
    return Choice(name, layout, algorithms.get(name).normalize(knobs))


def _checked(fw, s, c: Choice, w: Workload):
    """``s`` when it runs ``c``'s plan on ``w``, else NotExpressible naming what it runs instead."""
    back = fw.candidate(s, w)
    if back.key(w) != c.key(w):
        raise NotExpressible(f"{fw.name} runs {_knob_text(back)}, not {_knob_text(c)}")
    return s


@dataclass(frozen=True)
class MegatronSettings:
    """Megatron-LM's CP arguments (TransformerEngine's ``cp_comm_type``)."""

    context_parallel_size: int
    cp_comm_type: str
    hierarchical_context_parallel_sizes: tuple[int, int] | None = None

    def cli(self) -> str:
        """As written on Megatron-LM's command line."""
        h = self.hierarchical_context_parallel_sizes
        return (f"--context-parallel-size {self.context_parallel_size} --cp-comm-type {self.cp_comm_type}"
                + (f" --hierarchical-context-parallel-sizes {h[0]} {h[1]}" if h else ""))


@dataclass(frozen=True)
class YunchangSettings:
    """yunchang's ``set_seq_parallel_pg`` degrees and ``LongContextAttention``'s ring kernel."""

    ulysses_degree: int
    ring_degree: int
    use_ulysses_low: bool = True
    ring_impl_type: str = "zigzag"

    def cli(self) -> str:
        """As the arguments are written in Python."""
        return (f"ulysses_degree={self.ulysses_degree} ring_degree={self.ring_degree} "
                f"use_ulysses_low={self.use_ulysses_low} ring_impl_type={self.ring_impl_type}")


@dataclass(frozen=True)
class TorchtitanSettings:
    """torchtitan's ``[parallelism]`` CP options."""

    context_parallel_degree: int
    context_parallel_rotate_method: str = "allgather"

    def cli(self) -> str:
        """As written on torchtitan's command line."""
        return (f"--parallelism.context_parallel_degree {self.context_parallel_degree} "
                f"--parallelism.context_parallel_rotate_method {self.context_parallel_rotate_method}")


def _masks(w: Workload, name: str, kinds: tuple[str, ...]) -> None:
    if w.prefix_len:
        raise NotExpressible(f"{name}'s CP settings are for training, not a KV-cache prefix")
    if w.mask.kind not in kinds or (w.mask.kind == "docs" and w.doc_layout != "per-doc"):
        raise NotExpressible(f"{name} is mapped here for {', '.join(kinds)} masks, not {w.mask.spec()}")


class Megatron:
    """Megatron-LM / TransformerEngine."""

    name = "Megatron-LM / TransformerEngine"

    def _ring_knobs(self, w: Workload) -> dict[str, Any]:
        return {"dkv_dtype": w.dtype, "dkv_hops": "n-1"}

    def candidate(self, s: MegatronSettings, w: Workload) -> Choice:
        """The plan a setting runs."""
        n, kind = s.context_parallel_size, s.cp_comm_type
        _masks(w, self.name, ("full", "causal", "docs"))
        if w.mask.kind == "docs" and kind != "p2p":
            raise NotExpressible(f"cp_comm_type {kind} is mapped here for full and causal masks (docs: p2p)")
        if kind == "all_gather":
            raise NotExpressible(f"cp_comm_type all_gather: {ALL_GATHER}")
        if kind == "p2p":
            return _choice("ring", "zigzag", **self._ring_knobs(w))
        if kind == "a2a":
            if w.n_heads % n or w.n_kv_heads % n:
                raise NotExpressible(f"a2a needs the {w.n_heads} query and {w.n_kv_heads} KV heads to divide by {n}")
            return _choice("ulysses", "zigzag")
        h = s.hierarchical_context_parallel_sizes
        if kind != "a2a+p2p" or not h or h[0] * h[1] != n or min(h) < 2:
            raise NotExpressible(f"{s.cli()}: a2a+p2p takes two sizes >= 2 whose product is {n}")
        if w.n_heads % h[0] or w.n_kv_heads % h[0]:
            raise NotExpressible(f"a2a+p2p needs the query and KV heads to divide by its a2a size {h[0]}")
        return _choice("usp", "zigzag", ulysses_degree=h[0], rank_order="ulysses-first", **self._ring_knobs(w))

    def settings(self, c: Choice, w: Workload, n: int) -> MegatronSettings:
        """The setting that runs a plan."""
        if c.algorithm not in ("ring", "ulysses", "usp"):
            raise NotExpressible(f"{c.algorithm} has no Megatron-LM counterpart (p2p = ring, a2a = ulysses, "
                                 "a2a+p2p = usp)")
        if c.layout != "zigzag":
            raise NotExpressible(f"Megatron-LM shards the sequence zigzag (2·N chunks), not {c.layout}")
        u = c.knobs.get("ulysses_degree", 1) if c.algorithm == "usp" else 1
        s = (MegatronSettings(n, "p2p") if c.algorithm == "ring" else MegatronSettings(n, "a2a")
             if c.algorithm == "ulysses" else MegatronSettings(n, "a2a+p2p", (int(u), n // int(u))))
        return _checked(self, s, c, w)

    def offered(self, w: Workload, n: int) -> list[MegatronSettings]:
        """p2p, a2a (if the heads divide by N), a2a+p2p for every split A x P, all_gather."""
        split = [MegatronSettings(n, "a2a+p2p", (a, n // a)) for a in range(2, n // 2 + 1)
                 if n % a == 0 and w.n_heads % a == 0 and w.n_kv_heads % a == 0]
        a2a = [MegatronSettings(n, "a2a")] if w.n_heads % n == 0 and w.n_kv_heads % n == 0 else []
        return [MegatronSettings(n, "p2p"), *a2a, *split, MegatronSettings(n, "all_gather")]


IMPL = {"contiguous": "basic", "zigzag": "zigzag", "striped": "strip"}


class Yunchang:
    """yunchang (USP: Ulysses x ring-flash-attention)."""

    name = "yunchang"

    def candidate(self, s: YunchangSettings, w: Workload) -> Choice:
        """The plan a setting runs."""
        _masks(w, self.name, ("full", "causal"))
        layout = {v: k for k, v in IMPL.items()}.get(s.ring_impl_type)
        if layout is None:
            raise NotExpressible(f"ring_impl_type {s.ring_impl_type!r}: use basic, zigzag or strip")
        if layout != "contiguous" and w.mask.kind != "causal":
            raise NotExpressible(f"ring_impl_type {s.ring_impl_type} asserts a causal mask")
        u, r = s.ulysses_degree, s.ring_degree
        why = head_degree_problem(w, u) if u > 1 else None
        if why:
            raise NotExpressible(why)
        if u == 1:
            return _choice("ring", layout)
        if r == 1:
            return _choice("ulysses", layout)
        return _choice("usp", layout, ulysses_degree=u, rank_order="ulysses-first" if s.use_ulysses_low else
                       "ring-first")

    def settings(self, c: Choice, w: Workload, n: int) -> YunchangSettings:
        """The setting that runs a plan."""
        if c.algorithm not in ("ring", "ulysses", "usp"):
            raise NotExpressible(f"{c.algorithm} has no yunchang counterpart (ring, ulysses and usp have)")
        u = {"ring": 1, "ulysses": n}.get(c.algorithm) or int(c.knobs["ulysses_degree"])
        low = c.algorithm != "usp" or c.knobs.get("rank_order") == "ulysses-first"
        s = YunchangSettings(u, n // u, low, IMPL[c.layout])
        return _checked(self, s, c, w)

    def offered(self, w: Workload, n: int) -> list[YunchangSettings]:
        """Every ulysses_degree x ring_degree = N the heads allow, both group orders, every ring kernel."""
        impls = list(IMPL.values()) if w.mask.kind == "causal" else ["basic"]
        out = []
        for u in [1] + [u for u in range(2, n + 1) if n % u == 0 and head_degree_problem(w, u) is None]:
            for low in (True, False) if 1 < u < n else (True,):
                out += [YunchangSettings(u, n // u, low, impl) for impl in impls]
        return out


class Torchtitan:
    """torchtitan (PyTorch's experimental ``context_parallel``)."""

    name = "torchtitan"

    def candidate(self, s: TorchtitanSettings, w: Workload) -> Choice:
        """The plan a setting runs."""
        _masks(w, self.name, ("full", "causal"))
        if s.context_parallel_rotate_method == "allgather":
            raise NotExpressible(f"context_parallel_rotate_method allgather: {ALL_GATHER}")
        if s.context_parallel_rotate_method != "alltoall":
            raise NotExpressible(f"rotate method {s.context_parallel_rotate_method!r}: use allgather or alltoall")
        return _choice("ring", "zigzag" if w.mask.kind == "causal" else "contiguous")

    def settings(self, c: Choice, w: Workload, n: int) -> TorchtitanSettings:
        """The setting that runs a plan."""
        if c.algorithm != "ring":
            raise NotExpressible(f"{c.algorithm} has no torchtitan counterpart (alltoall = ring)")
        s = TorchtitanSettings(n, "alltoall")
        return _checked(self, s, c, w)

    def offered(self, w: Workload, n: int) -> list[TorchtitanSettings]:
        """Both rotate methods."""
        return [TorchtitanSettings(n, "alltoall"), TorchtitanSettings(n, "allgather")]


FRAMEWORKS = (Megatron(), Yunchang(), Torchtitan())


def express(fw, choice: Choice, w: Workload, n: int) -> tuple[Any | None, str | None]:
    """(settings, None) when ``fw`` can run ``choice`` on ``w`` with N ranks, else (None, the reason)."""
    try:
        return fw.settings(choice, w, n), None
    except NotExpressible as e:
        return None, e.reason


def _knob_text(c: Choice) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in c.knobs.items() if v is not None)
    return f"{c.algorithm} {c.layout}" + (f" {knobs}" if knobs else "")
