"""StarTrail (Wang et al., arXiv 2407.00611, "concentric ring" sequence parallelism), as we read it.

Teams of C ranks (``--team-size C``): team T = ranks T·C … T·C + C − 1, M = N/C teams. (1) Q and KV are
all-gathered inside the team, so every member holds the team's C chunks; (2) member t of team T computes
the team's queries against the KV of teams T + t + C·s (s < M/C): it first fetches team T + t's KV from
member t of that team, then KV groups travel on *sub-rings* of M/C ranks (member t of the teams with the
same T mod C, each sending to team T − C); (3) the partial outputs of the team's C query chunks are
reduce-scattered inside the team (LSE-merged at each chunk's owner). Every member computes N blocks.
Backward mirrors it: Q side (Q, dO, LSE, D) and KV all-gathered, dK/dV ride the sub-ring home, partial dQ
reduce-scattered in the team, each KV group's dK/dV sum (one per member ring) added at the chunk owners.
The paper leaves the initial placement open; the initial fetch is our reading. Needs C² | N.

Bytes received per rank, forward (KVc, Qc, Oc + Lc per docs/algorithms.md): team all-gather (C − 1)·(Qc + KVc);
initial fetch C·KVc (members t > 0); sub-ring (M/C − 1)·C·KVc; reduce-scatter (C − 1)·(Oc + Lc).
The P2P part is about N/C · KVc instead of Ring's (N − 1)·KVc.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import (
    DTYPE_KNOB,
    BuiltTiming,
    Knob,
    PassTiming,
    last_compute_op,
    new_builder,
    positive_int_or_auto,
    topology_record,
)
from meshplan.algorithms.rotate import RingSpec, rotate_backward, rotate_forward_merge
from meshplan.algorithms.startrail_timing import startrail_timing
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule


class StarTrail(BuiltTiming):
    """Team all-gathers × sub-rings of N/C² ranks × team reduce-scatter."""

    name = "startrail"
    summary = "StarTrail: teams of C gather Q/KV, sub-rings of N/C² move KV, partial outputs reduced in the team"
    knobs = {
        "team_size": Knob("team_size", 2, None, "team size C (C² must divide N)", parse=positive_int_or_auto),
        "partial_dtype": DTYPE_KNOB("partial_dtype", None, "dtype of partial outputs on the wire"),
        "dq_dtype": DTYPE_KNOB("dq_dtype", "fp32", "dtype of partial dQ on the wire"),
        "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dK/dV on the wire"),
    }

    schedule_free = True

    def schedule_free_timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """The plan's lower bound without its schedule (:mod:`meshplan.algorithms.startrail_timing`)."""
        return startrail_timing(plan, topo)

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """C must divide N, and C² too (equal sub-rings)."""
        super().check(workload, topo, n_ranks, knobs)
        C = int(knobs["team_size"])
        if C < 1 or n_ranks % C:
            raise UserError("--team-size", f"a team size of {C} does not divide {n_ranks} ranks",
                            f"use a C with C² dividing {n_ranks}")
        if n_ranks % (C * C):
            raise SkipCandidate("team size squared does not divide N", f"StarTrail's sub-rings need C² | N; "
                                f"C = {C} on {n_ranks} ranks does not")

    def knob_space(self, workload, topo, n_ranks, filters) -> list[dict]:
        """Every C ≥ 2 with C² | N and C within a node (unless pinned)."""
        if "team_size" in filters:
            return [dict(filters)]
        sizes = [c for c in range(2, min(n_ranks, topo.gpus_per_node) + 1) if n_ranks % (c * c) == 0] or [2]
        return [dict(filters) | {"team_size": c} for c in sizes]

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Member t of team T computes team T's query chunks against its teams' KV."""
        C = int(knobs["team_size"])
        m = matrix if matrix is not None else attn_matrix(workload, n_ranks)
        M = n_ranks // C
        team = np.arange(n_ranks) // C
        t = (team[None, :] - team[:, None]) % C                          # which member handles the KV team
        owner = team[:, None] * C + t
        owner[~m.permitted] = -1
        idx = np.arange(n_ranks)
        return Plan(self.name, knobs | {"team_size": C}, m, n_ranks, owner, idx, idx,
                    self.device_map(topo, n_ranks, knobs), extra={"C": C, "M": M})

    # ------------------------------------------------------------------ lowering
    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """Team all-gather, initial fetch, sub-rings, team reduce-scatter; per pass."""
        b = new_builder(self, plan, topo)
        b.stream("compute", "compute")
        for s in ("team", "fetch", "kv", "reduce"):
            b.stream(s, "comm")
        if "fwd" in plan.workload.pass_list:
            b.phase = 0
            self._pass(b, plan, fwd=True)
        if "bwd" in plan.workload.pass_list:
            b.stream("dkv", "comm")
            b.stream("dkv-home", "comm")
            b.phase = 1
            self._pass(b, plan, fwd=False)
        return b.build(topology_record(topo))

    def _geometry(self, plan: Plan):
        C, M, n = plan.extra["C"], plan.extra["M"], plan.n_ranks
        r = np.arange(n)
        T, t = r // C, r % C
        L = M // C                                                       # sub-ring length
        x = T // C                                                       # position of team T in its sub-ring
        pos = (-x) % L
        nxt = ((T - C) % M) * C + t
        ring_of = (T % C) * C + t
        groups = np.empty((C * C, L, C), dtype=np.int64)                 # [ring, position, chunks]
        for rho in range(C):
            for tt in range(C):
                for j in range(L):
                    team = ((((-j) % L) * C) + rho + tt) % M
                    groups[rho * C + tt, j] = team * C + np.arange(C)
        ring = RingSpec(nxt, pos, L, groups, None, ring_of=ring_of)
        team_chunks = T[:, None] * C + np.arange(C)[None, :]
        block = lambda rr, j: (team_chunks[rr], groups[ring_of[rr], j])  # noqa: E731
        return C, M, r, T, t, ring, team_chunks, block

    def _gather(self, b: ScheduleBuilder, C, r, T, t, kinds: dict[str, np.ndarray]):
        """Team all-gather of each kind: [n, C] tensors (column t' = chunk T·C + t'), and the recv ops."""
        held = {k: np.full((len(r), C), -1) for k in kinds}
        last = np.full(len(r), -1)
        for k, own in kinds.items():
            held[k][r, t] = own
        for d in range(1, C):
            dst = T * C + (t + d) % C
            for k, own in kinds.items():
                land = b.tensor(dst, k, r)
                _, rcv = b.transfer(r, dst, own, land, stream="team", step=0)
                held[k][dst, t] = land
                last[dst] = rcv
        return held, last

    def _fetch(self, b: ScheduleBuilder, C, M, r, T, t, kv_team: np.ndarray, deps):
        """Member t of team T fetches team T + t's KV group from member t of that team (t = 0: its own)."""
        src_of = ((T + t) % M) * C + t                                   # who holds what I need
        got = np.full(len(r), -1)
        travel = kv_team.copy()
        need = t > 0
        if need.any():
            dst = np.empty(len(r), dtype=np.int64)
            dst[src_of] = r                                              # src_of is a permutation
            sel = need[dst]                                              # senders whose receiver needs it
            cols = []
            for c in range(C):
                land = b.tensor(dst[sel], "kv", ((T[dst[sel]] + t[dst[sel]]) % M) * C + c)
                _, rcv = b.transfer(r[sel], dst[sel], kv_team[sel, c], land, stream="fetch", step=0,
                                    send_deps=[deps[sel]])
                travel[dst[sel], c] = land
                cols.append((dst[sel], rcv))
            for d_, rcv in cols:
                got[d_] = rcv
        return travel, np.where(need, got, deps)

    def _pass(self, b: ScheduleBuilder, plan: Plan, fwd: bool) -> None:
        C, M, r, T, t, ring, team_chunks, block = self._geometry(plan)
        w, k = plan.workload, plan.knobs
        qkind = "q" if fwd else "qside"
        own_q, own_kv = b.tensor(r, qkind, r, role="input"), b.tensor(r, "kv", r, role="input")
        held, gathered = self._gather(b, C, r, T, t, {qkind: own_q, "kv": own_kv})
        travel, first = self._fetch(b, C, M, r, T, t, held["kv"], gathered)
        acc_kind = "out" if fwd else "dq"
        acc = np.full((len(r), C), -1)
        for c in range(C):
            mine = t == c
            acc[mine, c] = b.tensor(r[mine], acc_kind, team_chunks[mine, c], dtype="fp32", role="output")
            acc[~mine, c] = b.tensor(r[~mine], acc_kind, team_chunks[~mine, c], dtype="fp32")
        q_cols = [held[qkind][:, c] for c in range(C)]
        if fwd:
            io = lambda ok, s, j, cur: ([q[ok] for q in q_cols] + [x[ok] for x in cur],  # noqa: E731
                                        [acc[ok, c] for c in range(C)], "merge", None)
            steps = rotate_forward_merge(b, plan, travel, "kv", block, io, ring=ring, first_deps=[first, gathered])
            last = last_compute_op(steps, len(r))
        else:
            home, ready, last = rotate_backward(
                b, plan, travel=travel, travel_kind="kv", grad_kind="dkv", grad_dtype=k["dkv_dtype"], hops="n",
                block=block, static_inputs=q_cols, local_grad=[acc[:, c] for c in range(C)], travel_first=False,
                ring=ring, grad_role="buffer", first_deps=[first, gathered])
            self._dkv_home(b, C, M, r, T, t, home, ready, last, k["dkv_dtype"])
        self._reduce(b, C, r, T, t, acc, last, fwd, k, w)

    def _reduce(self, b, C, r, T, t, acc, last, fwd, k, w) -> None:
        """Reduce-scatter of the team's partials: column t' goes to member t', merged/accumulated there."""
        dtype = (k["partial_dtype"] or w.dtype) if fwd else k["dq_dtype"]
        kind = "out" if fwd else "dq"
        landed = []
        for d in range(1, C):
            dst_t = (t + d) % C
            dst = T * C + dst_t
            land = b.tensor(dst, kind, dst, dtype=dtype)
            snd, rcv = b.transfer(r, dst, acc[r, dst_t], land, stream="reduce", step=0, dtype=dtype,
                                  send_deps=[last])
            b.free_after(acc[r, dst_t], snd)
            landed.append((dst, land, rcv))
        for dst, land, rcv in landed:
            fold = b.combine_op(dst, "merge" if fwd else "accumulate", src=land, dst=acc[dst, t[dst]], deps=[rcv])
            b.free_after(land, fold)

    def _dkv_home(self, b, C, M, r, T, t, home, ready, last, dtype) -> None:
        """Each member's dK/dV sum for its initial group (team T + t) goes to that team's chunk owners."""
        dkv = b.tensor(r, "dkv", r, dtype="fp32", role="output")
        team = (T + t) % M
        landed = []
        for c in range(C):
            dst = team * C + c
            away = dst != r                                              # the rank's own chunk: added in place
            land = b.tensor(dst[away], "dkv", dst[away], dtype=dtype)
            snd, rcv = b.transfer(r[away], dst[away], home[away, c], land, stream="dkv-home", step=0, dtype=dtype,
                                  send_deps=[ready[away, c], last[away]])
            b.free_after(home[away, c], snd)
            landed.append((dst[away], land, rcv))
            if (~away).any():
                here = r[~away]
                fold = b.combine_op(here, "accumulate", src=home[here, c], dst=dkv[here], deps=[ready[here, c],
                                                                                                  last[here]])
                b.free_after(home[here, c], fold)
        for dst, land, rcv in landed:
            fold = b.combine_op(dst, "accumulate", src=land, dst=dkv[dst], deps=[rcv])
            b.free_after(land, fold)

