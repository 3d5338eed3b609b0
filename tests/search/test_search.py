"""Search: every candidate accounted for, pruning loses nothing it promises to keep."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.core.errors import SkipCandidate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search import enumerate_candidates, run_search
from meshplan.search.candidate import simulate_candidate


@pytest.mark.heavy
@pytest.mark.parametrize("topo_name,n", [("h100x16", 16), ("l20x8", 8), ("dgx-h100", 8)])
@pytest.mark.parametrize("slack", [0.0, 0.01])
def test_pruned_search_matches_exhaustive(topo_name, n, slack):
    topo = Topology.load(topo_name, gpus=n)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64)
    result = run_search(w, topo, n, prune_slack=slack)
    every, _ = enumerate_candidates(w, topo, n, None, {}, False)
    every = [c for c in every if not c.forward_only]          # ranked apart (TASP: its forward only)
    exhaustive = min(simulate_candidate(c, topo, None).predicted.makespan_s for c in every)
    best = result.candidates[0].predicted.makespan_s
    assert exhaustive <= best <= exhaustive / (1 - slack) * (1 + 1e-9)
    counts = result.counts
    fwd_only = sum(c.forward_only for c in result.candidates)
    assert counts["enumerated"] == len(every) + fwd_only == counts["pruned"] + counts["simulated"]
    for c in result.candidates:
        if c.model_level == "closed-form":
            assert c.bound_s > best * (1 - slack)


def test_layouts_the_sequence_cannot_use_are_skipped_and_counted():
    topo = Topology.load("h100x8", gpus=8)
    w = resolve(seq_len=8 * 101)                     # a multiple of 8 but not of 16: zigzag cannot split it
    result = run_search(w, topo, 8)
    from meshplan.algorithms import NAMES  # what search enumerates by default
    assert result.counts["skipped"]["sequence cannot be split by the zigzag layout"] == len(NAMES)
    assert {c.workload.layout for c in result.candidates} == {"contiguous", "striped"}


@pytest.mark.heavy
def test_memory_limit_rejects_with_reason():
    topo = Topology.load("h100x32", gpus=64)
    w = resolve(seq_len="1M")
    result = run_search(w, topo, 64, memory_limit=3e9)
    assert result.counts["skipped"].get("over --memory-limit", 0) > 0
    assert sum("pass-q" in r for r in result.rejected) == 6    # pass-Q holds N−1 partial outputs: every setting
    assert all(r.split(": peak memory ")[1].split(" GB")[0] for r in result.rejected)
    assert result.candidates and not any(c.algorithm == "pass-q" for c in result.candidates)
    assert all((c.predicted.total or c.predicted.passes["fwd"]).peak_memory_total_bytes <= 3e9
               for c in result.candidates if c.model_level == "simulated")


def test_knob_filters_pin_and_exclude():
    topo = Topology.load("h100x8", gpus=8)
    w = resolve(seq_len="16K")
    result = run_search(w, topo, 8, filters={"dkv_dtype": "bf16"})
    assert {c.algorithm for c in result.candidates} == {"ring", "usp", "loongtrain", "startrail", "merge", "rmplus",
                                                            "mesh"}
    assert all(c.knobs["dkv_dtype"] == "bf16" for c in result.candidates)
    assert result.counts["skipped"]["dkv_dtype does not apply"] == 3    # pass-Q, Ulysses, TASP: no dK/dV wire


def test_forward_only_methods_are_listed_last_with_bwd_null_under_fwd_and_bwd():
    """docs/formats.md: TASP ranks normally under --pass fwd; under fwd+bwd it follows the others, bwd null."""
    topo = Topology.load("h100x8", gpus=8)
    both = run_search(resolve(seq_len=8 * 7 * 2 * 16, passes="fwd+bwd"), topo, 8, layout_pinned=True)
    tasp = [i for i, c in enumerate(both.candidates) if c.algorithm == "tasp"]
    assert tasp and tasp == list(range(len(both.candidates) - len(tasp), len(both.candidates)))
    assert all(both.candidates[i].predicted.json()["bwd"] is None
               and both.candidates[i].predicted.passes["fwd"].makespan_s > 0 for i in tasp)
    fwd = run_search(resolve(seq_len=8 * 7 * 2 * 16, passes="fwd"), topo, 8, layout_pinned=True)
    assert any(c.algorithm == "tasp" and c.predicted.makespan_s > 0 for c in fwd.candidates)


def test_a_forward_only_method_is_never_a_training_search_pick():
    """A fwd+bwd search that only TASP could run — named alone, or the only method under the memory limit — is
    refused (one line naming the flag, --pass fwd as the fix), not answered with a schedule that has no backward."""
    from meshplan.core.errors import UserError
    from meshplan.cost.memory import estimated_peak_bytes

    topo = Topology.load("h100x8", gpus=8)
    w = resolve(seq_len=8 * 7 * 2 * 16, passes="fwd+bwd")
    with pytest.raises(UserError) as named:
        run_search(w, topo, 8, algos=["tasp"], layout_pinned=True)
    assert named.value.field == "--algos" and "no backward pass" in named.value.problem
    assert "--pass fwd" in named.value.fix
    every = run_search(w, topo, 8, layout_pinned=True).candidates
    tasp_peak = max(estimated_peak_bytes(c.timing) for c in every if c.algorithm == "tasp")
    least = min(estimated_peak_bytes(c.timing) for c in every if not c.forward_only)
    assert tasp_peak < least                  # a limit between them leaves TASP alone
    with pytest.raises(UserError) as alone:
        run_search(w, topo, 8, layout_pinned=True, memory_limit=(tasp_peak + least) / 2)
    assert alone.value.field == "--memory-limit" and "tasp" not in alone.value.fix


def test_closed_form_exposed_communication_has_no_round_off_residue():
    """A bound equal to the compute time up to float round-off reports 0 exposed communication, not 1e-12 s."""
    from meshplan.search.candidate import _noise_free

    assert _noise_free(0.1 + 0.2 - 0.3, 0.3) == 0.0 and _noise_free(-1e-3, 1.0) == 0.0
    assert _noise_free(2e-6, 1.0) == 2e-6


def test_above_the_limit_asymmetric_candidates_stay_at_their_bound(monkeypatch):
    """With the full-simulation limit lowered to 8 ranks, a 16-rank search simulates the node-symmetric zigzag
    candidates and leaves causal contiguous ones (every rank's work differs) at their bound, counted."""
    import meshplan.search as search
    from meshplan.search.candidate import make_candidate, reduces
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64, passes="fwd")
    assert reduces(make_candidate("ring", w, topo, 16, {}), topo)
    assert not reduces(make_candidate("ring", w.with_(layout="contiguous"), topo, 16, {}), topo)
    monkeypatch.setattr(search, "FULL_SIM_MAX_RANKS", 8)
    result = search.run_search(w, topo, 16, algos=["ring", "mesh"], prune_slack=0.0)
    reason = "no node symmetry above 8 ranks (simulate it alone)"
    assert result.counts["not_simulated"].get(reason, 0) >= 1
    contiguous = [c for c in result.candidates if c.workload.layout == "contiguous"]
    assert contiguous and all(c.model_level == "closed-form" for c in contiguous)
    assert any(c.model_level == "simulated" and c.workload.layout == "zigzag" for c in result.candidates)
    assert result.counts["enumerated"] == result.counts["pruned"] + result.counts["simulated"]


