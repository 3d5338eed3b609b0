"""A batch of transfers is one NCCL group (issue 22, part 4): the verifier states and checks the order rule grouped
P2P needs, and the executor posts every batch as one ``batch_isend_irecv`` group."""

from __future__ import annotations

import json

import pytest
from exec_cases import Case
from helpers import run
from test_verify import build

from meshplan.plan.verify import verify


@pytest.mark.parametrize("name,n,knobs", [("ring", 4, {}), ("ulysses", 4, {}), ("usp", 4, {"ulysses_degree": "2"}),
                                          ("mesh", 4, {"tile": "2x2"}), ("charm", 4, {"domains": "2"}),
                                          ("loongtrain", 8, {"inner_ring": "2"}), ("startrail", 8, {"team_size": "2"}),
                                          ("pass-q", 4, {}), ("rmplus", 4, {}), ("merge", 4, {})])
def test_every_method_issues_its_batches_in_one_order_on_both_peers(name, n, knobs):
    from meshplan.algorithms import get
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve

    w = resolve(seq_len=128 * n, heads=4, kv_heads=2, head_dim=16)
    t = Topology.load("cpu-local", n)
    alg = get(name)
    report = verify(alg.schedule(alg.plan(w, t, n, alg.normalize(knobs)), t))
    assert report.ok and "batch order" not in report.counts, report.violations


def test_split_batch_breaks_the_order_rule(tmp_path):
    """Rank 0 posts its first exchange with rank 1 as two batches, rank 1 as one: the dataflow completes (the model
    does not deadlock), but grouped P2P pairs rank 0's second batch with rank 1's first — the verifier refuses."""
    good = tmp_path / "u.json"
    r = run("simulate", "--algo", "ulysses", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 256, "--heads", 4,
            "--kv-heads", 2, "--head-dim", 16, "--pass", "fwd", "--out", good)
    assert r.exit_code == 0, r.stderr
    doc = json.loads(good.read_text())
    first = [op for op in doc["ranks"][0]["ops"] if op["kind"] in ("send", "recv") and op["step"] == 0]
    assert len(first) == 4
    for op in first[2:]:
        op["step"] = 7
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    v = run("validate", bad)
    said = " ".join(v.stdout.split())            # wrapped at the terminal's width
    assert v.exit_code == 1 and "NCCL needs both peers to issue their batches in one order" in said, v.stdout
    assert "batch #2 with rank 1" in said and "batch #1" in said


def test_batch_order_is_checked_per_pair_only():
    """Splitting a ring step into a send batch and a recv batch keeps each pair's order: still valid."""
    s = build("ring", 4, passes="fwd")
    o = s.ops
    recv0 = [i for i in range(len(o)) if o.rank[i] == 0 and o.kind[i] == 2]
    o.step[recv0] += 1000                                   # rank 0's recvs each form their own batch
    assert verify(s).ok


@pytest.mark.timeout(300)
def test_the_executor_posts_every_batch_as_one_group(tmp_path):
    pytest.importorskip("torch")
    import batch_cases

    from meshplan.executor.launch import free_port, spawn_ranks
    from meshplan.executor.program import load_program
    from meshplan.executor.worker import RunConfig

    path = Case("mesh", "mesh", 4, knobs={"tile": "2x2"}, workload={"seq_len": 256, "heads": 2, "kv_heads": 2,
                                                                     "head_dim": 16}).write(tmp_path)
    prog = load_program(path)
    cfg = RunConfig(iters=1, warmup=0, check="full", memory=False, init_method=f"tcp://127.0.0.1:{free_port()}")
    got = spawn_ranks(batch_cases.counting_rank_main, 4, [(prog, cfg)])
    assert got["result"]["numerics"]["passed"] is True
    units = [u for p in prog.passes for us in prog.units(0, p).values() for u in us if u[0].kind in ("send", "recv")]
    ops = sum(len(u) for u in units)
    assert got["counts"] == {"batches": len(units), "in_batch": ops, "outside": 0}
