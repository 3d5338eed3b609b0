"""Schedule-free closed form of USP, Ulysses and LoongTrain: a lower bound from the plan alone, for large N.

USP's closed form below ``search_max_ranks`` is its built schedule's (:class:`~meshplan.algorithms.base.BuiltTiming`);
building it costs ~20 s and ~3 GB at 1024 ranks, so above that the search takes this bound instead. Every term is
one a schedule of :mod:`meshplan.algorithms.ulysses` must pay, so it never exceeds the simulated makespan:

* a dependency chain on each rank: the scatter all-to-all (its batch cannot end before its slowest piece arrives
  alone, ``alpha + bytes / bw`` on its route) then the rank's kernels back to back (each block's FLOPs at the
  kernel table's monotone envelope for an op over u × u chunks, one launch per op, each op's combine into the fp32
  accumulators, backward the additions of the dK/dV partials the ring brings), or its
  R − 1 ring hops in sequence (each at least its slowest piece's time alone: a hop moves the group's u chunks as u
  transfers in one batch), whichever ends later; then the gather
  all-to-all's slowest piece (backward: the dQ gather, then the dK/dV gather, on one stream);
* the all-to-alls' links in that chain (:func:`_link_floor`): a batch ends with its last byte, so the rank that
  sent or received the scatter's last byte over a link L (no sooner than the scatter's bytes over L / L's capacity)
  runs its kernels and gathers after it; and a rank posts its gathers (output; dQ, then dK/dV) after its kernels,
  so L's gather bytes / its capacity come after the earliest rank's kernels end — across many nodes a node's
  network link carries the whole group's pieces, which is what decides the exposed all-to-all (at 256 H100s a
  ``ulysses_degree`` 32 forward: 81 → 100 ms, simulated 107);
* the busiest link: every transfer's bytes summed on the links of its route (``Topology.link_loads``), divided
  by the link's capacity — a node's network aggregate included, which is what decides USP across many nodes;
* a compute pool's (CPU ranks on few cores): Σ kernel time / the pool's cores.

Bytes per rank are exact (the module docstring of :mod:`meshplan.algorithms.ulysses` gives the formulas);
``tests/algorithms/test_free_timing.py`` checks them and the bound against the built schedule and the simulator.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import PassTiming
from meshplan.algorithms.free_timing import Transfers, op_overhead_s, pass_timing
from meshplan.algorithms.headsplit import Grid
from meshplan.cost.block_classes import class_sums, pair_seconds
from meshplan.cost.cost import CostModel
from meshplan.cost.doc_kernels import priced_by_cover
from meshplan.model.matrix import KV_KINDS
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan, shared_owner
from meshplan.plan.schedule import tensor_bytes


def usp_timing(plan: Plan, topo: Topology) -> dict[str, PassTiming]:
    """PassTiming per pass of a USP (or Ulysses, R = 1) plan, without building its schedule; every makespan a lower
    bound of the simulated one (``estimate_s`` None: no estimate, the bound orders the search)."""
    return headsplit_timing(plan, topo, _ring_hops)


def headsplit_timing(plan: Plan, topo: Topology, ring_hops) -> dict[str, PassTiming]:
    """PassTiming per pass of a plan on the Ulysses grid whose KV groups travel as ``ring_hops(plan, topo, grid,
    pass_, sizes)`` says: (the families of transfers [(pairs, bytes each, count)], [n] the hops' chain on each rank,
    the backward's tail: the least time from a rank's last kernel until its dK/dV partial is home, the KV groups a
    rank holds at once besides its own, [n] the least time its compute stream waits for transfers beside its
    kernels)).
    ``sizes``: {"kv": one chunk's KV for a head range, "dkv": its partial dK/dV on the wire}."""
    grid: Grid = plan.extra["grid"]
    w, m, n, u, R = plan.workload, plan.matrix, plan.n_ranks, grid.u, grid.R
    hq = w.n_heads // u
    r = np.arange(n)
    members = [(r, grid.rank_of[grid.g_of, (grid.p_of + d) % u]) for d in range(1, u)]
    a2a = Transfers(plan, topo, np.concatenate([s for s, _ in members]) if members else r[:0],
                    np.concatenate([t for _, t in members]) if members else r[:0])
    c_q, c_kv = m.chunk_tokens("q"), m.chunk_tokens("kv")
    piece = lambda kind, dtype=w.dtype: float(tensor_bytes(w, kind, c_kv if kind in KV_KINDS else c_q, hq, dtype))  # noqa: E731
    sizes = {"kv": piece("kv"), "dkv": piece("dkv", plan.knobs.get("dkv_dtype", "fp32"))}
    out = {}
    for pass_ in w.pass_list:
        compute, kernels = _rank_compute(plan, topo, grid, pass_)
        if pass_ == "fwd":
            scatter, slowest, gathers = piece("q") + piece("kv"), max(piece("q"), piece("kv")), [piece("out")]
        else:
            scatter, slowest, gathers = piece("dout"), piece("dout"), [piece("dq"), piece("dkv")]
        hops, kv_chain, tail, held, wait = ring_hops(plan, topo, grid, pass_, sizes) if R > 1 \
            else ([], np.zeros(n), 0.0, 0, 0.0)
        # the chain: the scatter's slowest piece then the kernels, or the KV hops in sequence (counted from the
        # pass's start), whichever ends later; then each gather's slowest piece (backward: the dK/dV gather after
        # the dQ gather and after the last partial came home)
        first = a2a.slowest_in(slowest) if u > 1 else np.zeros(n)
        ends = [a2a.slowest_in(b) for b in gathers] if u > 1 else [np.zeros(n)] * len(gathers)
        last = ends[0] if pass_ == "fwd" else np.maximum(ends[0], tail) + ends[1]
        done = np.maximum(first + compute + wait, kv_chain)            # the rank's last kernel ends
        chain = done + last
        if u > 1:                      # the all-to-alls' links: the scatter whole before a kernel, the gathers after
            chain = np.maximum(chain, _link_floor(a2a, scatter, sum(gathers), first, last, kernels))
        moved = [(a2a, scatter, 1), *[(a2a, b, 1) for b in gathers]] if u > 1 else []
        group_kv = u * sizes["kv"]
        out[pass_] = pass_timing(plan, topo, pass_, compute, chain, moved + hops,
                                 _buffers(plan, grid, pass_, piece, group_kv, held),
                                 2 * group_kv if R > 1 else scatter * (u - 1))
    return out


def _ring_hops(plan: Plan, topo: Topology, grid: Grid, pass_: str, sizes: dict):
    """USP's ring over the R groups: R − 1 KV hops from the previous group's rank (each the group's u chunks, as u
    transfers in one batch: the chain counts one chunk's time per hop); backward, the dK/dV partials ride along
    (R hops, or R − 1 with ``dkv_hops`` n-1)."""
    R, u = grid.R, grid.u
    ring = Transfers(plan, topo, grid.rank_of[(grid.g_of - 1) % R, grid.p_of], np.arange(grid.n))
    hops = [(ring, u * sizes["kv"], R - 1)]
    if pass_ == "bwd":
        hops.append((ring, u * sizes["dkv"], R if plan.knobs.get("dkv_hops", "n") == "n" else R - 1))
    # hops n: the last kernel's partial makes one more hop, home
    tail = float(ring.slowest_in(sizes["dkv"]).min()) if plan.knobs.get("dkv_hops", "n") == "n" else 0.0
    return hops, ring.slowest_in(sizes["kv"]) * (R - 1), tail, 2, 0.0     # double-buffered: the next group lands


def double_ring_hops(plan: Plan, topo: Topology, grid: Grid, pass_: str, sizes: dict):
    """LoongTrain's double ring (:mod:`meshplan.algorithms.loongtrain`): windows of W groups; in each of the n_win
    outer steps an inner ring of W − 1 KV hops inside the window, and one hop from the previous window's rank at the
    same position (on its own stream, beside the inner ring). Backward: W dK/dV hops a step on the inner ring
    (none when W = 1) and each outer step's dK/dV sum sent home from the other windows. The chain: the inner hops
    in sequence, or the outer ones, whichever is longer. Memory: the outer ring's transfers wait for no kernel, so a
    rank can hold every outer group that has arrived (up to n_win − 1) beside the inner ring's two."""
    W = plan.extra["inner_ring"]
    n_win, u, r = grid.R // W, grid.u, np.arange(grid.n)
    a, pos = grid.g_of // W, grid.g_of % W
    inner = Transfers(plan, topo, grid.rank_of[a * W + (pos - 1) % W, grid.p_of], r) if W > 1 else None
    outer = Transfers(plan, topo, grid.rank_of[((a - 1) % n_win) * W + pos, grid.p_of], r) if n_win > 1 else None
    hops, chain, tail = [], np.zeros(grid.n), 0.0
    if inner is not None:
        hops.append((inner, u * sizes["kv"], n_win * (W - 1)))
        chain = inner.slowest_in(sizes["kv"]) * (n_win * (W - 1))
        if pass_ == "bwd":
            hops.append((inner, u * sizes["dkv"], n_win * W))
            tail = float(inner.slowest_in(sizes["dkv"]).min())    # the last partial's hop home in its window
    wait = 0.0
    if outer is not None:
        hops.append((outer, u * sizes["kv"], n_win - 1))
        chain = np.maximum(chain, outer.slowest_in(sizes["kv"]) * (n_win - 1))
        if pass_ == "bwd":                       # the sums come home from every other window once
            src = np.concatenate([grid.rank_of[((a + o) % n_win) * W + pos, grid.p_of] for o in range(1, n_win)])
            home = Transfers(plan, topo, src, np.tile(r, n_win - 1))
            hops.append((home, u * sizes["dkv"], 1))
            wait = _sums_home_wait(plan, topo, grid, home, sizes["dkv"], tail, W, n_win)
            tail = 0.0                           # the last sum's arrival is in the wait
    return hops, chain, tail, 2 + n_win - 1, wait


def _sums_home_wait(plan: Plan, topo: Topology, grid: Grid, home: Transfers, dkv: float, inner_hop: float, W: int,
                    n_win: int) -> np.ndarray:
    """[n] the least time LoongTrain's backward compute stream waits on each rank for the dK/dV sums coming home.

    After outer step o ≥ 1, each rank's program adds the sum of the group it held at step o, sent by the rank x of
    window a + o at its position; x sends it once its own step o is done (its kernels, then the partial's last inner
    hop), so the rank's next kernels start no sooner than that arrival. A recurrence over the outer steps on lower
    bounds of every rank's progress (its step's kernels: its query group against the step's window of KV groups,
    with their launches and combines): e(o) = w(o − 1) + C(o), w(o) = max(e(o), e_x(o) + hop + sum's time alone)."""
    per_op, per_block = _group_ops(plan, topo, grid, "bwd")
    R = grid.R
    g = np.arange(R)
    step = (g[:, None] // W - g[None, :] // W) % n_win          # [R, R] the outer step group g meets KV group j
    steps = np.zeros((R, n_win))
    np.add.at(steps, (np.broadcast_to(g[:, None], (R, R)), step), per_block)
    steps = steps[grid.g_of]                                       # [n, n_win]
    n = grid.n
    alone = home.alone(dkv)
    end = steps[:, 0]
    for o in range(1, n_win):
        sl = slice((o - 1) * n, o * n)                             # home's transfers of step o, in rank order
        end = end + steps[:, o]
        end = np.maximum(end, end[home.src[sl]] + inner_hop + alone[sl])
    return end - steps.sum(axis=1)


def _link_floor(a2a: Transfers, scatter: float, gathered: float, first: np.ndarray, last: np.ndarray,
                kernels: np.ndarray) -> float:
    """A floor of the pass's makespan from the all-to-alls' links. A batch ends with its last byte: the rank that
    sent or received the scatter's last byte over a link (no sooner than the scatter's bytes there / its capacity)
    runs its kernels and its gathers after it. And a rank posts its gathers (the forward's output; the backward's
    dQ, then its dK/dV on the same stream) after its last kernel, which starts after its scatter's slowest piece:
    the gathers' bytes over a link (``gathered`` a transfer) come after the earliest such end. Only each rank's own
    ``kernels`` are counted here (not the backward's dK/dV partial additions the chain charges every rank R − 1
    times — fewer run where a mask leaves a KV group nothing to do — nor a wait for another rank's progress, which a
    rank starting late may not see)."""
    return max(a2a.link_seconds(scatter) + float((kernels + last).min()),
               float((first + kernels).min()) + a2a.link_seconds(gathered))


def _rank_compute(plan: Plan, topo: Topology, grid: Grid, pass_: str) -> tuple[np.ndarray, np.ndarray]:
    """([n] each rank's compute stream, [n] its kernels alone): its kernels back to back — its group's query chunks
    against every KV group, its head range, each block at the envelope efficiency of an op over u × u chunks (N × N
    for Ulysses), one launch per op, and the combines into its accumulators (the CPU executor's input staging left
    out: a bound, 10% under it there) — and, backward with a ring, the R − 1 dK/dV partials added too."""
    m, u, R = plan.matrix, grid.u, grid.R
    cost = CostModel(topo)
    per_op, per_block = _group_ops(plan, topo, grid, pass_)
    kernels = per_block.sum(axis=1)[grid.g_of]
    if pass_ != "bwd" or R == 1:
        return kernels, kernels
    w, hq = plan.workload, plan.workload.n_heads // u     # each of the R − 1 dK/dV partials, added chunk by chunk
    part = tensor_bytes(w, "dkv", m.chunk_tokens("kv"), hq, "fp32")
    wire = tensor_bytes(w, "dkv", m.chunk_tokens("kv"), hq, plan.knobs.get("dkv_dtype", "fp32"))
    return kernels + (R - 1) * u * float(cost.merge_time_s(2 * part + wire)), kernels


def _group_ops(plan: Plan, topo: Topology, grid: Grid, pass_: str) -> tuple[float, np.ndarray]:
    """(the launch and combine of one op, [R, R] the op of query group g against KV group j on a rank of group g:
    its blocks' kernel terms for the rank's heads plus that, 0 where no pair is permitted). Every op folds its result
    into the rank's fp32 accumulators, 3 x their bytes at the merge rate: the forward's u output pieces (LSE merge),
    the backward's u dQ pieces."""
    m, u = plan.matrix, grid.u
    cost = CostModel(topo)
    by_group, has = _group_pair_kernels(cost, m, grid, pass_)
    by_group = by_group / u                                       # h/u of the FLOPs
    w, hq = plan.workload, plan.workload.n_heads // u
    per_op = op_overhead_s(topo, plan, pass_, u * tensor_bytes(w, "out" if pass_ == "fwd" else "dq",
                                                                m.chunk_tokens("q"), hq, "fp32"))
    return per_op, np.where(has, by_group + per_op, 0.0)


def _group_pair_kernels(cost: CostModel, m, grid: Grid, pass_: str) -> tuple[np.ndarray, np.ndarray]:
    """([R, R] Σ of the kernel terms, launches left out, of query group g's blocks against KV group j, at the
    monotone envelope of an op over u x u chunks (all heads); [R, R] whether any block there is permitted): from the
    pairs per block class counted once per grid (:func:`~meshplan.cost.block_classes.class_sums` over the group
    pairs as "ranks": no N x N array per kernel growth and pass), or where those are not kept (more than
    ``MAX_CELLS`` cells; blocks priced one by one) from the N x N block times (:func:`_group_pair_kernels_dense`)."""
    u, R = grid.u, grid.R
    if not (u == 1 and priced_by_cover(m.workload, cost.kernel.spec)):
        pair_owner = shared_owner(m, ("headsplit-group-pairs", u, grid.order),
                                  lambda: grid.g_of[:, None] * R + grid.g_of[None, :])
        sums = class_sums(m, pair_owner, R * R)
        if sums is not None:
            rate = pair_seconds(cost, m, pass_, (u, u), envelope=True)
            return (sums.pairs @ rate).reshape(R, R), (sums.blocks > 0).reshape(R, R)
    return _group_pair_kernels_dense(cost, m, grid, pass_)


def _group_pair_kernels_dense(cost: CostModel, m, grid: Grid, pass_: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_group_pair_kernels` from the N x N block times (3 of 134 MB at 4096 ranks)."""
    u, R = grid.u, grid.R
    blocks = np.where(m.permitted, cost.matrix_block_times(m, pass_, (u, u), envelope=True) - cost.kernel.launch_s,
                      0.0)
    order = grid.groups.ravel()                                   # chunks group by group
    by_group = blocks[np.ix_(order, order)].reshape(R, u, R, u).sum(axis=(1, 3))
    return by_group, m.permitted[np.ix_(order, order)].reshape(R, u, R, u).any(axis=(1, 3))


def _buffers(plan: Plan, grid: Grid, pass_: str, piece, group_kv: float, groups_held: int) -> float:
    """Buffer bytes a rank holds at its peak (an estimate; search checks simulated candidates on their simulated
    total): its own chunk's inputs, the group's pieces for its heads, the KV group in hand and in flight, the fp32
    accumulators. Within 25% of the built schedule's peak under balanced layouts (zigzag, or a full mask: what
    search enumerates above 64 ranks); under a causal mask with contiguous chunks a rank with little work holds the
    groups passing through longer (LoongTrain: up to 2x this)."""
    u, w = grid.u, plan.workload
    own = u * (piece("q") + piece("kv"))                            # its chunk, every head (the scatter's pieces)
    held = u * (piece("q") + piece("kv"))                            # the group's chunks for its heads
    flight = groups_held * group_kv
    acc = u * piece("out", "fp32")
    if pass_ == "bwd":
        acc += u * (piece("out") + piece("dout") + piece("dq", "fp32")) \
            + float(tensor_bytes(w, "dkv", u * plan.matrix.chunk_tokens("kv"), w.n_heads // u, "fp32"))
    return own + held + flight + acc
