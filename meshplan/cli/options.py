"""Shared CLI options (the contract's workload and knob flags) and how they become objects.

Only typer is imported here, so ``meshplan --help`` stays fast; everything heavy is imported inside the
functions that need it.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

WL = "Workload"           # panel titles stay short: a title wider than the terminal is cut, defaults and all
KN = "Knobs (each algorithm takes the ones that apply)"

# the workload's defaults come from the preset, so the options default to None and say their default in words
Model = Annotated[Optional[str], typer.Option("--model", help="preset: llama3-8b, llama3-70b, charm-h100 "
                                              "\\[default: llama3-8b]", rich_help_panel=WL)]
SeqLen = Annotated[Optional[str], typer.Option("--seq-len", help="tokens (1M = 1,048,576; 128K) \\[default: 1M]",
                                               rich_help_panel=WL)]
Batch = Annotated[Optional[int], typer.Option("--batch", help="sequences per batch \\[default: 1]", rich_help_panel=WL)]
Heads = Annotated[Optional[int], typer.Option("--heads", help="query heads (overrides the preset)", rich_help_panel=WL)]
KvHeads = Annotated[Optional[int], typer.Option("--kv-heads", help="KV heads (GQA)", rich_help_panel=WL)]
HeadDim = Annotated[Optional[int], typer.Option("--head-dim", help="head dimension", rich_help_panel=WL)]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="bf16 | fp16 | fp32 \\[default: bf16]",
                                              rich_help_panel=WL)]
MaskOpt = Annotated[Optional[str], typer.Option("--mask", help="full | causal | window:W | docs:L1[+P1],L2,... | "
                                                             "cu_seqlens:0,E1,E2,... \\[default: causal]",
                                                rich_help_panel=WL)]
Layout = Annotated[Optional[str], typer.Option("--layout", help="contiguous | zigzag | striped", rich_help_panel=WL)]
Pass = Annotated[Optional[str], typer.Option("--pass", help="fwd | bwd | fwd+bwd \\[default: fwd+bwd]",
                                             rich_help_panel=WL)]
ValidLen = Annotated[Optional[str], typer.Option("--valid-len", help="tokens past this are padding",
                                                 rich_help_panel=WL)]
PrefixLen = Annotated[Optional[str], typer.Option(
    "--prefix-len", rich_help_panel=WL,
    help="inference: the first P tokens of --seq-len are a KV cache (keys only); S - P new tokens (1: decode)")]
DocLayout = Annotated[Optional[str], typer.Option(
    "--doc-layout", rich_help_panel=WL,
    help="docs masks: per-doc (each document cut by the layout, default) | packed (the packed stream)")]

Tile = Annotated[Optional[str], typer.Option("--tile", help="Mesh tile AxB", rich_help_panel=KN)]
Mapping = Annotated[Optional[str], typer.Option("--mapping", help="rank -> GPU placement (default auto)",
                                                rich_help_panel=KN)]
PartialDtype = Annotated[Optional[str], typer.Option("--partial-dtype", rich_help_panel=KN,
                                                     help="partial outputs on the wire: bf16 | fp16 | fp32")]
DkvDtype = Annotated[Optional[str], typer.Option("--dkv-dtype", help="partial dK/dV on the wire (default fp32)",
                                                 rich_help_panel=KN)]
UlyssesDegree = Annotated[Optional[int], typer.Option("--ulysses-degree", help="Ulysses degree U", rich_help_panel=KN)]
InnerRing = Annotated[Optional[int], typer.Option("--inner-ring", help="LoongTrain inner ring size W",
                                                  rich_help_panel=KN)]
TeamSize = Annotated[Optional[int], typer.Option("--team-size", help="StarTrail team size C", rich_help_panel=KN)]
Domains = Annotated[Optional[int], typer.Option("--domains", help="CHARM+ domains M", rich_help_panel=KN)]
KnobKV = Annotated[Optional[list[str]], typer.Option("--knob", help="NAME=VALUE, repeatable (e.g. dkv_hops=n-1)",
                                                     rich_help_panel=KN)]

DocLengths = Annotated[Optional[str], typer.Option(
    "--doc-lengths", help="a document-length histogram (CSV: range,number or length,count): rank the fixed methods "
    "and per-batch planning over packs drawn from it", rich_help_panel="Documents")]
Batches = Annotated[Optional[int], typer.Option("--batches", help="packs drawn with --doc-lengths (default 8)",
                                                rich_help_panel="Documents")]
Gpus = Annotated[Optional[int], typer.Option("--gpus",
                                             help="GPUs (ranks): a multiple or a divisor of the GPUs per node")]
Topo = Annotated[Optional[str], typer.Option("--topo", help="topology file or shipped name (h100x32, cpu-local, ...)")]
# the same two where a command cannot go without them (checked in the command, so the refusal is the contract's
# one line; typer would mark them "required" only if it enforced them itself)
GpusNeeded = Annotated[Optional[int], typer.Option(
    "--gpus", help="GPUs (ranks): a multiple or a divisor of the GPUs per node \\[required]")]
TopoNeeded = Annotated[Optional[str], typer.Option(
    "--topo", help="topology file or shipped name (h100x32, cpu-local, ...) \\[required]")]
GpusToPlan = Annotated[Optional[int], typer.Option(
    "--gpus", help="GPUs (ranks): a multiple or a divisor of the GPUs per node \\[required with --algo]")]
TopoToPlan = Annotated[Optional[str], typer.Option(
    "--topo", help="topology file or shipped name (h100x32, cpu-local, ...) \\[required with --algo]")]
Json = Annotated[bool, typer.Option("--json", help="machine-readable JSON on stdout")]

Nproc = Annotated[Optional[int], typer.Option("--nproc", help="ranks to spawn (default: the schedule's)")]
Backend = Annotated[str, typer.Option("--backend", help="auto (nccl with CUDA, else gloo) | gloo | nccl")]
Iters = Annotated[int, typer.Option("--iters", help="timed iterations")]
Warmup = Annotated[int, typer.Option("--warmup", help="untimed iterations first")]
Check = Annotated[Optional[bool], typer.Option("--check/--no-check",
                                               help="numerics against float64: --check every row, --no-check "
                                                    "none (default: every row when cheap, else a sample of rows)")]
Serialize = Annotated[bool, typer.Option("--serialize", help="one op at a time per rank: no overlap")]
TimeoutS = Annotated[float, typer.Option("--timeout-s", help="bound on every wait, seconds")]
Dump = Annotated[Optional[str], typer.Option("--dump", help="write inputs and gathered results (.npy) to this folder")]
Seed = Annotated[int, typer.Option("--seed", help="seed of the random inputs")]
Inputs = Annotated[Optional[str], typer.Option("--inputs", help=".npz with q, k, v (and dout) in (B, S, H, D)")]


Tp = Annotated[int, typer.Option("--tp", help="tensor-parallel size around the CP group (heads / TP)",
                                 rich_help_panel="Job")]
Dp = Annotated[int, typer.Option("--dp", help="data-parallel size (CP groups x TP run at once)", rich_help_panel="Job")]
RankOrder = Annotated[str, typer.Option("--rank-order", help="job rank order, innermost first (Megatron-LM: "
                                        "tp-cp-dp)", rich_help_panel="Job")]


def is_job(tp: int, dp: int, rank_order: str) -> bool:
    """Whether the job flags ask for more than one CP group alone (``--tp``, ``--dp`` or ``--rank-order`` given)."""
    return tp != 1 or dp != 1 or rank_order != "tp-cp-dp"


def workload(model, seq_len, batch, heads, kv_heads, head_dim, dtype, mask, layout, passes, valid_len,
             prefix_len=None, doc_layout=None):
    """A Workload from the flags (explicit > preset > defaults)."""
    from meshplan.model.workload import resolve

    return resolve(model=model, seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   dtype=dtype, mask=mask, layout=layout, passes=passes, valid_len=valid_len,
                   prefix_len=prefix_len, doc_layout=doc_layout)


def knobs(tile, mapping, partial_dtype, dkv_dtype, ulysses_degree, inner_ring, team_size, domains,
          extra: list[str] | None) -> dict[str, Any]:
    """The knob flags that were given (None = not given), plus ``--knob name=value`` pairs."""
    from meshplan.core.errors import UserError

    given = {"tile": tile, "mapping": mapping, "partial_dtype": partial_dtype, "dkv_dtype": dkv_dtype,
             "ulysses_degree": ulysses_degree, "inner_ring": inner_ring, "team_size": team_size, "domains": domains}
    out = {k: v for k, v in given.items() if v is not None}
    for item in extra or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UserError("--knob", f"cannot read {item!r}", "write --knob name=value")
        out[name.strip().replace("-", "_")] = value.strip()
    known = _known_knobs()
    unknown = [k for k in out if k not in known]
    if unknown:
        from difflib import get_close_matches

        near = get_close_matches(unknown[0], known, n=1)
        raise UserError("--knob", f"no method has a knob {unknown[0]!r}",
                        (f"did you mean {near[0]}? " if near else "") + f"the knobs: {', '.join(known)}")
    return out


def _known_knobs() -> list[str]:
    """Every knob of any registered method."""
    from meshplan import algorithms

    return sorted({k for alg in algorithms.REGISTRY.values() for k in alg.knobs})


def topology(topo: str | None, gpus: int | None, command: str):
    """Load the topology (``--topo`` is required for ``command``)."""
    from meshplan.core.errors import UserError
    from meshplan.model.topology import Topology

    if topo is None:
        raise UserError("--topo", f"{command} needs a topology", "give --topo NAME_OR_FILE (e.g. --topo h100x32)")
    return Topology.load(topo, gpus)