def test_search_shows_documents_and_tile_waste():
    """On a packed-document mask a simulated candidate carries its document cost: the documents, the most segments
    a rank runs, and the tile waste, which per-document zigzag Ring on short documents makes large (each 48-token
    document in 8 pieces of 6 tokens, each a 128 x 64 tile) and Ulysses smaller (whole documents, one tile each)."""
    import json

    from helpers import run

    lens = [48] * 64
    flags = ["--gpus", 4, "--topo", "h100x8", "--seq-len", sum(lens), "--heads", 8, "--kv-heads", 8, "--layout",
             "zigzag", "--mask", "docs:" + ",".join(map(str, lens)), "--pass", "fwd"]
    docs = {}
    for algo in ("ring", "ulysses"):
        res = run("search", *flags, "--algos", algo, "--json")
        assert res.exit_code == 0, res.stderr
        docs[algo] = json.loads(res.stdout)["candidates"][0]["documents"]
    assert docs["ring"]["count"] == docs["ulysses"]["count"] == 64
    # Ulysses: a 48-token causal square (1,176 pairs) computes one 8,192-pair tile; Ring's pieces far more
    assert docs["ulysses"]["tile_waste"] == pytest.approx(8192 / 1176)
    assert docs["ring"]["tile_waste"] > 10 * docs["ulysses"]["tile_waste"]
    assert docs["ring"]["segments"] > docs["ulysses"]["segments"]
    text = run("search", *flags, "--algos", "ring").stdout
    assert "64 documents" in text and "tile waste" in text
    every = json.loads(run("search", *flags[:-6], "--mask", "docs:" + ",".join(map(str, lens)), "--pass", "fwd",
                           "--algos", "ring,ulysses,usp", "--json").stdout)["candidates"]
    simulated = [c for c in every if c["model_level"] == "simulated"]
    assert len(simulated) > 1 and all(c["documents"]["count"] == 64 for c in simulated)   # not only #1's


