"""Frameworks' settings: known mappings both ways, round trips, and search's framework table."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search import enumerate_candidates, run_search
from meshplan.search.framework_settings import (
    FRAMEWORKS,
    Choice,
    Megatron,
    MegatronSettings,
    NotExpressible,
    Torchtitan,
    TorchtitanSettings,
    Yunchang,
    YunchangSettings,
    express,
)
from meshplan.search.frameworks import framework_bests, frameworks_json

LLAMA = resolve(seq_len="32K")                                   # 32 query / 8 KV heads, causal, fwd+bwd
GQA4 = resolve(seq_len="32K", heads=8, kv_heads=2, head_dim=64)
WORKLOADS = [LLAMA, GQA4, resolve(seq_len="32K", mask="full"), resolve(seq_len="32K", passes="fwd")]


def _usp(u, order="ulysses-first", dkv_dtype="fp32", dkv_hops="n", layout="zigzag"):
    return Choice("usp", layout, {"ulysses_degree": u, "rank_order": order, "dkv_dtype": dkv_dtype,
                                  "dkv_hops": dkv_hops})


def test_megatron_a2a_p2p_with_hierarchical_sizes_is_usp_with_te_dkv():
    s = MegatronSettings(16, "a2a+p2p", (8, 2))
    want = _usp(8, dkv_dtype="bf16", dkv_hops="n-1")     # TE: dK/dV with KV, in its dtype, N−1 hops
    assert Megatron().candidate(s, LLAMA) == want
    assert Megatron().settings(want, LLAMA, 16) == s
    assert s.cli() == "--context-parallel-size 16 --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 8 2"


def test_megatron_p2p_a2a_and_what_it_refuses():
    m = Megatron()
    assert m.candidate(MegatronSettings(8, "p2p"), LLAMA) == Choice(
        "ring", "zigzag", {"mapping": "auto", "dkv_dtype": "bf16", "dkv_hops": "n-1"})
    a2a = Choice("ulysses", "zigzag", {"rank_order": "ulysses-first"})
    assert m.candidate(MegatronSettings(8, "a2a"), LLAMA) == a2a
    with pytest.raises(NotExpressible, match="all-gather"):
        m.candidate(MegatronSettings(8, "all_gather"), LLAMA)
    with pytest.raises(NotExpressible, match="KV heads"):          # TE a2a does not replicate KV heads
        m.candidate(MegatronSettings(8, "a2a+p2p", (4, 2)), GQA4)
    with pytest.raises(NotExpressible, match="zigzag"):
        m.settings(Choice("ring", "contiguous", {"mapping": "auto", "dkv_dtype": "bf16", "dkv_hops": "n-1"}), LLAMA, 8)
    fp32 = _usp(8)                                                  # search's default wire knobs
    with pytest.raises(NotExpressible, match="dkv_dtype=bf16"):
        m.settings(fp32, LLAMA, 16)
    assert m.settings(fp32, LLAMA.with_(passes="fwd"), 16).cp_comm_type == "a2a+p2p"   # no backward: same plan


def test_yunchang_ulysses_4_ring_2_zigzag_is_usp():
    s = YunchangSettings(4, 2, True, "zigzag")
    assert Yunchang().candidate(s, LLAMA) == _usp(4)
    assert Yunchang().settings(_usp(4), LLAMA, 8) == s
    assert s.cli() == "ulysses_degree=4 ring_degree=2 use_ulysses_low=True ring_impl_type=zigzag"
    low = YunchangSettings(4, 2, False, "strip")
    assert Yunchang().candidate(low, LLAMA) == _usp(4, "ring-first", layout="striped")
    assert Yunchang().candidate(YunchangSettings(1, 8, True, "basic"), LLAMA).algorithm == "ring"
    assert Yunchang().candidate(YunchangSettings(8, 1, True, "zigzag"), LLAMA).algorithm == "ulysses"
    assert Yunchang().candidate(YunchangSettings(8, 2), GQA4) == _usp(8)    # KV heads replicated, as yunchang does
    with pytest.raises(NotExpressible, match="causal"):
        Yunchang().candidate(s, resolve(seq_len="32K", mask="full"))


def test_torchtitan_alltoall_is_ring_zigzag_and_allgather_is_not_expressible():
    ring = Choice("ring", "zigzag", {"mapping": "auto", "dkv_dtype": "fp32", "dkv_hops": "n"})
    t = Torchtitan()
    assert t.candidate(TorchtitanSettings(16, "alltoall"), LLAMA) == ring
    assert t.settings(ring, LLAMA, 16) == TorchtitanSettings(16, "alltoall")
    full = resolve(seq_len="32K", mask="full")                  # load balancing needs is_causal
    assert t.candidate(TorchtitanSettings(16, "alltoall"), full).layout == "contiguous"
    with pytest.raises(NotExpressible, match="all-gather"):
        t.candidate(TorchtitanSettings(16, "allgather"), LLAMA)


def test_mesh_and_the_others_are_not_expressible_with_a_reason():
    mesh = Choice("mesh", "zigzag", {"tile": "4x4"})
    for fw in FRAMEWORKS:
        s, why = express(fw, mesh, LLAMA, 16)
        assert s is None and "mesh" in why
    s, why = express(Torchtitan(), _usp(4), LLAMA, 8)
    assert s is None and "usp" in why


@pytest.mark.parametrize("w", WORKLOADS, ids=["llama", "gqa4", "full", "fwd"])
@pytest.mark.parametrize("n", [8, 16])
def test_settings_round_trip_to_the_same_plan(w, n):
    seen = 0
    for fw in FRAMEWORKS:
        for s in fw.offered(w, n):
            try:
                ch = fw.candidate(s, w)
            except NotExpressible:
                continue
            assert fw.settings(ch, w, n) == s                          # settings -> plan -> settings
            assert fw.candidate(fw.settings(ch, w, n), w) == ch        # plan -> settings -> plan
            seen += 1
    assert seen >= 6


@pytest.mark.parametrize("w", [LLAMA, resolve(seq_len="32K", passes="fwd")], ids=["fwd+bwd", "fwd"])
def test_search_candidates_round_trip_through_every_framework(w):
    topo = Topology.load("h100x16", gpus=16)
    cands, _ = enumerate_candidates(w, topo, 16, ["ring", "ulysses", "usp", "mesh"], {}, False)
    expressed = set()
    for c in cands:
        ch = Choice.of(c)
        for fw in FRAMEWORKS:
            s, why = express(fw, ch, c.workload, 16)
            if s is None:
                assert why
                continue
            back = fw.candidate(s, c.workload)
            assert back.key(w) == ch.key(w) and fw.settings(back, c.workload, 16) == s
            expressed.add(fw.name)
    assert expressed == {"yunchang", "torchtitan"} | ({"Megatron-LM / TransformerEngine"} if w.passes == "fwd" else
                                                     set())


def test_framework_table_respects_the_search_filters():
    topo = Topology.load("h100x8", gpus=8)
    w = resolve(seq_len="16K", passes="fwd")
    result = run_search(w, topo, 8, algos=["ring"])
    bests = framework_bests(result, ["ring"])
    body = {f["framework"]: f for f in frameworks_json(bests, result.candidates[0].makespan_s)}
    assert body["yunchang"]["algorithm"] == "ring" and body["torchtitan"]["algorithm"] == "ring"
    assert body["Megatron-LM / TransformerEngine"]["cli"] == "--context-parallel-size 8 --cp-comm-type p2p"
    assert any("excluded by --algos" in x["reason"] for x in body["yunchang"]["not_expressible"])
    pinned = run_search(w.with_(layout="contiguous"), topo, 8, algos=["ring"], layout_pinned=True)
    meg = frameworks_json(framework_bests(pinned, ["ring"]), pinned.candidates[0].makespan_s)[0]
    assert meg["settings"] is None and "zigzag" in meg["reason"]


def test_search_json_frameworks_are_never_faster_than_the_best_plan_they_share():
    r = CliRunner().invoke(app, ["search", "--gpus", "16", "--topo", "h100x16", "--seq-len", "32K", "--pass", "fwd",
                                 "--prune-slack", "0", "--write", "0", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    best = d["candidates"][0]["predicted"]["makespan_s"]
    fws = {f["framework"]: f for f in d["frameworks"]}
    assert set(fws) == {fw.name for fw in FRAMEWORKS}
    for f in fws.values():
        assert {"settings", "cli", "algorithm", "layout", "knobs", "time_s", "vs_best", "in_search"} <= set(f)
        assert f["vs_best"] == pytest.approx(f["time_s"] / best)
        if f["in_search"]:                    # among the search's candidates: its pick is at least as fast
            assert f["time_s"] >= best * (1 - 1e-12)
    meg = fws["Megatron-LM / TransformerEngine"]
    assert meg["algorithm"] == "usp" and meg["settings"]["hierarchical_context_parallel_sizes"] == [8, 2]
    assert any("all_gather" in x["cli"] for x in meg["not_expressible"])


def test_search_prints_the_framework_table():
    r = CliRunner().invoke(app, ["search", "--gpus", "8", "--topo", "h100x8", "--seq-len", "16K", "--pass", "fwd",
                                 "--write", "0", "--top", "3"])
    assert r.exit_code == 0, r.stderr
    assert "Megatron-LM / TransformerEngine" in r.stdout and "--context-parallel-size 8" in r.stdout
    assert "ring_impl_type=" in r.stdout and "context_parallel_rotate_method" in r.stdout


def test_above_the_full_simulation_size_only_the_searchs_simulated_plans_are_timed(monkeypatch):
    """Above FULL_SIM_MAX_RANKS a framework setting the search did not simulate is listed as not evaluated, with the
    simulate command, and nothing is simulated (a 1024-rank plan takes up to a minute and GBs to simulate)."""
    import meshplan.search.frameworks as fwmod

    topo = Topology.load("h100x8", gpus=8)
    result = run_search(resolve(seq_len="16K", passes="fwd"), topo, 8, algos=["ring", "ulysses"])
    monkeypatch.setattr(fwmod, "FULL_SIM_MAX_RANKS", 4)
    monkeypatch.setattr(fwmod, "simulate_unkept", lambda *a, **k: pytest.fail("simulated a framework plan"))
    simulated = {Choice.of(c).key(result.workload) for c in result.candidates if c.model_level == "simulated"}
    for fb in framework_bests(result, ["ring", "ulysses"]):
        assert fb.simulated == 0
        assert fb.choice is None or fb.choice.key(result.workload) in simulated
        for _cli, why in fb.not_evaluated:
            assert why.startswith("not simulated above 4 ranks") and "meshplan simulate --algo" in why
    listed = [why for fb in framework_bests(result, ["ring", "ulysses"]) for _cli, why in fb.not_evaluated]
    assert listed
    from helpers import run  # the suggested command runs as printed (every flag it needs)
    command = listed[0].split("time it: ", 1)[1].split()
    assert command[:2] == ["meshplan", "simulate"]
    r = run(*command[1:], "--json")
    assert r.exit_code == 0, r.stderr
