"""Topology: devices, switches, NICs and sockets as a networkx graph of directed links.

Loaded from a YAML file (:mod:`meshplan.model.topology_spec`), by path or by the bare name of a shipped file
(``h100x32`` or ``h100x32.yaml``; :mod:`meshplan.model.topo_files`). ``gpus`` picks the device count as the CLI
contract says: a multiple of the GPUs per node (that many nodes), or a divisor of it (placed inside one node,
NUMA domain first).

Every directed link has a usable capacity (bytes/s), a latency (s), a class (``nvlink``, ``pcie``,
``socket``, ``net``, ``loopback``) and a per-flow cap (bytes/s; the NIC's, on network links).
``route(src, dst)`` gives the link ids a transfer crosses (routes and their costs: :mod:`meshplan.model.routing`,
a mixin of the class). Links are numbered node by node in one
template order, so shifting every device by one node maps link ``n·L + k`` to ``(n+1)·L + k``: the
symmetry the simulator exploits.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import networkx as nx
import numpy as np

from meshplan.model.calibration_file import calibrated
from meshplan.model.kernel_tables import KernelTable, load_kernel_table
from meshplan.model.memory_spec import DEFAULTS as MEMORY_DEFAULTS
from meshplan.model.memory_spec import MemorySpec
from meshplan.model.routing import Routing
from meshplan.model.topo_files import find_topology, parse_topology, place_devices
from meshplan.model.topology_spec import LinkSpec, TopologySpec

LINK_CLASSES = ("loopback", "nvlink", "pcie", "socket", "net")


class Topology(Routing):
    """A cluster with a fixed device count. Device ids 0..n_devices−1 are in locality order."""

    def __init__(self, spec: TopologySpec, gpus: int | None = None, source: str = "") -> None:
        self.file_spec = spec                     # as written; ``spec`` has the calibration's values applied
        spec, self.calibration = calibrated(spec, source)
        self.spec, self.source, self.name = spec, source, spec.name
        self.gpus_per_node, self.n_nodes, self.n_devices = place_devices(spec, gpus)
        self.graph = nx.DiGraph()
        self._links: list[tuple[str, str]] = []
        self._attrs: list[tuple[float, float, str, float]] = []
        self.device_vertex: list[str] = []
        self.node_of_device = np.repeat(np.arange(self.n_nodes), self.gpus_per_node)[: self.n_devices]
        self.domain_of_device = np.zeros(self.n_devices, dtype=np.int64)
        for n in range(self.n_nodes):
            self._build_node(n)
        self.links_per_node = len(self._links) // self.n_nodes
        self._finish_links()
        self._route_cache: dict[tuple, np.ndarray] = {}
        self._stats: dict[str, np.ndarray] | None = None

    # ---------------------------------------------------------------- loading
    @classmethod
    def load(cls, name_or_path: str, gpus: int | None = None) -> Topology:
        """Load a topology file by path or shipped name.

        Raises:
            UserError: no such file, invalid YAML or keys, or a device count the topology cannot place.
        """
        path, text = find_topology(name_or_path)
        spec = parse_topology(text, path)
        return cls(spec, gpus, source=str(path))

    # ---------------------------------------------------------------- building
    def _add_link(self, u: str, v: str, link: LinkSpec, cls_: str, both: bool = True,
                  flow_cap: float = np.inf, cap: float | None = None) -> None:
        capacity = link.bytes_per_s if cap is None else cap
        if link.per_flow_GBps is not None:
            flow_cap = min(flow_cap, link.per_flow_GBps * 1e9)
        for a, b in ((u, v), (v, u)) if both else ((u, v),):
            self.graph.add_edge(a, b, id=len(self._links))
            self._links.append((a, b))
            self._attrs.append((capacity, link.latency_us * 1e-6, cls_, flow_cap))

    def _build_node(self, n: int) -> None:
        node, fab = self.spec.node, self.spec.node.fabric
        first = n * self.gpus_per_node
        local = range(min(self.gpus_per_node, self.n_devices - first))
        devs = [f"n{n}/gpu{i}" for i in local]
        for v in devs:
            self.graph.add_node(v, device=True)
        self.device_vertex.extend(devs)
        if fab.kind == "nvswitch":
            for v in devs:
                self._add_link(v, f"n{n}/nvswitch", fab.port, "nvlink")
        elif fab.kind == "pcie":
            per_switch = self.gpus_per_node // (fab.sockets * fab.switches_per_socket)
            for s in range(fab.sockets):
                for k in range(fab.switches_per_socket):
                    self._add_link(f"n{n}/pcie{s}.{k}", f"n{n}/socket{s}", fab.uplink, "pcie")
                for t in range(s + 1, fab.sockets):
                    self._add_link(f"n{n}/socket{s}", f"n{n}/socket{t}", fab.socket_link, "socket")
            for i, v in enumerate(devs):
                sw = i // per_switch
                s, k = divmod(sw, fab.switches_per_socket)
                self._add_link(v, f"n{n}/pcie{s}.{k}", fab.gpu_link, "pcie")
                self.domain_of_device[first + i] = n * fab.sockets + s
        else:
            self.domain_of_device[first:first + len(devs)] = np.arange(len(devs)) * fab.domains // max(len(devs), 1)
            shared = LinkSpec(usable_GBps=fab.shared_GBps)
            self._add_link(f"n{n}/lo-in", f"n{n}/lo-out", shared, "loopback", both=False)
            for v in devs:
                self._add_link(v, f"n{n}/lo-in", fab.link, "loopback", both=False)
                self._add_link(f"n{n}/lo-out", v, fab.link, "loopback", both=False)
        if fab.kind == "nvswitch":
            self.domain_of_device[first:first + len(devs)] = n
        if node.nics is not None and self.n_nodes > 1:
            self._build_nics(n, devs)

    def _build_nics(self, n: int, devs: list[str]) -> None:
        nics, net = self.spec.node.nics, self.spec.network
        per_nic = self.gpus_per_node // nics.count
        agg = LinkSpec(usable_GBps=nics.node_aggregate_GBps, latency_us=net.latency_us / 2)
        self._add_link(f"n{n}/net-out", "net", agg, "net", both=False)
        self._add_link("net", f"n{n}/net-in", agg, "net", both=False)
        spine = net.kind == "rail" and net.cross_rail == "spine"
        for k in range(nics.count):
            nic = f"n{n}/nic{k}"
            cap = nics.per_flow_GBps * 1e9
            self._add_link(nic, f"n{n}/net-out", nics.port, "net", both=False, flow_cap=cap)
            self._add_link(f"n{n}/net-in", nic, nics.port, "net", both=False, flow_cap=cap)
            for v in devs[k * per_nic:(k + 1) * per_nic]:
                self._add_link(v, nic, nics.gpu_link, "pcie")
            if spine:                  # this NIC's share of its leaf's uplinks to the spine, each way
                up = LinkSpec(usable_GBps=nics.port.bytes_per_s / 1e9 / net.spine_oversubscription,
                              latency_us=net.spine_latency_us / 2)
                self._add_link(f"n{n}/rail{k}", "spine", up, "net", both=False)
                self._add_link("spine", f"n{n}/rail{k}-in", up, "net", both=False)

    def _finish_links(self) -> None:
        cap, lat, cls_, flow = zip(*self._attrs)
        self.link_capacity = np.asarray(cap, dtype=np.float64)
        self.link_latency_s = np.asarray(lat, dtype=np.float64)
        self.link_class = np.asarray([LINK_CLASSES.index(c) for c in cls_], dtype=np.int8)
        self.link_flow_cap = np.asarray(flow, dtype=np.float64)
        self.n_links = len(self._links)
        del self._attrs

    # ---------------------------------------------------------------- queries
    def link_name(self, link: int) -> str:
        """``'u -> v'`` for a link id."""
        u, v = self._links[link]
        return f"{u} -> {v}"

    def same_node(self, a, b):
        """Whether devices are in one node (arrays broadcast)."""
        return self.node_of_device[a] == self.node_of_device[b]

    @functools.cached_property
    def kernel(self) -> KernelTable:
        """The device's attention efficiency table (the calibration's, when the file names one)."""
        if self.calibration is not None:
            return KernelTable(self.calibration.kernel)
        base = str(Path(self.source).parent) if self.source else None
        return load_kernel_table(self.spec.node.device.kernel, base)

    @functools.cached_property
    def memory_model(self) -> MemorySpec:
        """The memory model's coefficients: the calibration's, else the default for the device kind (a CPU rank
        when the node has a compute pool or its model names a CPU, else a GPU)."""
        if self.calibration is not None and self.calibration.memory is not None:
            return self.calibration.memory
        cpu = self.spec.node.compute_pool is not None or self.spec.node.device.model.lower().startswith("cpu")
        return MEMORY_DEFAULTS["cpu" if cpu else "gpu"]

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s of one device for attention in ``dtype``."""
        d = self.spec.node.device
        tflops = {"bf16": d.peak_bf16_tflops, "fp16": d.peak_fp16_tflops or d.peak_bf16_tflops,
                  "fp32": d.peak_fp32_tflops}[dtype]
        return tflops * 1e12

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes."""
        d = self.spec.node.device
        return d.memory_GB * 1e9 if d.memory_GB is not None else d.memory_GiB * 2**30

    @property
    def hbm_bytes_per_s(self) -> float:
        """Device memory bandwidth, bytes/s."""
        return self.spec.node.device.hbm_GBps * 1e9

    @property
    def n_domains(self) -> int:
        """NUMA sockets, nodes, or declared virtual domains the devices fall into."""
        return int(self.domain_of_device.max(initial=0)) + 1

    @property
    def pool_capacity(self) -> float | None:
        """Ranks' worth of compute the shared pool gives (None: every device computes on its own)."""
        pool = self.spec.node.compute_pool
        if pool is None:
            return None
        return pool.capacity_ranks if pool.capacity_ranks is not None else pool.cores / pool.threads_per_rank

    def kappa(self) -> np.ndarray:
        """kappa per link class, in LINK_CLASSES order."""
        k = self.spec.overlap_kappa
        return np.asarray([getattr(k, c) for c in LINK_CLASSES], dtype=np.float64)

    def transfer_kappa(self) -> np.ndarray:
        """Per link class, the fraction of a flow's rate lost while an end rank computes (LINK_CLASSES order)."""
        k = self.spec.transfer_kappa
        return np.asarray([getattr(k, c) for c in LINK_CLASSES], dtype=np.float64)

    def transfer_cpu_s_per_byte(self) -> np.ndarray:
        """Per link class, core-seconds of the compute pool one byte moved takes (LINK_CLASSES order)."""
        c = self.spec.transfer_cpu_us_per_MB
        return np.asarray([getattr(c, k) for k in LINK_CLASSES], dtype=np.float64) * 1e-12

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 of the spec and the device count (a schedule records it)."""
        spec = self.spec.model_dump(mode="json")
        if self.calibration is None:              # files without the calibration keys keep their hashes
            spec.pop("calibration")
            if spec["node"]["compute_pool"] is not None and spec["node"]["compute_pool"]["capacity_ranks"] is None:
                del spec["node"]["compute_pool"]["capacity_ranks"]
        body = {"spec": spec, "devices": self.n_devices}
        if self.calibration is not None:          # its kernel table is not in the spec
            body["kernel"] = self.calibration.kernel.model_dump(mode="json")
        blob = json.dumps(body, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @property
    def node_symmetric(self) -> bool:
        """Whether shifting all devices by whole nodes is an automorphism (all nodes full and alike)."""
        return self.n_nodes > 1 and self.n_devices == self.n_nodes * self.gpus_per_node