def test_layouts_that_are_the_same_computation_are_one_row():
    """Under a full mask every layout only renames the tokens: each (method, knobs) is searched once, the other
    layouts counted as skipped; under a causal mask the layouts differ and all stay. The times are those of the
    layout kept, whichever it is (checked against simulating another layout directly)."""
    from meshplan.search import LAYOUTS
    from meshplan.search.candidate import make_candidate

    topo = Topology.load("h100x8", gpus=4)
    full = resolve(seq_len="8K", heads=8, kv_heads=2, head_dim=64, mask="full")
    cands, skipped = enumerate_candidates(full, topo, 4, ["ring", "usp"], {}, False)
    assert {c.workload.layout for c in cands} == {LAYOUTS[0]}
    assert skipped["layouts that are the same computation (every block alike)"] == 2 * (len(LAYOUTS) - 1)
    ring = next(c for c in cands if c.algorithm == "ring")
    other = make_candidate("ring", full.with_(layout="zigzag"), topo, 4, ring.knobs)
    assert simulate_candidate(ring, topo, None).predicted.makespan_s == pytest.approx(
        simulate_candidate(other, topo, None).predicted.makespan_s, rel=1e-12)
    causal, _ = enumerate_candidates(full.with_(mask=resolve(seq_len="8K").mask), topo, 4, ["ring"], {}, False)
    assert {c.workload.layout for c in causal} == set(LAYOUTS)


def test_a_bound_under_the_pick_is_ranked_above_slower_rows_and_said_not_proven(monkeypatch):
    """A candidate left unsimulated (no node symmetry above a lowered limit) whose bound is under the pick's time:
    listed by its bound among the rows (never under a slower simulated row), named in ``not_proven`` with a
    simulate command that runs and times it at no less than that bound, and with its contended estimate, within 5%
    of that simulation."""
    from helpers import run

    import meshplan.search as search

    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64, passes="fwd")
    monkeypatch.setattr(search, "FULL_SIM_MAX_RANKS", 8)
    result = search.run_search(w, topo, 16, algos=["ring", "mesh"], prune_slack=0.0)
    search.ranking.estimate_unproven(result)
    times = [c.predicted.makespan_s if c.model_level == "simulated" else c.bound_s for c in result.candidates]
    assert result.candidates[0].model_level == "simulated" and times[1:] == sorted(times[1:])
    best = times[0]
    listed = search.not_proven(result)
    below = [i + 1 for i, c in enumerate(result.candidates) if c.model_level != "simulated" and c.bound_s < best]
    assert listed and [u["rank"] for u in listed] == below
    for u in listed[:1]:
        c = result.candidates[u["rank"] - 1]
        assert u["reason"] == c.not_simulated and u["bound_s"] == c.bound_s
        args = u["simulate"].split()[1:]
        r = run(*args, "--json")
        assert r.exit_code == 0, r.stderr
        import json
        simulated = json.loads(r.stdout)["predicted"]["makespan_s"]
        assert simulated >= u["bound_s"] * (1 - 1e-9)
        assert u["estimate_s"] == pytest.approx(simulated, rel=0.05)     # the contended estimate: -0.5% here


