"""The attention workload: shapes, dtype, mask, token layout and pass.

Vocabulary (docs/style.md): B batch, S tokens of the whole sequence, H query heads, Hkv KV heads
(GQA group g = H / Hkv), D head dim. ``valid_len`` marks tokens at positions >= valid_len as padding:
they never contribute as keys and their outputs are not computed. A ``docs`` mask may carry padding inside
each document's slot (``docs:1000+24``, TransformerEngine's ``cu_seqlens`` vs ``cu_seqlens_padded``).

Inference: ``prefix_len`` P marks the first P tokens as a KV cache (prefill with a cached prefix, or decode
when S − P is 1): they are keys and values only; queries are the S − P new tokens, which attend to the cache
and causally to each other (Meta, "Context Parallelism for Scalable Million-Token Inference",
arXiv 2411.01783, persistent-KV prefill and decode). Forward only.

*Regions* (:meth:`Workload.regions`) are what a layout cuts: each document of a ``docs`` mask under
``doc_layout='per-doc'`` (every document split across all ranks, as TransformerEngine's THD format and
Megatron-LM do), the cache and the new tokens under a prefix, else the whole sequence.

Presets live in ``meshplan/data/presets.yaml``; explicit flags override a preset, which overrides the
contract's defaults (``--model llama3-8b --seq-len 1M --batch 1 --dtype bf16 --mask causal
--layout zigzag --pass fwd+bwd``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any

import numpy as np

from meshplan.core.errors import UserError
from meshplan.core.units import DTYPE_BYTES, fmt_count, parse_count
from meshplan.model.doc_lengths import document_lengths, parse_cu_seqlens

LAYOUTS = ("contiguous", "zigzag", "striped")
#: The layout of a document placement (``doc_ranks``; planned by doc-place, never enumerated as a layout).
DOC_PLACE = "doc-place"
PASSES = ("fwd", "bwd", "fwd+bwd")
MASK_KINDS = ("full", "causal", "window", "docs")
DOC_LAYOUTS = ("per-doc", "packed")
DEFAULTS: dict[str, Any] = {"model": "llama3-8b", "seq_len": 2**20, "batch": 1, "dtype": "bf16",
                            "mask": "causal", "layout": "zigzag", "passes": "fwd+bwd"}


@dataclass(frozen=True)
class Mask:
    """Which (query, key) pairs attend.

    ``full``: all pairs. ``causal``: key position <= query position. ``window``: causal and
    query - key < ``window`` (sliding window of W tokens, the query's own included). ``docs``: causal
    inside each document of a packed sequence, documents in slots of ``doc_lens`` tokens in order; the last
    ``doc_pad[d]`` tokens of slot d are padding, never a key and never a query with a permitted key (such a
    row's output is O = 0 with LSE = −inf).
    """

    kind: str = "causal"
    window: int = 0
    doc_lens: tuple[int, ...] = ()
    doc_pad: tuple[int, ...] = ()

    @property
    def doc_bounds(self) -> np.ndarray:
        """[n_docs + 1] slot boundaries (positions) of the documents, padding included."""
        return np.cumsum((0,) + tuple(self.doc_lens))

    def doc_real_lens(self) -> tuple[int, ...]:
        """Real (non-padding) tokens of each document: its slot minus its padding."""
        pad = self.doc_pad or (0,) * len(self.doc_lens)
        return tuple(n - p for n, p in zip(self.doc_lens, pad))

    @property
    def doc_real_ends(self) -> np.ndarray:
        """[n_docs] positions where each document's padding starts (its slot's end when it has none)."""
        return self.doc_bounds[:-1] + np.asarray(self.doc_real_lens(), dtype=np.int64)

    def real_end_of(self, pos: np.ndarray) -> np.ndarray:
        """Per position, where the padding of its document starts (docs masks only)."""
        doc = np.searchsorted(self.doc_bounds, np.asarray(pos), side="right") - 1
        return self.doc_real_ends[np.clip(doc, 0, len(self.doc_lens) - 1)]

    @classmethod
    def parse(cls, text: str, field: str = "--mask") -> Mask:
        """Parse ``full | causal | window:W | docs:L1,L2,...`` (sizes accept K/M suffixes).

        A document may be written ``L+P``: L real tokens followed by P padding tokens in its slot of L + P.
        ``cu_seqlens:0,E1,E2,...`` (FlashAttention's varlen offsets, cumulative document ends) is read as
        ``docs:E1,E2-E1,...``.
        """
        kind, _, arg = str(text).strip().partition(":")
        if kind == "cu_seqlens":            # FlashAttention's varlen offsets: 0, end of doc 1, end of doc 2, ...
            return cls.parse("docs:" + _cu_to_lens(arg, field), field)
        if kind not in MASK_KINDS:
            raise UserError(field, f"unknown mask {text!r}", "use full, causal, window:W or docs:L1,L2,...")
        if kind in ("full", "causal"):
            if arg:
                raise UserError(field, f"{kind} takes no argument", f"write --mask {kind}")
            return cls(kind)
        if not arg:
            raise UserError(field, f"{kind} needs an argument", "write window:4096 or docs:1000,3096")
        if kind == "window":
            return cls("window", window=parse_count(arg, field))
        lens, pads = [], []
        for item in arg.split(","):
            real, _, pad = item.partition("+")
            lens.append(parse_count(real, field))
            pads.append(parse_count(pad, field) if pad.strip() not in ("", "0") else 0)
        slots = tuple(n + p for n, p in zip(lens, pads))
        return cls("docs", doc_lens=slots, doc_pad=tuple(pads) if any(pads) else ())

    def permits(self, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
        """[len(q_pos), len(k_pos)] bool: whether each query position attends to each key position."""
        q, k = np.asarray(q_pos)[:, None], np.asarray(k_pos)[None, :]
        if self.kind == "full":
            return np.ones((q.shape[0], k.shape[1]), dtype=bool)
        ok = k <= q
        if self.kind == "window":
            ok &= q - k < self.window
        if self.kind == "docs":
            bounds = self.doc_bounds
            doc_q = np.searchsorted(bounds, q, side="right")
            ok &= doc_q == np.searchsorted(bounds, k, side="right")
            if self.doc_pad:                     # a key at or past its document's real end is padding; so is q
                ok &= q < self.real_end_of(q)
        return ok

    def key_ranges(self, q_pos: np.ndarray, k_pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per query row, the run [lo, hi) of key indices it attends to, for **ascending** ``k_pos``.

        Every mask kind permits a contiguous run of ascending keys (causal: keys up to the query; window: the
        last W of those; docs: those from the query's document start, none for a padding row), so
        ``permits(q, k)[i, j]`` equals ``lo[i] <= j < hi[i]`` — what the executor uses instead of an [Sq, Skv]
        matrix (O(Sq log Skv)).
        Returns two int64 arrays of len(q_pos), hi >= lo (an empty run: hi == lo).
        """
        q, k = np.asarray(q_pos, dtype=np.int64), np.asarray(k_pos, dtype=np.int64)
        if self.kind == "full":
            return np.zeros(len(q), dtype=np.int64), np.full(len(q), len(k), dtype=np.int64)
        hi = np.searchsorted(k, q, side="right")
        if self.kind == "window":
            lo = np.searchsorted(k, q - self.window, side="right")
        elif self.kind == "docs":
            bounds = self.doc_bounds
            doc = np.clip(np.searchsorted(bounds, q, side="right") - 1, 0, len(bounds) - 1)
            lo = np.searchsorted(k, bounds[doc], side="left")
            if self.doc_pad:                     # padding: no key past the real end, no key for a padding row
                end = self.real_end_of(q)
                hi = np.where(q < end, np.minimum(hi, np.searchsorted(k, end, side="left")), lo)
        else:
            lo = np.zeros(len(q), dtype=np.int64)
        return lo.astype(np.int64), np.maximum(hi, lo).astype(np.int64)

    def spec(self) -> str:
        """The CLI spelling of this mask (round-trips through :meth:`parse`)."""
        if self.kind == "window":
            return f"window:{self.window}"
        if self.kind == "docs":
            pad = self.doc_pad or (0,) * len(self.doc_lens)
            return "docs:" + ",".join(f"{n - p}+{p}" if p else str(n) for n, p in zip(self.doc_lens, pad))
        return self.kind


def _cu_to_lens(arg: str, field: str) -> str:
    """``0,E1,E2,...`` (cumulative offsets) -> ``E1,E2-E1,...`` (``doc_lengths.parse_cu_seqlens``, checked)."""
    return ",".join(str(x) for x in document_lengths(parse_cu_seqlens(arg, field), field))


@dataclass(frozen=True)
class Workload:
    """One attention layer's work. Sizes in tokens; ``dtype`` of Q/K/V/O on the wire and in kernels."""

    batch: int
    seq_len: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    mask: Mask = Mask("causal")
    layout: str = "zigzag"
    passes: str = "fwd+bwd"
    valid_len: int | None = None
    model: str | None = None
    prefix_len: int = 0
    doc_layout: str = "per-doc"
    doc_ranks: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def gqa_group(self) -> int:
        """g = H / Hkv: query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of the input dtype (beta)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def n_valid(self) -> int:
        """Tokens that are not padding."""
        return self.seq_len if self.valid_len is None else self.valid_len

    @property
    def n_queries(self) -> int:
        """Query tokens: the S − P new tokens (every token without a prefix)."""
        return self.seq_len - self.prefix_len

    def regions(self) -> list[tuple[int, int, int, bool]]:
        """What the layout cuts, in order: (start, end, real_end, holds_queries) in token positions.

        Tokens in [real_end, end) are padding (a document's padding, or past ``valid_len``).
        """
        S, v = self.seq_len, self.n_valid
        if self.mask.kind == "docs" and self.doc_layout == "per-doc":
            b = self.mask.doc_bounds
            return [(int(a), int(e), min(int(a) + n, v), True)
                    for a, e, n in zip(b[:-1], b[1:], self.mask.doc_real_lens())]
        if self.prefix_len:
            return [(0, self.prefix_len, min(self.prefix_len, v), False), (self.prefix_len, S, v, True)]
        return [(0, S, v, True)]

    def is_real(self, pos: np.ndarray) -> np.ndarray:
        """Bool per position: a real token (not padding)."""
        pos = np.asarray(pos)
        ok = pos < self.n_valid
        if self.mask.kind == "docs" and self.mask.doc_pad:
            ok &= pos < self.mask.real_end_of(pos)
        return ok

    def is_query(self, pos: np.ndarray) -> np.ndarray:
        """Bool per position: a real token whose output is computed (not padding, not the cached prefix)."""
        pos = np.asarray(pos)
        return self.is_real(pos) & (pos >= self.prefix_len)

    @property
    def pass_list(self) -> tuple[str, ...]:
        """``('fwd',)``, ``('bwd',)`` or ``('fwd', 'bwd')``."""
        return ("fwd", "bwd") if self.passes == "fwd+bwd" else (self.passes,)

    def with_(self, **changes: Any) -> Workload:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (mask as its CLI spelling)."""
        d = dataclasses.asdict(self)
        d["mask"] = self.mask.spec()
        if not self.doc_ranks:
            del d["doc_ranks"]
        else:
            d["doc_ranks"] = [list(x) for x in self.doc_ranks]
        return d

    def cli_flags(self) -> str:
        """The workload flags that rebuild this workload (``--seq-len``, ``--heads``, ..., ``--doc-layout``)."""
        flags = [f"--seq-len {self.seq_len}", f"--batch {self.batch}", f"--heads {self.n_heads}",
                 f"--kv-heads {self.n_kv_heads}", f"--head-dim {self.head_dim}", f"--dtype {self.dtype}",
                 f"--mask {self.mask.spec()}", f"--pass {self.passes}"]
        if self.layout != DOC_PLACE:             # doc-place plans its own layout from the documents
            flags.insert(7, f"--layout {self.layout}")
        if self.valid_len is not None:
            flags.append(f"--valid-len {self.valid_len}")
        if self.prefix_len:
            flags.append(f"--prefix-len {self.prefix_len}")
        if self.mask.kind == "docs":
            flags.append(f"--doc-layout {self.doc_layout}")
        return " ".join(flags)

    def describe(self) -> str:
        """One line for tables and logs."""
        name = self.model or "custom"
        extra = f" prefix={fmt_count(self.prefix_len)} new={fmt_count(self.n_queries)}" if self.prefix_len else ""
        if self.mask.kind == "docs" and self.doc_layout != "per-doc":
            extra += f" docs {self.doc_layout}"
        return (f"{name}: B={self.batch} S={fmt_count(self.seq_len)} H={self.n_heads} Hkv={self.n_kv_heads} "
                f"D={self.head_dim} {self.dtype} {self.mask.spec()} {self.layout} {self.passes}{extra}")


def _validate(w: Workload) -> None:
    for name in ("batch", "seq_len", "n_heads", "n_kv_heads", "head_dim"):
        value = getattr(w, name)
        if not isinstance(value, int) or value <= 0:
            raise UserError(_flag(name), f"must be a positive integer, got {value!r}")
    if w.n_heads % w.n_kv_heads:
        divisors = [k for k in range(1, w.n_heads + 1) if w.n_heads % k == 0]
        raise UserError("--kv-heads", f"{w.n_kv_heads} KV heads do not divide {w.n_heads} query heads",
                        f"choose one of {', '.join(map(str, divisors))}")
    if w.dtype not in DTYPE_BYTES:
        raise UserError("--dtype", f"unknown dtype {w.dtype!r}", "use bf16, fp16 or fp32")
    if w.layout == DOC_PLACE:
        _validate_doc_place(w)
    elif w.layout not in LAYOUTS:
        raise UserError("--layout", f"unknown layout {w.layout!r}", "use contiguous, zigzag or striped")
    elif w.doc_ranks:
        raise UserError("workload.doc_ranks", f"a document placement needs layout {DOC_PLACE}, not {w.layout}",
                        "drop doc_ranks or plan with doc-place")
    if w.passes not in PASSES:
        raise UserError("--pass", f"unknown pass {w.passes!r}", "use fwd, bwd or fwd+bwd")
    if w.valid_len is not None and not 0 < w.valid_len <= w.seq_len:
        raise UserError("--valid-len", f"{w.valid_len} is outside 1..{w.seq_len} (--seq-len)",
                        "give the number of real tokens, at most --seq-len")
    if w.mask.kind == "docs" and sum(w.mask.doc_lens) != w.seq_len:
        raise UserError("--mask", f"document lengths add up to {sum(w.mask.doc_lens)}, not --seq-len "
                        f"{w.seq_len}", "make them add up to the sequence length (pad with --valid-len)")
    if w.doc_layout not in DOC_LAYOUTS:
        raise UserError("--doc-layout", f"unknown document layout {w.doc_layout!r}", "use per-doc or packed")
    if not isinstance(w.prefix_len, int) or not 0 <= w.prefix_len < w.seq_len:
        raise UserError("--prefix-len", f"{w.prefix_len} cached tokens leave no new token of --seq-len "
                        f"{w.seq_len}", f"give a prefix of 0..{w.seq_len - 1} tokens (--seq-len counts cache + new)")
    if w.prefix_len and w.passes != "fwd":
        raise UserError("--prefix-len", "a cached prefix is for inference (forward only)", "add --pass fwd")
    if w.prefix_len and w.mask.kind == "docs":
        raise UserError("--prefix-len", "a cached prefix cannot be combined with a docs mask",
                        "use causal (or window) with --prefix-len")
    if w.prefix_len and w.valid_len is not None and w.valid_len <= w.prefix_len:
        raise UserError("--valid-len", f"{w.valid_len} leaves no real new token after the {w.prefix_len} cached",
                        f"give more than {w.prefix_len}")


_FLAGS = {"batch": "--batch", "seq_len": "--seq-len", "n_heads": "--heads", "n_kv_heads": "--kv-heads",
          "head_dim": "--head-dim"}


def _flag(name: str) -> str:
    return _FLAGS.get(name, name)


@functools.cache
def presets() -> dict[str, dict[str, Any]]:
    """The shipped model presets (name -> fields), validated."""
    import yaml
    from pydantic import BaseModel, ConfigDict, PositiveInt

    class Preset(BaseModel):
        model_config = ConfigDict(extra="forbid")
        n_heads: PositiveInt
        n_kv_heads: PositiveInt
        head_dim: PositiveInt
        dtype: str | None = None
        mask: str | None = None
        batch: PositiveInt | None = None
        seq_len: PositiveInt | None = None

    text = resources.files("meshplan").joinpath("data/presets.yaml").read_text()
    raw = yaml.safe_load(text)
    return {name: Preset.model_validate(body).model_dump(exclude_none=True) for name, body in raw.items()}


def resolve(*, model: str | None = None, seq_len: str | int | None = None, batch: int | None = None,
            heads: int | None = None, kv_heads: int | None = None, head_dim: int | None = None,
            dtype: str | None = None, mask: str | None = None, layout: str | None = None,
            passes: str | None = None, valid_len: str | int | None = None, prefix_len: str | int | None = None,
            doc_layout: str | None = None) -> Workload:
    """Build a Workload from CLI-style values: explicit values > the preset > the contract's defaults.

    Raises:
        UserError: unknown preset or any invalid field (one line naming the flag).
    """
    name = model if model is not None else DEFAULTS["model"]
    table = presets()
    if name not in table:
        raise UserError("--model", f"unknown preset {name!r}", f"use one of {', '.join(table)}")
    base = {**DEFAULTS, **table[name]}
    if seq_len is None and mask is not None and str(mask).startswith(("docs:", "cu_seqlens:")):
        seq_len = sum(Mask.parse(mask).doc_lens)       # packed documents: the sequence is their slots
    pick = lambda given, key: given if given is not None else base[key]  # noqa: E731
    return Workload(
        batch=pick(batch, "batch"),
        seq_len=parse_count(pick(seq_len, "seq_len"), "--seq-len"),
        n_heads=pick(heads, "n_heads"), n_kv_heads=pick(kv_heads, "n_kv_heads"),
        head_dim=pick(head_dim, "head_dim"), dtype=pick(dtype, "dtype"),
        mask=Mask.parse(pick(mask, "mask")), layout=pick(layout, "layout"), passes=pick(passes, "passes"),
        valid_len=None if valid_len is None else parse_count(valid_len, "--valid-len"), model=name,
        prefix_len=0 if prefix_len in (None, 0, "0") else parse_count(prefix_len, "--prefix-len"),
        doc_layout=doc_layout or "per-doc")


def _validate_doc_place(w: Workload) -> None:
    """A doc-place workload: a docs mask, one (first rank, group size) per document, no cached prefix."""
    if not w.doc_ranks:
        raise UserError("--layout", f"{DOC_PLACE} is planned from the documents, not given",
                        "drop --layout and use --algo doc-place or meshplan plan-batch")
    if w.mask.kind != "docs" or w.prefix_len or w.valid_len is not None:
        raise UserError("--layout", f"{DOC_PLACE} places documents: it needs a docs mask (no prefix, no "
                        "--valid-len)", "give --mask docs:... or cu_seqlens:...")
    got = tuple(tuple(x) for x in w.doc_ranks)
    if len(got) != len(w.mask.doc_lens) or any(len(x) != 2 or x[0] < 0 or x[1] < 1 for x in got):
        raise UserError("workload.doc_ranks", f"need one (first rank >= 0, group size >= 1) per document "
                        f"({len(w.mask.doc_lens)}), got {len(got)} entries", "plan the documents with doc-place")
    object.__setattr__(w, "doc_ranks", tuple((int(a), int(b)) for a, b in got))
