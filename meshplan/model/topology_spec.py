"""The topology YAML format: pydantic models with unit-suffixed keys, unknown keys refused.

A file describes one node template (device, intra-node fabric, NICs), a node count and the network
between nodes. Every number carries its source in a YAML comment (docs/architecture.md invariant 6).
Human units here (``GBps`` = 1e9 bytes/s per direction, ``us``, ``TFLOPS``, ``GB``/``GiB``); the
:class:`~meshplan.model.topology.Topology` converts them once to bytes/s, seconds and FLOP/s.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from meshplan.core.limits import MAX_DEVICES

NonNegFloat = Annotated[float, Field(ge=0)]


# bounds of what a file may describe (larger numbers are typos, and building them would take the host's memory):
MAX_PER_NODE = 1024     # devices (or CPU ranks, NICs, domains) per node; NVL576 racks are the largest today
MAX_NODES = 16384          # with MAX_DEVICES (meshplan.core.limits): nodes x devices per node


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LinkSpec(_Strict):
    """One direction's usable capacity and per-hop latency of a link.

    Give either ``usable_GBps`` (measured or effective) or ``nominal_GBps`` with ``efficiency``, never both.
    """

    usable_GBps: PositiveFloat | None = Field(None, description="usable bandwidth per direction, GB/s (1e9 B/s)")
    nominal_GBps: PositiveFloat | None = Field(None, description="datasheet bandwidth per direction, GB/s")
    efficiency: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="usable / nominal")
    latency_us: NonNegFloat = Field(0.0, description="per-hop latency, microseconds")
    per_flow_GBps: PositiveFloat | None = Field(None, description="the most one flow reaches on this link, GB/s "
                                                "(a measured pair-wise P2P rate below the link's aggregate); "
                                                "default: the link's capacity")

    @model_validator(mode="after")
    def _one_form(self) -> LinkSpec:
        if (self.usable_GBps is None) == (self.nominal_GBps is None):
            raise ValueError("give either usable_GBps, or nominal_GBps with efficiency")
        if (self.nominal_GBps is None) != (self.efficiency is None):
            raise ValueError("nominal_GBps needs efficiency (and efficiency needs nominal_GBps)")
        return self

    @property
    def bytes_per_s(self) -> float:
        """Usable bytes/s per direction."""
        gbps = self.usable_GBps if self.usable_GBps is not None else self.nominal_GBps * self.efficiency
        return gbps * 1e9


class DeviceSpec(_Strict):
    """The accelerator (or CPU rank) in every slot of a node."""

    model: str
    peak_bf16_tflops: PositiveFloat = Field(description="dense BF16 peak, TFLOP/s")
    peak_fp16_tflops: PositiveFloat | None = Field(None, description="dense FP16 peak; default: the BF16 peak")
    peak_fp32_tflops: PositiveFloat = Field(description="FP32 peak used for fp32 attention, TFLOP/s")
    memory_GB: PositiveFloat | None = None
    memory_GiB: PositiveFloat | None = None
    hbm_GBps: PositiveFloat = Field(description="device memory bandwidth, GB/s (merges are memory bound)")
    kernel: str = Field(description="attention efficiency table: a name in topologies/kernels/ or a path")

    @model_validator(mode="after")
    def _one_memory(self) -> DeviceSpec:
        if (self.memory_GB is None) == (self.memory_GiB is None):
            raise ValueError("give exactly one of memory_GB or memory_GiB")
        return self


class NVSwitchFabric(_Strict):
    """All GPUs of the node on NVSwitch: contention only at each GPU's in/out port."""

    kind: Literal["nvswitch"]
    port: LinkSpec


class PcieFabric(_Strict):
    """A PCIe tree: GPU -> switch -> socket (root complex); sockets joined by a socket link (UPI/xGMI).

    GPUs are numbered socket-major, switch-major: socket 0's first switch holds GPUs 0..k−1.
    """

    kind: Literal["pcie"]
    sockets: PositiveInt
    switches_per_socket: PositiveInt
    gpu_link: LinkSpec
    uplink: LinkSpec
    socket_link: LinkSpec


class LoopbackFabric(_Strict):
    """CPU ranks of one host talking over loopback: per-rank links into one shared pool."""

    kind: Literal["loopback"]
    link: LinkSpec
    shared_GBps: PositiveFloat = Field(description="all loopback traffic of the host together, GB/s")
    domains: PositiveInt = Field(1, le=MAX_PER_NODE, description="virtual NUMA-like domains: ranks split into this "
                                 "many "
                                                "contiguous groups (for methods that need domains, e.g. CHARM+)")


class NicSpec(_Strict):
    """NICs of a node: GPU k uses NIC k * count // gpus. Per-flow cap and per-node aggregate both apply."""

    count: PositiveInt = Field(le=MAX_PER_NODE)
    gpu_link: LinkSpec = Field(description="GPU <-> NIC path (PCIe)")
    port: LinkSpec = Field(description="one NIC's port to the network")
    per_flow_GBps: PositiveFloat = Field(description="the most one flow reaches, GB/s")
    node_aggregate_GBps: PositiveFloat = Field(description="all of a node's NICs together, GB/s per direction")


class ComputePool(_Strict):
    """Ranks sharing a host's cores: capacity = cores / threads_per_rank ranks at full speed (or as measured)."""

    cores: PositiveInt = Field(le=MAX_PER_NODE * 16)
    threads_per_rank: PositiveInt = Field(1, le=MAX_PER_NODE * 16)
    capacity_ranks: PositiveFloat | None = Field(None, description="measured ranks' worth of compute of the cores "
                                                 "together (meshplan calibrate); default cores / threads_per_rank")