def test_closed_forms_shared_with_a_forked_process_land_on_their_own_candidates(monkeypatch):
    """make_candidates at 64 ranks sends half the schedule-building closed forms to a forked process: every
    candidate gets the timing it gets computed alone, in this process and in order."""
    from meshplan.core.parallel import can_fork
    from meshplan.search.candidate import make_candidate
    from meshplan.search.closed_forms import make_candidates

    topo = Topology.load("h100x32", gpus=64)
    w = resolve(seq_len="16K", model="llama3-8b")
    jobs = [("usp", w, {"ulysses_degree": 8}, None), ("ring", w, {}, None), ("loongtrain", w, {}, None),
            ("ulysses", w.with_(n_heads=12, n_kv_heads=12), {}, None), ("usp", w, {"ulysses_degree": 4}, None)]
    monkeypatch.setenv("MESHPLAN_FORK", "1")
    assert can_fork()
    made = make_candidates(jobs, topo, 64)
    assert isinstance(made[3], SkipCandidate)                   # 12 heads: no Ulysses degree 64
    for (name, wl, knobs, _), got in zip(jobs, made):
        if isinstance(got, SkipCandidate):
            continue
        alone = make_candidate(name, wl, topo, 64, knobs)
        assert (got.algorithm, got.knobs) == (alone.algorithm, alone.knobs)
        assert {k: t.bound_s for k, t in got.timing.items()} == {k: t.bound_s for k, t in alone.timing.items()}


def test_simulating_two_at_a_time_forked_or_not_gives_the_same_answer(monkeypatch):
    """The branch and bound in pairs simulates the same candidates to the same times and kept variants, and picks
    the same plan, whether the second of each pair runs in a forked process or after the first here; so are Ring's
    first two settings, simulated beside the branch and bound, and the reference row they give."""
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", model="llama3-8b")
    runs = {}
    for fork in ("0", "1"):
        monkeypatch.setenv("MESHPLAN_FORK", fork)
        res = run_search(w, topo, 16, algos=["ring", "mesh", "usp", "pass-q"])
        runs[fork] = {(c.algorithm, c.workload.layout, str(c.plan.extra.get("grid", "")), repr(c.knobs)):
                      c.predicted.makespan_s for c in res.candidates if c.model_level == "simulated"}
        runs[fork + "pick"] = (res.candidates[0].algorithm, res.candidates[0].knobs,
                               res.candidates[0].predicted.makespan_s)
        ref = res.reference
        runs[fork + "ref"] = (ref.workload.layout, ref.knobs, ref.model_level, ref.predicted.makespan_s)
    assert runs["0pick"] == runs["1pick"] and runs["0ref"] == runs["1ref"]
    assert runs["1ref"][2] == "simulated"
    assert runs["0"] == runs["1"] and len(runs["1"]) > 4


@pytest.mark.parametrize("full_sim_max", [256, 8])
def test_one_at_a_time_beside_the_next_refinement_forked_or_not_gives_the_same_answer(monkeypatch, full_sim_max):
    """Above PAIR_MAX_RANKS the branch and bound visits one candidate at a time while the next one's bound is
    tightened in a forked process (and, above FULL_SIM_MAX_RANKS, its node symmetry found there): the same
    candidates simulated to the same times, the same bounds, the same pick and the same unsimulated ones as when
    the two run in turn (no fork); and against visiting with nothing refined ahead, the same simulations and pick."""
    import meshplan.search as search
    from meshplan.search.branch_bound import BranchAndBound

    monkeypatch.setattr(search, "PAIR_MAX_RANKS", 8)
    monkeypatch.setattr(search, "FULL_SIM_MAX_RANKS", full_sim_max)
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", model="llama3-8b")
    runs = {}
    for fork in ("0", "1"):
        monkeypatch.setenv("MESHPLAN_FORK", fork)
        res = run_search(w, topo, 16, algos=["mesh", "usp", "ring"])
        runs[fork] = [(c.algorithm, c.workload.layout, repr(c.knobs), c.model_level, c.bound_s,
                       c.predicted.makespan_s if c.predicted else None, c.not_simulated) for c in res.candidates]
    assert runs["0"] == runs["1"]
    assert sum(r[3] == "simulated" for r in runs["1"]) >= 2
    if full_sim_max == 8:
        assert any(r[6] for r in runs["1"])           # a causal contiguous Mesh: no node symmetry, left unsimulated
    # against visiting in turn (nothing refined ahead): the same simulations and pick; a bound only ever tighter
    monkeypatch.setattr(BranchAndBound, "_refine_next", lambda self, c, upcoming: None)
    res = run_search(w, topo, 16, algos=["mesh", "usp", "ring"])
    alone = {r[:3]: r for r in ([(c.algorithm, c.workload.layout, repr(c.knobs), c.model_level, c.bound_s,
                                  c.predicted.makespan_s if c.predicted else None, c.not_simulated)
                                 for c in res.candidates])}
    assert runs["1"][0] == alone[runs["1"][0][:3]]
    for r in runs["1"]:
        a = alone[r[:3]]
        assert r[3] == a[3] and (r[5] == a[5] or r[3] != "simulated") and r[4] >= a[4] * (1 - 1e-12)


