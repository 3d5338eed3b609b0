"""Routes and their costs on a :class:`~meshplan.model.topology.Topology` (a mixin of it): the links a transfer
crosses, its uncontended latency and bandwidth, and the bytes a set of transfers puts on every link.

A route inside a node is node 0's template shifted by the node (links are numbered node by node in one template
order); across nodes it is the source node's way up to the network and the destination node's way down. Routes and
their statistics are cached per (local pair) template, so vectorised calls cost table lookups.
"""

from __future__ import annotations

import numpy as np

from meshplan.core.errors import UserError


class Routing:
    """Routing methods of :class:`~meshplan.model.topology.Topology` (which holds the graph, the link tables and
    ``gpus_per_node``/``links_per_node``)."""

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
        t = self._stat_tables()
        # one gather a statistic: index (cross-node, src local, dst local) into [2, g, g] tables (a fifth of the
        # time of two gathers and a select: Mesh's tile geometry asks for ~10⁸ pairs at 4096 ranks)
        k = t["lat"].shape[0]                                  # g, or the devices where there are fewer
        key = (src % g) * k + dst % g + (src // g != dst // g) * (k * k)
        lat = np.asarray(t["lat_by_key"][key])
        lat[src == dst] = 0.0
        return lat, np.asarray(t["bw_by_key"][key])

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
        overhead = self.spec.p2p_overhead_us * 1e-6
        return {"lat": lat, "bw": bw, "x_lat": x_lat, "x_bw": x_bw,
                "lat_by_key": np.concatenate([lat.ravel(), x_lat.ravel()]) + overhead,
                "bw_by_key": np.concatenate([bw.ravel(), x_bw.ravel()])}

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

    def own_side_incidence(self, src_rank, dst_rank, src_dev, dst_dev, size_bytes=None):
        """Each transfer's links in the node of each of its end ranks, summed per (end rank, link): (keys end rank ·
        ``links_per_node`` + the link's index in its node, Σ bytes / link capacity over the transfers — per byte
        without ``size_bytes`` —, κ: the largest ``overlap_kappa`` on the routes). A route's links on one side are
        one template per pair of local indices, so transfers are first summed per (end rank, local pair) and each
        template spread over its ranks at once (no per-transfer incidence list: N² transfers at 1024 ranks)."""
        g, L = self.gpus_per_node, self.links_per_node
        src_rank, dst_rank = np.asarray(src_rank, dtype=np.int64), np.asarray(dst_rank, dtype=np.int64)
        src_dev, dst_dev = np.asarray(src_dev, dtype=np.int64), np.asarray(dst_dev, dtype=np.int64)
        weight = np.ones(len(src_rank)) if size_bytes is None else np.broadcast_to(
            np.asarray(size_bytes, dtype=np.float64), src_rank.shape)
        (ns, ls), (nd, ld) = np.divmod(src_dev, g), np.divmod(dst_dev, g)
        kappa = self.kappa()
        n = int(max(src_rank.max(initial=-1), dst_rank.max(initial=-1))) + 1
        keys, secs, kaps = [np.zeros(0, dtype=np.int64)], [np.zeros(0)], [np.zeros(0)]
        for same in (True, False):
            sel = (src_dev != dst_dev) & ((ns == nd) == same)
            if not sel.any():
                continue
            pair = ls[sel] * g + ld[sel]
            for side, end in ((0, src_rank[sel]), (1, dst_rank[sel])):
                sums = np.bincount(end * g * g + pair, weights=weight[sel], minlength=n * g * g)
                held = np.flatnonzero(sums)
                rank, local_pair = np.divmod(held, g * g)
                order = np.argsort(local_pair, kind="stable")
                bounds = np.flatnonzero(np.r_[True, local_pair[order][1:] != local_pair[order][:-1], True])
                for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                    rows, ranks = held[order[lo:hi]], rank[order[lo:hi]]
                    a, b = divmod(int(local_pair[order[lo]]), g)
                    whole = self._template(a, b) if same else np.concatenate(self._cross(a, b))
                    mine = self._template(a, b) if same else self._cross(a, b)[side]
                    if len(mine) == 0:
                        continue
                    kap = float(kappa[self.link_class[whole]].max())
                    keys.append((ranks * L)[:, None] + mine[None, :])
                    secs.append(sums[rows][:, None] / self.link_capacity[mine][None, :])
                    kaps.append(np.full(len(rows) * len(mine), kap))
        return (np.concatenate([k.ravel() for k in keys]), np.concatenate([x.ravel() for x in secs]),
                np.concatenate(kaps))

    def route_bandwidth(self, src: int, dst: int) -> float:
        """Uncontended rate of one flow (bytes/s): the bottleneck capacity and per-flow caps on the route."""
        return float(self.pair_stats(src, dst)[1])
