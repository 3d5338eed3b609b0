"""Topology: devices, switches, NICs and sockets as a networkx graph of directed links.

Loaded from a YAML file (:mod:`meshplan.model.topology_spec`), by path or by the bare name of a shipped file
(``h100x32`` or ``h100x32.yaml``; :mod:`meshplan.model.topo_files`). ``gpus`` picks the device count as the CLI
contract says: a multiple of the GPUs per node (that many nodes), or a divisor of it (placed inside one node,
NUMA domain first).

Every directed link has a usable capacity (bytes/s), a latency (s), a class (``nvlink``, ``pcie``,
``socket``, ``net``, ``loopback``) and a per-flow cap (bytes/s; the NIC's, on network links).
``route(src, dst)`` gives the link ids a transfer crosses. Links are numbered node by node in one
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

from meshplan.core.errors import UserError
from meshplan.model.calibration_file import calibrated
from meshplan.model.kernel_tables import KernelTable, load_kernel_table
from meshplan.model.memory_spec import DEFAULTS as MEMORY_DEFAULTS
from meshplan.model.memory_spec import MemorySpec
from meshplan.model.topo_files import find_topology, parse_topology, place_devices
from meshplan.model.topology_spec import LinkSpec, TopologySpec

LINK_CLASSES = ("loopback", "nvlink", "pcie", "socket", "net")


class Topology:
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

    def route(self, src: int, dst: int) -> np.ndarray:
        """Link ids from device ``src`` to device ``dst`` (empty when equal). Cached.

        The route is the fewest-hops path that passes through no other device (devices do not forward).
        Inside a node it is node 0's route shifted; across nodes it is src -> ``net`` -> dst.
        """
        key = (src, dst)
        hit = self._route_cache.get(key)
        if hit is None:
            g, L = self.gpus_per_node, self.links_per_node
            (ns, ls), (nd, ld) = divmod(src, g), divmod(dst, g)
            if ns == nd:
                hit = self._template(ls, ld) + ns * L
            else:
                up, down = self._cross(ls, ld)
                hit = np.concatenate([up + ns * L, down + nd * L])
            self._route_cache[key] = hit
        return hit

    def rail_of(self, local: int) -> int:
        """The rail (NIC index) of a device's local index in its node."""
        nics = self.spec.node.nics
        return local * nics.count // self.gpus_per_node

    def _cross(self, ls: int, ld: int) -> tuple[np.ndarray, np.ndarray]:
        """(links in the source node, links in the destination node), node-0 numbering, from local device ``ls``
        to local device ``ld`` of another node: up to the network and down, by the network's routing."""
        key = ("x", ls, ld)
        if key not in self._route_cache:
            net = self.spec.network
            up, down = self._template(ls, "net"), self._template("net", ld)
            rs, rd = self.rail_of(ls), self.rail_of(ld)
            if net.kind == "rail" and rs != rd:
                if net.cross_rail == "pxn":    # NVLink to this node's GPU on the destination's rail, then its NIC
                    per = self.gpus_per_node // self.spec.node.nics.count
                    proxy = rd * per + ls % per
                    up = np.concatenate([self._template(ls, proxy), self._template(proxy, "net")])
                else:                          # through the spine: up from rail rs, down to rail rd
                    sid = self._spine_links()
                    up = np.r_[up, sid[("up", rs)]]
                    down = np.r_[sid[("down", rd)], down]
            self._route_cache[key] = (up.astype(np.int64), down.astype(np.int64))
        return self._route_cache[key]

    def _spine_links(self) -> dict[tuple[str, int], int]:
        """Node 0's leaf-uplink link ids per rail (``('up', k)``, ``('down', k)``)."""
        out = {}
        for i, (u, v) in enumerate(self._links[: self.links_per_node]):
            if v == "spine":
                out[("up", int(u.split("/rail")[1]))] = i
            elif u == "spine":
                out[("down", int(v.split("/rail")[1].split("-")[0]))] = i
        return out

    def _template(self, a, b) -> np.ndarray:
        key = ("tpl", a, b)
        if key not in self._route_cache:
            u = self.device_vertex[a] if a != "net" else "net"
            v = self.device_vertex[b] if b != "net" else "net"
            self._route_cache[key] = self._bfs(u, v)
        return self._route_cache[key]

    def _bfs(self, s: str, t: str) -> np.ndarray:
        if s == t:
            return np.zeros(0, dtype=np.int64)
        succ, parent, frontier = self.graph.succ, {s: None}, [s]
        while frontier and t not in parent:
            nxt = []
            for u in frontier:
                for v in succ[u]:
                    if v not in parent and (v == t or not self.graph.nodes[v].get("device")):
                        parent[v] = u
                        nxt.append(v)
            frontier = nxt
        if t not in parent:
            if "net" in (s, t):
                raise UserError("topology", f"{self.name}: no route from {s} to {t}: its nodes have no NICs",
                                "add a nics: block to the file (meshplan topo import: give --nic-GBps), or use "
                                "one node's GPUs")
            raise UserError("topology", f"{self.name}: no route from {s} to {t}")
        path, v = [], t
        while parent[v] is not None:
            path.append(self.graph.edges[parent[v], v]["id"])
            v = parent[v]
        return np.asarray(path[::-1], dtype=np.int64)

    def pair_stats(self, src, dst) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised uncontended (latency_s, bandwidth bytes/s) for device pairs (arrays broadcast).

        latency = alpha_sw + the hops' latencies; bandwidth = the bottleneck of link capacities and
        per-flow caps on the route (inf, with latency 0, for src == dst).
        """
        src, dst = np.broadcast_arrays(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
        g = self.gpus_per_node
        (ns, ls), (nd, ld) = np.divmod(src, g), np.divmod(dst, g)
        t = self._stat_tables()
        same = ns == nd
        lat = np.where(same, t["lat"][ls, ld], t["x_lat"][ls, ld])
        bw = np.where(same, t["bw"][ls, ld], t["x_bw"][ls, ld])
        overhead = self.spec.p2p_overhead_us * 1e-6
        lat = np.where(src == dst, 0.0, lat + overhead)
        return lat, bw

    def _stat_tables(self) -> dict[str, np.ndarray]:
        if self._stats is None:
            self._stats = self._build_stat_tables()
        return self._stats

    def _build_stat_tables(self) -> dict[str, np.ndarray]:
        g = min(self.gpus_per_node, self.n_devices)
        stats = lambda r: (self.link_latency_s[r].sum(),  # noqa: E731
                           min(self.link_capacity[r].min(), self.link_flow_cap[r].min()) if len(r) else np.inf)
        lat, bw = np.zeros((g, g)), np.full((g, g), np.inf)
        for a in range(g):
            for b in range(g):
                lat[a, b], bw[a, b] = stats(self._template(a, b))
        x_lat, x_bw = np.zeros((g, g)), np.full((g, g), np.inf)
        if self.n_nodes > 1:
            for a in range(g):
                for b in range(g):
                    x_lat[a, b], x_bw[a, b] = stats(np.concatenate(self._cross(a, b)))
        return {"lat": lat, "bw": bw, "x_lat": x_lat, "x_bw": x_bw}

    def _route_parts(self, src: np.ndarray, dst: np.ndarray):
        """(local pair key ls·g + ld per pair, [(pairs selected, the node a template shifts by, template of a key)]):
        routes inside a node, and a cross-node route's source and destination sides."""
        g = self.gpus_per_node
        (ns, ls), (nd, ld) = np.divmod(src, g), np.divmod(dst, g)
        moving = src != dst
        same = moving & (ns == nd)
        parts = [(same, ns, lambda k: self._template(*divmod(k, g)))]
        if self.n_nodes > 1:
            parts += [(moving & ~same, ns, lambda k: self._cross(*divmod(k, g))[0]),
                      (moving & ~same, nd, lambda k: self._cross(*divmod(k, g))[1])]
        return ls * g + ld, parts

    def route_incidence(self, src, dst) -> tuple[np.ndarray, np.ndarray]:
        """(pair index, link id) for every link on every (src, dst) device pair's route (:meth:`route`, a link
        on a route twice listed twice), vectorised: one template per pair of local indices, shifted per node."""
        src, dst = np.broadcast_arrays(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64))
        key, parts = self._route_parts(src.ravel(), dst.ravel())
        L = self.links_per_node
        pairs, links = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for sel, node, template in parts:
            idx = np.flatnonzero(sel)
            if len(idx) == 0:
                continue
            order = idx[np.argsort(key[idx], kind="stable")]
            keys = key[order]
            bounds = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
            for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                rows = order[lo:hi]
                tpl = template(int(keys[lo]))
                pairs.append(np.repeat(rows, len(tpl)))
                links.append((tpl[None, :] + (node[rows] * L)[:, None]).ravel())
        return np.concatenate(pairs), np.concatenate(links)

    def link_loads(self, src, dst, size_bytes) -> np.ndarray:
        """[n_links] bytes crossing every link when each (src, dst) pair moves ``size_bytes`` (vectorised).

        Without listing every (pair, link) incidence: the bytes are first summed per (pair of local indices, node)
        — a route is one template per local pair, shifted by the node — then each template's links take its
        nodes' sums at once. Sums of whole bytes, so exact in any order."""
        src, dst, size = np.broadcast_arrays(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                                             np.asarray(size_bytes, dtype=np.float64))
        size = size.ravel()
        key, parts = self._route_parts(src.ravel(), dst.ravel())
        g, L, n_nodes = self.gpus_per_node, self.links_per_node, self.n_nodes
        loads = np.zeros(self.n_links)
        for sel, node, template in parts:
            idx = np.flatnonzero(sel)
            if len(idx) == 0:
                continue
            per = np.bincount(key[idx] * n_nodes + node[idx], weights=size[idx], minlength=g * g * n_nodes)
            per = per.reshape(g * g, n_nodes)
            for k in np.flatnonzero(per.any(axis=1)).tolist():
                tpl = template(k)
                if len(tpl):
                    nodes = np.flatnonzero(per[k])
                    np.add.at(loads, (tpl[:, None] + nodes[None, :] * L).ravel(),
                              np.broadcast_to(per[k, nodes], (len(tpl), len(nodes))).ravel())
        return loads

    def route_bandwidth(self, src: int, dst: int) -> float:
        """Uncontended rate of one flow (bytes/s): the bottleneck capacity and per-flow caps on the route."""
        return float(self.pair_stats(src, dst)[1])

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