def test_a_pair_simulated_beside_brings_back_the_second_schedule_only_under_the_best(monkeypatch):
    """simulate_both's second candidate, simulated in a forked process, comes back with its schedule — the one of
    the variant it kept, equal to a fresh build — when its time is under ``keep_below`` (the branch and bound's best:
    its schedule is written without a rebuild), and without it otherwise."""
    from meshplan import algorithms
    from meshplan.search.beside import simulate_both
    from meshplan.search.candidate import make_candidate

    monkeypatch.setenv("MESHPLAN_FORK", "1")
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", model="llama3-8b")
    for keep_below, kept in ((float("inf"), True), (0.0, False)):
        first, second = (make_candidate(name, w, topo, 16, {}) for name in ("ring", "mesh"))
        simulate_both(first, second, topo, None, keep_below=keep_below)
        assert second.model_level == "simulated" and (second.schedule is not None) == kept
        if kept:
            fresh = algorithms.get("mesh").schedule(second.plan, topo)
            assert second.knobs["order"].startswith("auto:")          # the variant kept: its schedule came back
            for name in ("rank", "kind", "peer", "size_bytes", "deps", "flops"):
                np.testing.assert_array_equal(getattr(second.schedule.ops, name), getattr(fresh.ops, name))


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_schedule_is_written_under_its_name_only_once_verified(fork, tmp_path, monkeypatch):
    """write_best encodes each schedule to a staging file while it is verified (a forked process past 50K ops):
    verified, it is renamed into place, gzipped past 50K ops, nothing else left; refused by the verifier, nothing
    stands under any name."""
    import meshplan.search.write as search
    from meshplan.plan.json.io import read_schedule
    from meshplan.plan.verify import verify

    monkeypatch.setenv("MESHPLAN_FORK", fork)
    monkeypatch.setattr(search, "FORK_WRITE_MIN_OPS", 0)                 # fork even for this small schedule
    topo = Topology.load("h100x8")
    result = run_search(resolve(seq_len="64K"), topo, 8, algos=["ring"])
    search.write_best(result, 1, str(tmp_path))
    (written,) = tmp_path.iterdir()
    assert written.name.startswith("01-ring-zigzag") and written.suffix == ".json"      # 8 ranks: < 50K ops
    assert result.candidates[0].schedule_path == str(written)
    assert verify(read_schedule(written), topo.memory_bytes).ok

    def refuse(sched, memory_bytes):
        report = verify(sched, memory_bytes)
        report.violations.append("a planted violation")
        return report

    monkeypatch.setattr(search, "verify", refuse, raising=False)
    out = tmp_path / "refused"
    with pytest.raises(RuntimeError, match="a planted violation"):
        search.write_best(result, 1, str(out))
    assert not out.exists() or not any(out.iterdir())


def test_schedule_free_closed_forms_halved_between_processes_land_on_their_own_candidates(monkeypatch):
    """Where no closed form builds a schedule (above 256 ranks: Mesh, Ring), from LIGHT_SPLIT_MIN_RANKS ranks
    both processes take them one at a time from a shared counter: every candidate gets the timing it gets alone, in
    order."""
    import meshplan.search.closed_forms as cand
    from meshplan.search.candidate import make_candidate
    from meshplan.search.closed_forms import make_candidates

    monkeypatch.setenv("MESHPLAN_FORK", "1")
    monkeypatch.setattr(cand, "LIGHT_SPLIT_MIN_RANKS", 16)
    monkeypatch.setattr(cand, "PARALLEL_MIN_RANKS", 16)
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="16K", model="llama3-8b")
    jobs = [("mesh", w, {"tile": t, "mapping": "row-major"}, None) for t in ("1x16", "2x8", "4x4", "8x2", "16x1")]
    jobs += [("ring", w, {}, None), ("pass-q", w, {}, None), ("ring", w.with_(layout="contiguous"), {}, None)]
    made = make_candidates(jobs, topo, 16)
    for (name, wl, knobs, _), got in zip(jobs, made):
        alone = make_candidate(name, wl, topo, 16, knobs)
        assert (got.algorithm, got.knobs, got.workload.layout) == (alone.algorithm, alone.knobs, alone.workload.layout)
        assert {k: (t.bound_s, t.estimate_s) for k, t in got.timing.items()} == \
            {k: (t.bound_s, t.estimate_s) for k, t in alone.timing.items()}


