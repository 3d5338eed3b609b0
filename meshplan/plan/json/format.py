"""The Schedule JSON format: pydantic models (the file edge only). ``meshplan schema`` prints their schema.

The blocking semantics the verifier proves and the executor obeys are in :mod:`meshplan.plan.schedule`'s
docstring; ``semantics`` in every file names that version of them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.core.limits import MAX_DEVICES
from meshplan.plan.schedule import SCHEMA_VERSION

Dtype = Literal["bf16", "fp16", "fp32"]
# integers are bounded by what the in-memory arrays hold (int64 ids and sizes; int32 peers, steps and heads)
Id = Annotated[int, Field(ge=0, le=2**62)]
Int32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
Range = tuple[Id, Id]
MAX_RANKS = MAX_DEVICES     # a schedule runs on at most a topology file's devices
SEMANTICS = ("meshplan-1: per-stream program order; deps on earlier ops of the same rank and pass; consecutive "
             "send/recv of one stream and step form a batch that starts together and ends together; FIFO "
             "matching per (communicator, src, dst); a barrier between passes; tensors live from alloc_op "
             "(or pass start) until all free_after ops end")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamJSON(_Strict):
    """A named stream; comm streams each have their own communicator."""

    name: str
    kind: Literal["compute", "comm"]
    communicator: Int32 | None = None


class ChunkJSON(_Strict):
    """A chunk's tokens: segments (start, stride, count) of global positions, in local order."""

    id: Id
    segments: list[tuple[Id, Annotated[int, Field(ge=1, le=2**40)], Id]]


class TensorJSON(_Strict):
    """A buffer on one rank: ``kind`` of the listed chunks and query heads [h0, h1) (KV kinds: h/g heads).

    An ``out`` tensor holds O and its LSE (natural log, fp32); a row with no permitted key (padding) holds O = 0
    and LSE = −inf, never +inf or NaN.
    """

    id: Id
    rank: Id
    kind: Literal["q", "kv", "out", "dout", "qside", "dside", "dq", "dkv"]
    chunks: list[Id]
    heads: Range
    dtype: Dtype
    size_bytes: Id
    role: Literal["input", "output", "buffer"]
    pass_: Literal["fwd", "bwd"] = Field(alias="pass")
    alloc_op: Annotated[int, Field(ge=-1, le=2**62)] | None = Field(
        None, description="op whose start allocates it; null: exists when its pass starts")
    free_after: list[Id] = Field(default_factory=list, description="freed when all these ops have ended")


class _Op(_Strict):
    id: Id
    stream: str
    deps: list[Id] = Field(default_factory=list)
    pass_: Literal["fwd", "bwd"] = Field(alias="pass")


class SendOp(_Op):
    """Send ``tensor`` to ``peer`` (``dtype`` on the wire); a packed send (``parts`` not empty) sends the parts'
    tokens concatenated in order as one buffer (``tensor`` is the first part), landing as one tensor over their
    chunks in that order."""

    kind: Literal["send"]
    peer: Int32
    tensor: Id
    parts: list[Id] = Field(default_factory=list, description="a packed send's tensors, in order ([] = tensor alone)")
    size_bytes: Id = Field(description="0 for an empty chunk (a decode step's ranks without a query)")
    dtype: Dtype
    step: Int32 | None = Field(None, description="batch id: consecutive send/recv of a stream with one step")


class RecvOp(_Op):
    """Receive into ``tensor`` from ``peer``."""

    kind: Literal["recv"]
    peer: Int32
    tensor: Id
    size_bytes: Id
    dtype: Dtype
    step: Int32 | None = None


class ComputeOp(_Op):
    """Attention of the query chunks x KV chunks (concatenated in order), heads [h0, h1).

    ``q_rows``/``kv_cols``: [start, end) local token ranges that take part (empty list: none restricted);
    ``mask``: ``full`` or the elementwise rule applied with the tokens' global positions.
    """

    kind: Literal["compute"]
    q_chunks: list[Id]
    kv_chunks: list[Id]
    heads: tuple[Int32, Int32]
    q_rows: list[Range]
    kv_cols: list[Range]
    mask: Literal["full", "causal", "window", "docs"]
    inputs: list[Id]
    outputs: list[Id]
    combine: Literal["write", "merge", "accumulate"]
    flops: float = Field(ge=0, allow_inf_nan=False)


