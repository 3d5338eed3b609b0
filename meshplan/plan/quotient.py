"""Quotient schedules: the representative ranks' programs alone, built once the builder has proved that every other
rank repeats one of them.

A simulation reduced by symmetry (:mod:`meshplan.cost.symmetry`) runs one node's ranks, yet the schedule of every rank
was built first and checked whole — at 1024 ranks a USP schedule holds 7.7M ops (11 s to assemble, 7 GB to simulate)
of which the simulation reads 1/128. A quotient build runs the algorithm's builder calls over every rank as usual (a
call adds one op per rank of its ``ranks``, in program order) and checks each call against every candidate symmetry σ
(a rank permutation moving whole nodes: those the algorithm declares, else the shift by one node):

* the call's ranks are closed under σ, and the op of rank σ(r) has rank r's kind, stream, step, bytes, dtype,
  combine and FLOPs; its peer is σ(r's peer); its deps are the σ-images of r's deps, or members of the same P2P batch
  (a batch starts and ends together); a compute op's duration — priced by the cost model itself, on the call's ops of
  every rank (``price``) — is bit-equal (kernel shapes may differ: a zigzag block of c × 2c and one of 2c × c take
  the same time; each orbit's shapes are kept for the workspaces, :attr:`Quotient.member_s_q`), and so are its inputs'
  bytes (staging reads them);
* at the end, each rank's tensors — bytes, kind, dtype, pass, head width, chunk count, allocating op and freeing ops
  (by batch) — are the σ-image of its preimage's, as a multiset (a rank may create its pieces in another order),
  compared as a 64-bit hash summed over a rank's tensors.

Every call invariant means every program is: rank σ(r) runs rank r's program position by position with the same
durations, transfers and memory, which is what :func:`meshplan.cost.symmetry.find_reduction` checks on a whole
schedule. Only the representatives' ops and tensors (one rank of each orbit, on node 0) are stored and assembled;
each transfer's partner is the representative's copy of the op it pairs with — the op of the same call on the
representative of its peer. A call that fails the check stops the build (:class:`NotSymmetric`): the caller builds the
schedule whole or leaves the candidate unsimulated. ``docs`` masks are not tried (:func:`quotient_workload`).

The result is a :class:`~meshplan.plan.schedule.Schedule` of ``n_ranks`` ranks of which only the representatives
have ops, its ``quotient`` saying so: it is simulated (:func:`meshplan.cost.simulate.simulate`) and measured
(:mod:`meshplan.cost.metrics`), never written or verified. ``tests/cost/test_quotient.py`` checks its predictions
equal the whole schedule's, key for key, and that schedules whose ranks are not alike are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from meshplan.plan.schedule import KIND


class NotSymmetric(Exception):
    """A builder call is not invariant under a candidate symmetry: build the schedule whole."""


@dataclass(frozen=True)
class Quotient:
    """What a quotient schedule holds: ``reps`` ([k] the representative ranks: each orbit's on the first node of its
    node orbit), ``partner`` ([n_ops] each send's and recv's partner among the representatives' ops, −1 for others),
    ``orbit_size`` (ranks per orbit: the nodes of a node orbit)."""

    reps: np.ndarray
    partner: np.ndarray
    orbit_size: int
    node_rep: np.ndarray               # [nodes] the first node of each node's orbit: whose links stand for its links
    #: [n_ops, orbit size] each op's kernel shape on its orbit's rank on every node, where some differ (workspaces)
    member_s_q: np.ndarray | None = None
    member_s_kv: np.ndarray | None = None


def quotient_workload(workload) -> bool:
    """Whether a quotient build may be tried for the workload: not under ``docs`` masks (their kernels are priced by
    the documents' segments, and the search reports per-document statistics from every rank's ops)."""
    return workload.mask.kind != "docs"


def moves_whole_nodes(sigma: np.ndarray, device_of_rank: np.ndarray, gpus_per_node: int, n_nodes: int) -> bool:
    """Whether the rank permutation ``sigma`` moves whole nodes: every rank of a node to one node, at the same local
    device index, distinct nodes to distinct nodes (all nodes alike on a non-blocking network: an automorphism of the
    topology)."""
    dev = np.asarray(device_of_rank)
    if sorted(np.asarray(sigma).tolist()) != list(range(len(dev))):
        return False
    if not np.array_equal(dev[sigma] % gpus_per_node, dev % gpus_per_node):
        return False
    node, image = dev // gpus_per_node, dev[sigma] // gpus_per_node
    target = np.full(n_nodes, -1)
    target[node] = image
    return bool(np.array_equal(target[node], image) and len(np.unique(target)) == n_nodes)


def orbit_reps(n: int, device_of_rank: np.ndarray, gpus_per_node: int, n_nodes: int,
               gens: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """(rep_of[rank]: its orbit's member on the first node of its node orbit, node_rep[node]: that first node), if the
    permutations ``gens`` move whole nodes (every rank of a node to one node, at the same local index) and generate
    rank orbits that hold one rank on every node of their node orbit, all node orbits of one size; None otherwise."""
    if not all(moves_whole_nodes(s, device_of_rank, gpus_per_node, n_nodes) for s in gens):
        return None
    node = np.asarray(device_of_rank) // gpus_per_node
    orbit, rep_of = np.full(n, -1), np.full(n, -1)
    node_rep = np.full(n_nodes, -1)
    size = None
    for start in range(n):
        if orbit[start] >= 0:
            continue
        members, frontier = [start], [start]
        orbit[start] = start
        while frontier:
            nxt = []
            for r in frontier:
                for s in gens:
                    t = int(s[r])
                    if orbit[t] < 0:
                        orbit[t] = start
                        members.append(t)
                        nxt.append(t)
            frontier = nxt
        nodes = node[members]
        first = int(nodes.min())
        if len(np.unique(nodes)) != len(members) or (size is not None and len(members) != size) or \
                (node_rep[nodes] >= 0).any() and not (node_rep[nodes] == first).all():
            return None
        size = len(members)
        node_rep[nodes] = first
        rep_of[members] = members[int(np.flatnonzero(nodes == first)[0])]
    if (node_rep < 0).any() or size == 1:
        return None
    return rep_of, node_rep


class _Grow:
    """A growing [ids] int64 array (``fill`` where unset); its last slot stays ``fill``, so an id of −1 reads it."""

    def __init__(self, fill: int = -1, dtype=np.int64) -> None:
        self.fill = fill
        self.a = np.full(1 << 16, fill, dtype=dtype)

    def set(self, ids: np.ndarray, values) -> None:
        """Set ``ids`` (a builder call's: consecutive, ascending) to ``values``."""
        first, top = int(ids[0]), int(ids[-1]) + 1
        if top + 1 > len(self.a):
            grown = np.empty(max(top + 1, 2 * len(self.a)), dtype=self.a.dtype)
            grown[:len(self.a)] = self.a
            grown[len(self.a):] = self.fill
            self.a = grown
        if top - first == len(ids):
            self.a[first:top] = values
        else:
            self.a[ids] = values

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The values at ``ids`` (each set before, or −1: ``fill``)."""
        return self.a[ids]


#: op fields that must be equal at σ-mapped positions (chunk ids and head ranges may differ: their counts and widths
#: are in the shapes, bytes and FLOPs compared)
_EQUAL = ("step", "size_bytes", "dtype", "combine", "flops", "s_q", "s_kv", "mask")
#: a compute op's kernel shape: may differ along an orbit where the durations are equal (a zigzag block of c x 2c
#: and one of 2c x c), recorded for the workspaces
SHAPE_FIELDS = ("s_q", "s_kv")
#: op fields naming tensors (renumbered when the kept ones are assembled)
TENSOR_REFS = ("tensor", "inputs", "outputs")


class QuotientCheck:
    """The builder's side of a quotient build: checks each op call against every symmetry (module docstring), records
    the images of its ops, and says which entries to keep (the representatives'). Tensors are checked at the end as
    what memory sees: per rank, the multiset of (bytes, pass, kind, allocating op, freeing ops) — a rank may create
    its pieces in another order."""

    def __init__(self, n: int, gens: list[np.ndarray], rep_of: np.ndarray, node_rep: np.ndarray,
                 node_of_rank: np.ndarray, price: Callable[[Any], np.ndarray], workload, n_chunks: int) -> None:
        self.n, self.gens, self.rep_of, self.node_rep = n, [np.asarray(s, dtype=np.int64) for s in gens], rep_of, \
            node_rep
        self.keep_rank = rep_of == np.arange(n)
        self.price, self.workload, self.n_chunks = price, workload, n_chunks
        node = np.asarray(node_of_rank, dtype=np.int64)
        self.orbit_size = int(np.bincount(rep_of).max())
        # [rep, m] the orbit's rank on the m-th node of its node orbit (in node order)
        order = np.lexsort((node, rep_of))
        self.orbit = np.full((n, self.orbit_size), -1, dtype=np.int64)
        self.orbit[rep_of[order], np.arange(n) - np.searchsorted(rep_of[order], rep_of[order])] = order
        self.op_img = [_Grow(dtype=np.int32) for _ in gens]        # ids below 2³¹: 8 GB of ops
        self.batch_head = _Grow(dtype=np.int32)             # each op's P2P batch's first op (itself alone)
        self._last: dict[int, tuple[np.ndarray, ...]] = {}   # stream -> each rank's last op there: id, comm, step, pass
        self.tensor_rank, self.tensor_kind = _Grow(dtype=np.int32), _Grow(dtype=np.int32)
        self.tensor_size, self.tensor_code = _Grow(), _Grow(dtype=np.int32)
        self._codes: dict[tuple, int] = {}              # a tensor call's (kind, dtype, pass, width, chunks) -> code
        self.n_tensors = 0
        self._pos = np.full(n, -1, dtype=np.int64)

    def _positions(self, ranks: np.ndarray) -> np.ndarray:
        """``self._pos[r]`` = r's entry in the call (the caller resets it); NotSymmetric when a rank is there twice."""
        pos = self._pos
        pos[ranks] = np.arange(len(ranks))
        if (pos[ranks] != np.arange(len(ranks))).any():
            pos[ranks] = -1
            raise NotSymmetric("a call with a rank twice")
        return pos

    @staticmethod
    def _image_entries(ranks: np.ndarray, s: np.ndarray, pos: np.ndarray) -> np.ndarray:
        j = pos[s[ranks]]
        if (j < 0).any():
            raise NotSymmetric("a call not closed under a symmetry")
        return j

    def _batches(self, ranks: np.ndarray, ids: np.ndarray, comm: bool, stream: int, phase: int, step) -> None:
        """Record the call's ops' batch heads (:func:`meshplan.plan.dataflow.batch_joins`: consecutive sends and
        receives of one rank, stream and pass with one step ≥ 0 start and end together)."""
        last = self._last.get(stream)
        if last is None:
            last = self._last[stream] = (np.full(self.n, -1, dtype=np.int64), np.zeros(self.n, dtype=bool),
                                         np.full(self.n, -1, dtype=np.int64), np.full(self.n, -1, dtype=np.int64))
        prev, prev_comm, prev_step, prev_phase = last
        step = np.broadcast_to(np.asarray(step, dtype=np.int64), ranks.shape)
        joins = comm & (prev[ranks] >= 0) & prev_comm[ranks] & (step >= 0) & (prev_step[ranks] == step) & \
            (prev_phase[ranks] == phase)
        self.batch_head.set(ids, np.where(joins, self.batch_head.get(prev[ranks]), ids))
        prev[ranks], prev_comm[ranks], prev_step[ranks], prev_phase[ranks] = ids, comm, step, phase

    def ops(self, ranks: np.ndarray, ids: np.ndarray, deps: np.ndarray, fields: dict, *, kind: int, stream: int,
            phase: int) -> tuple[np.ndarray, dict]:
        """Check one op call (its op kind, stream and pass); returns (the entries to keep, fields to add to the kept
        ones: a compute call's orbit kernel shapes where they differ).

        Raises:
            NotSymmetric: the call is not invariant under a symmetry.
        """
        k = len(ranks)
        if k == 0:
            return np.zeros(0, dtype=np.int64), {}
        self._batches(ranks, ids, kind in (KIND["send"], KIND["recv"]), stream, phase, fields.get("step", -1))
        seconds = self.price(self._call_view(k, kind, phase, fields)) if kind == KIND["compute"] else None
        inputs = fields.get("inputs")
        in_bytes = None
        if isinstance(inputs, np.ndarray) and inputs.ndim == 2 and inputs.shape[0] == k:   # staging reads them
            in_bytes = np.where(inputs >= 0, self.tensor_size.get(inputs), 0).sum(axis=1)
        pos = self._positions(ranks)
        try:
            for s, op_img in zip(self.gens, self.op_img):
                j = self._image_entries(ranks, s, pos)
                op_img.set(ids, ids[j])
                if deps.size:
                    img = op_img.get(deps)
                    if ((deps >= 0) & (img < 0)).any():
                        raise NotSymmetric("deps")
                    img = np.where(deps >= 0, img, -1)
                    if not np.array_equal(deps[j], img) and not np.array_equal(self._head(deps[j]), self._head(img)):
                        raise NotSymmetric("deps")
                if in_bytes is not None and not np.array_equal(in_bytes[j], in_bytes):
                    raise NotSymmetric("input bytes")
                for name, v in fields.items():
                    if not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != k:
                        continue
                    if name == "peer":
                        ok = np.array_equal(v[j], s[v])
                    elif name in _EQUAL and not (seconds is not None and name in SHAPE_FIELDS):
                        ok = np.array_equal(v[j], v)
                    else:
                        continue
                    if not ok:
                        raise NotSymmetric(name)
                if seconds is not None and not np.array_equal(seconds[j], seconds):
                    raise NotSymmetric("durations")
            keep = np.flatnonzero(self.keep_rank[ranks])
            extra = {}
            if seconds is not None:       # kernel shapes may differ along an orbit (same time): the workspaces do
                shapes = [np.broadcast_to(np.asarray(fields[f]), (k,)) for f in SHAPE_FIELDS]
                members = pos[self.orbit[ranks[keep]]]                  # [kept, nodes] their orbits' entries
                if any(not (x[members] == x[keep][:, None]).all() for x in shapes):
                    extra = {"orbit_" + f: x[members] for f, x in zip(SHAPE_FIELDS, shapes)}
        finally:
            pos[ranks] = -1
        return keep, extra

    def _call_view(self, k: int, kind: int, phase: int, fields: dict):
        """A compute call's ops of every rank shaped as a Schedule (the columns pricing reads), for ``price``."""
        from types import SimpleNamespace

        def col(name, default=0):
            return np.broadcast_to(np.asarray(fields.get(name, default)), (k,))

        def csr(name):
            rows = np.asarray(fields[name], dtype=np.int64).reshape(k, -1)
            keep = rows >= 0
            return np.r_[0, np.cumsum(keep.sum(axis=1))], rows[keep]

        qc_ptr, q_chunks = csr("q_chunks")
        kvc_ptr, kv_chunks = csr("kv_chunks")
        in_ptr, inputs = csr("inputs")
        out_ptr, outputs = csr("outputs")
        ops = _Columns(kind=np.full(k, kind, dtype=np.int8), phase=np.full(k, phase, dtype=np.int8),
                              h0=col("h0"), h1=col("h1"), flops=col("flops", 0.0), s_q=col("s_q"), s_kv=col("s_kv"),
                              mask=col("mask"), combine=col("combine"), size_bytes=col("size_bytes"),
                              qc_ptr=qc_ptr, q_chunks=q_chunks, kvc_ptr=kvc_ptr, kv_chunks=kv_chunks,
                              in_ptr=in_ptr, inputs=inputs, out_ptr=out_ptr, outputs=outputs)
        tensors = SimpleNamespace(size_bytes=self.tensor_size.a, kind=self.tensor_kind.a)
        return SimpleNamespace(ops=ops, tensors=tensors, workload=self.workload, n_chunks=self.n_chunks, memo={})

    def _head(self, ops: np.ndarray) -> np.ndarray:
        return self.batch_head.get(ops)

    def tensors(self, ranks: np.ndarray, ids: np.ndarray, size, what: tuple, kind: int) -> np.ndarray:
        """Record one tensor call (``size``: bytes, one or per tensor; ``what``: its kind, dtype, pass, head width and
        chunk count; ``kind``: its kind's index); returns the entries to keep."""
        self.tensor_kind.set(ids, kind)
        self.tensor_rank.set(ids, ranks)
        self.tensor_size.set(ids, size)
        self.tensor_code.set(ids, self._codes.setdefault(what, len(self._codes)))
        self.n_tensors = int(ids[-1]) + 1
        return np.flatnonzero(self.keep_rank[ranks])

    def finish(self, allocs: list, frees: list) -> None:
        """After the last call: each rank's tensors, as (bytes, kind, allocating op, freeing ops), are the σ-image of
        its preimage's, as a multiset (ops by their P2P batch, which starts and ends together): compared as a sum over
        a rank's tensors of a 64-bit mix of each one's fields (its freeing ops as a sum too: order-free), equal by
        chance with probability ~2⁻⁶⁴.

        Raises:
            NotSymmetric: otherwise.
        """
        n_t = self.n_tensors
        rank, size, code = self.tensor_rank.a[:n_t], self.tensor_size.a[:n_t], self.tensor_code.a[:n_t]
        alloc = np.full(n_t, -1, dtype=np.int64)
        for t, o in allocs:
            alloc[np.asarray(t, dtype=np.int64)] = o
        ft = np.concatenate([np.asarray(t, dtype=np.int64) for t, _ in frees] or [np.zeros(0, dtype=np.int64)])
        fo = np.concatenate([np.asarray(o, dtype=np.int64) for _, o in frees] or [np.zeros(0, dtype=np.int64)])
        head = self.batch_head.get                    # a batch starts and ends together: ops by their batch
        shape = _mix(_mix(size) + code.astype(np.uint64) * _K1)

        def rank_hashes(alloc_ops: np.ndarray, free_ops: np.ndarray, owner: np.ndarray) -> np.ndarray:
            freed = np.zeros(n_t, dtype=np.uint64)              # wrapping uint64 sums: exact, order-free
            np.add.at(freed, ft, _mix(head(free_ops)))
            each = _mix(shape + head(alloc_ops).astype(np.int64).view(np.uint64) * _K1 + freed * _K2)
            out = np.zeros(self.n, dtype=np.uint64)
            np.add.at(out, owner, each)
            return out

        mine = rank_hashes(alloc, fo, rank)
        for s, op_img in zip(self.gens, self.op_img):
            a_img, f_img = op_img.get(alloc), op_img.get(fo)
            if ((alloc >= 0) & (a_img < 0)).any() or (f_img < 0).any():
                raise NotSymmetric("a tensor allocated or freed by an op without an image")
            if not np.array_equal(rank_hashes(np.where(alloc >= 0, a_img, -1), f_img, s[rank]), mine):
                raise NotSymmetric("tensors")

    def partners(self, ranks: np.ndarray, peers: np.ndarray, peer_ids: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """The partners of a transfer call's kept entries: the op of the other side's call on the representative of
        each one's peer (``peers``/``peer_ids``: that call's ranks and ids, entry by entry)."""
        pos = self._positions(peers)
        try:
            at = pos[self.rep_of[peers[kept]]]
        finally:
            pos[peers] = -1
        if (at < 0).any():
            raise NotSymmetric("a transfer whose partner's representative is not in its call")
        return peer_ids[at]


class _Columns:
    """Named columns of one length (``len`` as an OpTable's)."""

    def __init__(self, **columns: np.ndarray) -> None:
        self.__dict__.update(columns)

    def __len__(self) -> int:
        return len(self.kind)


_K1, _K2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93)      # odd 64-bit multipliers


def _mix(x: np.ndarray) -> np.ndarray:
    """A 64-bit multiply-xorshift mix of int64 ids or uint64 values (a sum of these is an order-free hash of a
    multiset)."""
    z = np.array(x, dtype=np.int64 if np.asarray(x).dtype != np.uint64 else np.uint64).view(np.uint64)
    z *= _K1
    z ^= z >> np.uint64(29)
    z *= _K2
    z ^= z >> np.uint64(32)
    return z