def test_above_the_build_limit_usp_is_ranked_by_its_schedule_free_bound(monkeypatch):
    """With USP's build limit lowered to 8 ranks, a 16-rank search enumerates USP and LoongTrain from their
    schedule-free bounds (meshplan/algorithms/usp_timing.py) without building a whole schedule (USP is simulated on
    its representatives where its ranks are alike); once another candidate is simulated, one whose bound could still
    beat it is left at its bound with the reason, never silently dropped."""
    import meshplan.search as search
    from meshplan.algorithms.ulysses import USP

    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64)
    monkeypatch.setattr(USP, "search_max_ranks", 8)
    result = search.run_search(w, topo, 16, algos=None, filters={}, prune_slack=0.0)
    free = [c for c in result.candidates if c.algorithm in ("usp", "loongtrain")]
    assert {c.algorithm for c in free} == {"usp", "loongtrain"}
    best = min(c.predicted.makespan_s for c in result.candidates if c.model_level == "simulated" and not c.forward_only)
    for c in free:
        if c.model_level == "simulated":
            continue
        assert "schedule" not in c.plan.extra
        assert c.bound_s > best or c.not_simulated in (
            "its schedule is not built above 8 ranks (seconds and GBs a plan)",                      # LoongTrain
            "its schedule is not built above 8 ranks, and its ranks are not alike by node (each rank's program "
            "would be built)")                                                                        # USP
    assert result.counts["enumerated"] == result.counts["pruned"] + result.counts["simulated"]


def test_above_the_build_limit_every_method_is_enumerated_or_says_why(monkeypatch):
    """With the build limit lowered to 8 ranks for every method that builds its schedule, a 24-rank enumeration
    times StarTrail, USP, LoongTrain and the CHARM+ family by their schedule-free bounds (no schedule built); TASP,
    whose own limit is 64 ranks, is enumerated (node-aware on three nodes)."""
    from meshplan.algorithms.base import BuiltTiming

    monkeypatch.setattr(BuiltTiming, "search_max_ranks", 8)
    topo = Topology.load("h100x32", gpus=24)
    w = resolve(seq_len="48K", heads=8, kv_heads=2, head_dim=64)
    cands, skipped = enumerate_candidates(w, topo, 24, None, {}, False)
    names = {c.algorithm for c in cands}
    assert {"usp", "loongtrain", "startrail", "ring", "mesh", "tasp"} <= names
    assert all("schedule" not in c.plan.extra for c in cands if c.algorithm != "tasp")
    assert not any("not enumerated" in k or "not implemented" in k for k in skipped)


def test_lazy_closed_forms_give_the_same_pick(monkeypatch):
    """Starting the methods that build their schedule from their schedule-free bounds (lazy, from 128 ranks in a
    search; lowered here to 8) builds only the candidates it simulates (those the bound does not prune), and picks
    the same plan with the same simulated time as building every one."""
    from meshplan.algorithms.base import BuiltTiming
    from meshplan.algorithms.loongtrain import LoongTrain

    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64)
    monkeypatch.setattr(BuiltTiming, "lazy_from", None)
    eager = run_search(w, topo, 16, algos=["usp", "startrail", "charm", "ring"], prune_slack=0.0)
    monkeypatch.setattr(BuiltTiming, "lazy_from", 8)
    monkeypatch.setattr(LoongTrain, "lazy_from", None)
    lazy = run_search(w, topo, 16, algos=["usp", "startrail", "charm", "ring"], prune_slack=0.0)
    pick = lambda r: (r.candidates[0].algorithm, r.candidates[0].knobs, r.candidates[0].predicted.makespan_s)  # noqa: E731
    assert pick(lazy) == pick(eager)
    lazy_rows = [c for c in lazy.candidates if c.plan is not None and c.plan.extra.get("lazy")]
    assert lazy_rows and all("schedule" not in c.plan.extra for c in lazy_rows if c.model_level != "simulated")
    assert lazy.counts["enumerated"] == eager.counts["enumerated"]