class NodeSpec(_Strict):
    """The node template."""

    device: DeviceSpec
    gpus: PositiveInt | None = Field(None, le=MAX_PER_NODE, description="devices per node; omit for a host of any "
                                     "rank count")
    max_ranks: PositiveInt | None = Field(None, le=MAX_PER_NODE, description="with gpus omitted: the most ranks the "
                                          "host takes")
    fabric: Union[NVSwitchFabric, PcieFabric, LoopbackFabric] = Field(discriminator="kind")
    nics: NicSpec | None = None
    compute_pool: ComputePool | None = None

    @model_validator(mode="after")
    def _shape(self) -> NodeSpec:
        if self.gpus is None and (self.fabric.kind != "loopback" or self.max_ranks is None):
            raise ValueError("gpus is required (only a loopback host may omit it and give max_ranks)")
        if isinstance(self.fabric, PcieFabric) and self.gpus is not None:
            per = self.fabric.sockets * self.fabric.switches_per_socket
            if self.gpus % per:
                raise ValueError(f"gpus ({self.gpus}) must divide evenly over {per} PCIe switches")
        if self.nics is not None and self.gpus is not None and self.gpus % self.nics.count:
            raise ValueError(f"nics.count ({self.nics.count}) must divide gpus ({self.gpus})")
        return self


class NetworkSpec(_Strict):
    """Between nodes: a non-blocking switch (full bisection), or a rail-optimised fabric, with a per-traversal
    latency.

    ``rail`` (NVIDIA's rail-optimised DGX SuperPOD design): NIC k of every node sits on leaf switch k (rail k).
    Traffic between the same rails stays in that leaf; cross-rail traffic goes up to the spine
    (``cross_rail: spine``) through a leaf uplink of the NIC port's rate / ``spine_oversubscription`` (each
    NIC's share of its leaf's uplinks), or first over NVLink to the source node's GPU on the destination's
    rail and out of that GPU's NIC (``pxn``, NCCL's PXN: ``NCCL_PXN_DISABLE=0``), never touching the spine.
    """

    kind: Literal["nonblocking", "rail"] = "nonblocking"
    latency_us: NonNegFloat = 0.0
    cross_rail: Literal["spine", "pxn"] = Field("spine", description="rail: how cross-rail traffic travels")
    spine_oversubscription: Annotated[float, Field(ge=1)] = Field(
        1.0, description="rail: leaf downlink / uplink capacity (1: non-blocking; 2: a 2:1 oversubscribed spine)")
    spine_latency_us: NonNegFloat = Field(0.0, description="rail: extra latency of the leaf -> spine -> leaf hops")


class OverlapSpec(_Strict):
    """kappa per link class: the fraction of compute lost while a transfer of that class is active.

    Calculon's ``processor_usage`` (0.15 NVLink, 0.02 network); other classes are ours to measure.
    """

    nvlink: Annotated[float, Field(ge=0, lt=1)] = 0.0
    pcie: Annotated[float, Field(ge=0, lt=1)] = 0.0
    socket: Annotated[float, Field(ge=0, lt=1)] = 0.0
    net: Annotated[float, Field(ge=0, lt=1)] = 0.0
    loopback: Annotated[float, Field(ge=0, lt=1)] = 0.0


class TransferCpuSpec(_Strict):
    """Per link class: core-microseconds per MB (10⁶ bytes) moved, both ends together — the CPU a transfer takes
    from a shared compute pool (0: none; only nodes with a ``compute_pool`` use it)."""

    nvlink: NonNegFloat = 0.0
    pcie: NonNegFloat = 0.0
    socket: NonNegFloat = 0.0
    net: NonNegFloat = 0.0
    loopback: NonNegFloat = 0.0


class TopologySpec(_Strict):
    """A topology file."""

    name: str
    description: str = ""
    nodes: PositiveInt = Field(le=MAX_NODES, description="node count when --gpus is not given")
    node: NodeSpec
    network: NetworkSpec = NetworkSpec()
    p2p_overhead_us: NonNegFloat = Field(description="software cost per message (alpha_sw), microseconds")
    overlap_kappa: OverlapSpec = OverlapSpec()
    transfer_kappa: OverlapSpec = Field(
        OverlapSpec(), description="per link class: the fraction of a transfer's rate lost while a rank at either "
        "end computes (CPU ranks: the cores that compute also copy the bytes); 0 on GPUs, whose copy engines and "
        "NICs move data on their own")
    transfer_cpu_us_per_MB: TransferCpuSpec = Field(
        TransferCpuSpec(), description="per link class: the CPU a transfer costs on a node with a compute pool, "
        "core-microseconds per MB moved (both ends together: gloo's packing and socket copies, the kernel's TCP "
        "loopback); the simulator takes it from the pool the ranks compute on (docs/cost-model.md, CPU ranks)")
    calibration: str | None = Field(None, description="a calibration file (meshplan calibrate), relative to this "
                                    "file; its measured values replace the ones above "
                                    "(meshplan.model.calibration_file)")

    @model_validator(mode="after")
    def _size(self) -> TopologySpec:
        devices = self.nodes * (self.node.gpus or self.node.max_ranks or 1)
        if devices > MAX_DEVICES:
            raise ValueError(f"{self.nodes} nodes x {self.node.gpus or self.node.max_ranks} devices = {devices}, more "
                             f"than the {MAX_DEVICES} a file may describe")
        return self