class MergeOp(_Op):
    """LSE-merge the partial (O, LSE) ``inputs[0]`` into ``outputs[0]`` (fp32, overflow-free)."""

    kind: Literal["merge"]
    inputs: list[Id]
    outputs: list[Id]
    size_bytes: Id


class AccumulateOp(_Op):
    """``outputs[k] += inputs[0]`` in fp32, each output taking the tokens of its own chunks out of the input."""

    kind: Literal["accumulate"]
    inputs: list[Id]
    outputs: list[Id]
    size_bytes: Id


class AllocOp(_Op):
    """Marks a point in a stream; tensors naming it as ``alloc_op`` are allocated when it starts."""

    kind: Literal["alloc"]


class FreeOp(_Op):
    """Marks a point in a stream that tensors may name in ``free_after``."""

    kind: Literal["free"]


Op = Annotated[Union[SendOp, RecvOp, ComputeOp, MergeOp, AccumulateOp, AllocOp, FreeOp], Field(discriminator="kind")]


class RankJSON(_Strict):
    """One rank's ops in program order."""

    rank: Id
    ops: list[Op]


class PermutationJSON(_Strict):
    """The token permutation (layout) and the seed inputs are drawn with."""

    name: str
    seed: Annotated[int, Field(ge=-(2**62), le=2**62)] = 0


class WorkloadJSON(_Strict):
    """The workload (mask in its CLI spelling)."""

    batch: Annotated[int, Field(ge=1, le=2**40)]
    seq_len: Annotated[int, Field(ge=1, le=2**40)]
    n_heads: Annotated[int, Field(ge=1, le=2**40)]
    n_kv_heads: Annotated[int, Field(ge=1, le=2**40)]
    head_dim: Annotated[int, Field(ge=1, le=2**40)]
    dtype: Dtype
    mask: str
    layout: Literal["contiguous", "zigzag", "striped", "doc-place"]
    passes: Literal["fwd", "bwd", "fwd+bwd"]
    valid_len: Annotated[int, Field(ge=1, le=2**40)] | None = None
    model: str | None = None
    prefix_len: Annotated[int, Field(ge=0, le=2**40)] = 0
    doc_layout: Literal["per-doc", "packed"] = Field(
        "packed", description="docs masks: per-doc (each document cut by the layout; what meshplan writes by "
        "default) or packed; absent in files written before per-document layouts, which cut the packed stream")
    doc_ranks: list[tuple[Annotated[int, Field(ge=0, le=MAX_RANKS)], Annotated[int, Field(ge=1, le=MAX_RANKS)]]] = \
        Field(default_factory=list, description="layout doc-place only: per document (first rank, group size); "
              "size 1 keeps the document whole on its rank, more splits it zigzag over the group's ranks")
    permutation: PermutationJSON


class TopologyRef(_Strict):
    """The topology the schedule was planned for."""

    name: str
    hash: str
    devices: Annotated[int, Field(ge=1, le=MAX_RANKS)]


class ScheduleJSON(_Strict):
    """A meshplan schedule."""

    schema_version: Literal[SCHEMA_VERSION]  # type: ignore[valid-type]
    semantics: str
    algorithm: str
    knobs: dict[str, Any]
    workload: WorkloadJSON
    topology: TopologyRef
    n_ranks: Annotated[int, Field(ge=1, le=MAX_RANKS)]
    n_chunks: Annotated[int, Field(ge=1, le=MAX_RANKS)]
    device_of_rank: list[Id]
    streams: list[StreamJSON]
    chunks: list[ChunkJSON]
    tensors: list[TensorJSON]
    ranks: list[RankJSON]


    @model_validator(mode="after")
    def _counts(self) -> ScheduleJSON:
        if len(self.chunks) != self.n_chunks or sorted(c.id for c in self.chunks) != list(range(self.n_chunks)):
            raise ValueError(f"chunks must list ids 0..{self.n_chunks - 1} (n_chunks) once each")
        return self