def test_a_lazy_plan_above_the_build_limit_is_not_refined(monkeypatch):
    """A lazy LoongTrain plan refines by its built form (its schedule-free bound is up to 10% looser) — but not
    above search_max_ranks (lowered here to 16), where a search never builds it: a refinement there would build
    the schedule (GBs at 1024 ranks). Below, it refines."""
    from meshplan.algorithms import get
    from meshplan.algorithms.loongtrain import LoongTrain
    from meshplan.search.candidate import make_candidate, refine_bound

    alg = get("loongtrain")
    topo = Topology.load("h100x32", gpus=32)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64)
    monkeypatch.setattr(LoongTrain, "lazy_from", 8)
    below = make_candidate("loongtrain", w, topo, 32, {}, lazy=True)
    assert alg.refines(below.plan) and refine_bound(below, topo) >= below.bound_s
    monkeypatch.setattr(LoongTrain, "search_max_ranks", 16)
    above = make_candidate("loongtrain", w, topo, 32, {}, lazy=True)
    monkeypatch.setattr(LoongTrain, "build", lambda self, plan, topo: pytest.fail("built above the limit"))
    before = above.bound_s
    assert not alg.refines(above.plan) and refine_bound(above, topo) == before


@pytest.mark.parametrize("algo", ["ring", "mesh", "usp"])
def test_closed_form_bytes_per_flop_is_the_simulated_one(algo):
    """A closed form receives the same bytes as its schedule, so its total bytes per FLOP (fwd and bwd folded)
    equals the simulation's: the total's numerator is every rank's bytes, not the busiest rank's."""
    from meshplan.search.candidate import closed_form_predicted, make_candidate
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="64K", heads=8, kv_heads=2, head_dim=64)
    cand = make_candidate(algo, w, topo, 16, {})
    closed = closed_form_predicted(cand, None)
    sim = simulate_candidate(cand, topo, None).predicted
    for part in ("fwd", "bwd"):
        assert closed.passes[part].bytes_per_flop == pytest.approx(sim.passes[part].bytes_per_flop, rel=1e-9)
    assert closed.total.bytes_per_flop == pytest.approx(sim.total.bytes_per_flop, rel=1e-9)


def test_above_the_build_limit_nothing_is_built_not_even_the_first(monkeypatch, tmp_path):
    """A search of only schedule-free methods above their build limit (lowered to 8 ranks here; 256 shipped: a
    2048-rank USP schedule took 17 GB) builds no whole schedule, not even to have a first simulated row: USP is
    simulated on its representative ranks alone (a quotient build, not kept), and the write names the command that
    writes the best one alone — which writes a schedule that validates, with the search's prediction."""
    from typer.testing import CliRunner

    from meshplan.algorithms.ulysses import USP
    from meshplan.cli.app import app
    from meshplan.search.pipeline import SearchRequest, run_pipeline

    monkeypatch.setattr(USP, "search_max_ranks", 8)
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64)
    report = run_pipeline(SearchRequest(workload=w, topology=topo, gpus=16, algos=("usp",), write=1,
                                        out_dir=str(tmp_path)))
    result = report.result
    assert result.counts["simulated"] >= 1 and result.candidates[0].model_level == "simulated"
    assert all(c.schedule is None and "schedule" not in c.plan.extra for c in result.candidates)
    assert not list(tmp_path.iterdir())
    [msg] = [r for r in result.rejected if r.startswith("not written: #1 usp")]
    command = msg.split("write it alone: meshplan ", 1)[1].split()
    written = command[command.index("--out") + 1]
    assert written.startswith(str(tmp_path / "01-usp-")) and written.endswith("-16gpus.json.gz")
    done = CliRunner().invoke(app, command + ["--json"])
    assert done.exit_code == 0, done.output
    assert CliRunner().invoke(app, ["validate", written]).exit_code == 0
    import json
    whole = json.loads(done.output[done.output.index("{"):])["predicted"]["makespan_s"]
    assert whole == pytest.approx(result.candidates[0].predicted.makespan_s, rel=1e-12)


@pytest.mark.heavy
def test_above_the_build_limit_usp_is_simulated_on_its_representatives(monkeypatch):
    # the 1024-GPU case at 64 ranks (zigzag, as a search takes above 64 ranks): USP's schedules not built whole above
    # 32 ranks, candidates one at a time above 32 (two quotient builds side by side): every USP row the search
    # simulates has the whole build's prediction, and none is left unsimulated for want of a build
    import meshplan.search as search
    from meshplan.algorithms.ulysses import USP

    topo = Topology.load("h100x32", gpus=64)
    w = resolve(model="llama3-8b", seq_len="256K")
    whole = {(c.algorithm, str(c.knobs)): c
             for c in run_search(w, topo, 64, algos=["usp"], layout_pinned=True).candidates}
    monkeypatch.setattr(USP, "search_max_ranks", 32)
    monkeypatch.setattr(search, "PAIR_MAX_RANKS", 32)
    result = run_search(w, topo, 64, algos=["usp"], layout_pinned=True)
    simulated = [c for c in result.candidates if c.model_level == "simulated"]
    assert len(simulated) >= 2 and not any(c.not_simulated for c in result.candidates)
    assert all(c.schedule is None for c in simulated)                  # a quotient is not kept (nothing to write)
    for c in simulated:
        same = whole[(c.algorithm, str(c.knobs))]
        assert same.model_level == "simulated"
        mine, theirs = c.predicted.json(), same.predicted.json()
        for part in ("fwd", "bwd", "total"):
            assert mine[part] == pytest.approx(theirs[part], rel=1e-12)
    assert result.candidates[0].knobs == next(iter(whole.values())).knobs


def test_ring_reference_is_its_best_setting_to_within_the_near_tie_margin():
    """The reference row: Ring's default setting simulated first (the one torchtitan and Megatron-LM run), then any
    setting whose bound is more than the near-tie margin under the best simulated; so no Ring setting left at its
    bound can beat the reference by more than that margin, and the reference is the fastest simulated one."""
    from meshplan.search.ranking import NEAR_TIE, reference_slack, ring_rows

    assert reference_slack(0.01) == NEAR_TIE and reference_slack(0.05) == 0.05
    topo = Topology.load("h100x16", gpus=16)
    res = run_search(resolve(seq_len="64K", model="llama3-8b"), topo, 16, algos=["ring"])
    ring, ref = ring_rows(res.candidates), res.reference
    simulated = [c for c in ring if c.model_level == "simulated"]
    assert ref in simulated and ref.predicted.makespan_s == min(c.predicted.makespan_s for c in simulated)
    default = [c for c in ring if c.workload.layout == "zigzag" and c.knobs["dkv_hops"] == "n"]
    assert default[0] in simulated
    left = [c for c in ring if c.model_level != "simulated"]
    assert left                                   # the rule left some at their bounds (else this tests nothing)
    assert all(c.bound_s >= ref.predicted.makespan_s * (1 - NEAR_TIE) for c in left)


@pytest.mark.parametrize("name, knobs", [("usp", {"ulysses_degree": 2, "rank_order": "ring-first"}),
                                         ("usp", {"ulysses_degree": 4, "rank_order": "ulysses-first"}),
                                         ("ring", {})])
def test_a_rival_simulated_unkept_has_the_prediction_of_its_whole_simulation(name, knobs):
    """``simulate_unkept`` (the leader's rivals, the frameworks' settings): a method that builds its representatives
    alone is simulated so, others whole; every number of the prediction is the whole simulation's, and no schedule
    is left on the candidate (nor a timeline beyond its summary)."""
    from meshplan.search.candidate import make_candidate, result_json, simulate_candidate, simulate_unkept

    topo = Topology.load("h100x16", gpus=32)
    w = resolve(seq_len="64K", model="llama3-8b")
    whole = simulate_candidate(make_candidate(name, w, topo, 32, knobs), topo, 0.5)
    rival = make_candidate(name, w, topo, 32, knobs)
    assert simulate_unkept(rival, topo, 0.5) == 0
    a, b = result_json(whole), result_json(rival)
    a["simulation"].pop("wall_s"), b["simulation"].pop("wall_s")
    if name == "usp":                                   # its representatives alone: one node's ranks
        assert b["simulation"]["ranks_simulated"] < 32
    a["simulation"].pop("ranks_simulated"), b["simulation"].pop("ranks_simulated")
    assert a == b
    assert rival.schedule is None and "schedule" not in rival.plan.extra and len(rival.sim.start) == 0
