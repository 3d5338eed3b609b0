"""The drop-in ``meshplan.executor.attention``: output and dQ, dK, dV on sharded inputs against the float64
reference (fp32: ≤ 1e-5·max|ref|; bf16: ``meshplan run --check``'s criterion), bitwise equal to the passes as
``meshplan run`` runs them, on 1 rank in-process and 2 and 4 spawned CPU ranks (gloo) for Ring (zigzag),
Mesh 2×2, CHARM+ (2 domains), pass-Q, StarTrail, LoongTrain, RM+ and merge, on the world and on two 2-rank
subgroups; the one-line errors; and the example training step (benchmarks/train_step.py) against the
single-process model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.heavy      # multi-rank runs: `pytest -m heavy`, and CI

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from exec_cases import Case  # noqa: E402

from meshplan.core.errors import UserError  # noqa: E402
from meshplan.executor import as_program, attention, shard, unshard  # noqa: E402
from meshplan.executor.launch import RunFailed, free_port, spawn_ranks  # noqa: E402
from meshplan.executor.local import local_chunk  # noqa: E402

FP32_RTOL = 1e-5           # max |got − ref| / max |ref| for fp32 ranks against float64
SMALL = {"seq_len": 128, "heads": 4, "kv_heads": 2, "head_dim": 16, "dtype": "fp32"}
BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
OTHERS = [Case("pass-q", "pass-q", 4, workload=SMALL), Case("startrail", "startrail", 4, knobs={"team_size": "2"},
                                                           workload=SMALL | {"layout": "contiguous"}),
          Case("loongtrain", "loongtrain", 4, knobs={"inner_ring": "2"}, workload=SMALL),
          Case("rmplus", "rmplus", 4, workload=SMALL | {"mask": "full"}), Case("merge", "merge", 4, workload=SMALL),
          Case("doc-place", "doc-place", 4, workload=SMALL | {"mask": "docs:70,10+2,30,16"})]   # one split, one padded


def _native_crash(err: RunFailed) -> bool:
    """A rank that died in native code without a Python-level reason (or by a signal such as gloo's SIGABRT)."""
    return "exited without a reason" in str(err) or "was ended by SIGABRT" in str(err)


def _spawn(world: int, cases: list[dict]) -> dict:
    """Rank 0's results; one more try when a rank died in native code without a Python-level reason (a gloo
    ``terminate called without an active exception`` seen once on a loaded CI machine), never on a reported error."""
    import autograd_cases

    for attempt in (1, 2):
        try:
            return spawn_ranks(autograd_cases.rank_main, world, {"init": f"tcp://127.0.0.1:{free_port()}",
                                                                 "cases": cases}, prefix="meshplan-autograd-")
        except RunFailed as err:
            if attempt == 2 or not _native_crash(err):
                raise


def _close(res: dict, rtol: float = FP32_RTOL) -> None:
    bad = {n: (e, res["ref"][n]) for n, e in res["err"].items() if e > rtol * res["ref"][n]}
    assert not bad, f"max |error| above {rtol:g}·max|ref|: {bad}"


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ag2")
    ring = Case("ring", "ring", 2, workload=SMALL | {"batch": 2}).write(folder)
    bf16 = Case("ring-bf16", "ring", 2, workload=SMALL | {"dtype": "bf16"})
    padded = Case("ring-packed-pad", "ring", 2, workload=SMALL | {"mask": "docs:50+14,60+4", "doc_layout": "packed"})
    return _spawn(2, [{"name": "ring", "schedule": str(ring), "vs_run": True},
                      {"name": "ring-bf16", "schedule": as_program(bf16.write(folder)), "vs_run": True},
                      {"name": "ring-packed-pad", "schedule": str(padded.write(folder)), "vs_run": True}])


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ag4")
    wl = SMALL | {"seq_len": 256}
    mesh = Case("mesh", "mesh", 4, knobs={"tile": "2x2"}, workload=wl).write(folder)
    charm = Case("charm", "charm", 4, knobs={"domains": "2"}, workload=wl | {"dtype": "bf16"}).write(folder)
    ring = Case("ring", "ring", 2, workload=SMALL).write(folder)
    others = [{"name": c.name, "schedule": str(c.write(folder)), "vs_run": True} for c in OTHERS]
    return _spawn(4, [{"name": "mesh", "schedule": str(mesh), "vs_run": True},
                      {"name": "charm", "schedule": str(charm), "vs_run": True},
                      {"name": "ring-sub", "schedule": str(ring), "groups": [[0, 1], [2, 3]], "seed": 3}] + others)


@pytest.mark.timeout(120)
def test_ring2_fp32_gqa_batch2_matches_float64(world2):
    res = world2["ring@0"]
    assert res["shapes"] == {"q": (2, 64, 4, 16), "k": (2, 64, 2, 16)}
    _close(res)
    assert res["passed"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["ring", "ring-bf16"])
def test_ring2_bitwise_equal_to_meshplan_run(world2, name):
    res = world2[f"{name}@0"]
    assert res["vs_run"] == {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    assert res["passed"], "bf16: the meshplan run --check criterion (3x one process's error, or the floor)"


@pytest.mark.timeout(120)
def test_packed_documents_with_padding_train_right(world2):
    """Padded packed documents (TransformerEngine's cu_seqlens_padded): the drop-in's outputs and gradients equal
    float64 on every token, padding included (its output rows 0, no gradient through it), and equal the run's."""
    res = world2["ring-packed-pad@0"]
    _close(res)
    assert res["passed"] and res["vs_run"] == {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    assert res["padding_out_max"] == 0.0


@pytest.mark.timeout(120)
def test_mesh2x2_fp32_matches_float64_and_run(world4):
    res = world4["mesh@0"]
    _close(res)
    assert res["passed"] and res["vs_run"] == {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}


@pytest.mark.timeout(120)
def test_charm_bf16_passes_the_run_criterion_and_equals_run(world4):
    res = world4["charm@0"]
    assert res["passed"] and res["vs_run"] == {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
    _close(res, rtol=2.0 ** -5)       # bf16 inputs, fp32 accumulation: a few bf16 ulps of max|ref|


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [c.name for c in OTHERS])
def test_other_schedules_starting_from_own_chunks(world4, name):
    res = world4[f"{name}@0"]
    _close(res)
    assert res["vs_run"] == {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}


@pytest.mark.timeout(120)
def test_two_subgroups_run_the_schedule_independently(world4):
    """Schedule ranks are group ranks: global ranks 2 and 3 run the 2-rank schedule as its ranks 0 and 1."""
    for key in ("ring-sub@0", "ring-sub@2"):
        _close(world4[key])
    assert world4["ring-sub@0"]["err"] == world4["ring-sub@2"]["err"]


@pytest.fixture(scope="module")
def world1():
    """A one-process gloo world in this process (torch.distributed needs one even for one rank)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _write(tmp_path, name: str, algo: str, n: int, **wl) -> Path:
    return Case(name, algo, n, workload=SMALL | wl).write(tmp_path)


@pytest.mark.timeout(120)
def test_one_rank_in_process_matches_float64(world1, tmp_path):
    from meshplan.executor.data import make_inputs, reference

    prog = as_program(_write(tmp_path, "r1", "ring", 1, seq_len=64))
    inp = make_inputs(prog.workload, 1)
    q, k, v = (x.clone().requires_grad_() for x in (inp.q, inp.k, inp.v))
    out = attention(q, k, v, prog)
    out.backward(inp.dout)
    ref = reference(inp, prog.workload, backward=True)
    for name, got in {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad}.items():
        torch.testing.assert_close(got.double(), ref[name], rtol=0, atol=FP32_RTOL * float(ref[name].abs().max()))


@pytest.mark.timeout(120)
def test_one_line_errors(world1, tmp_path):
    ring1 = as_program(_write(tmp_path, "r1", "ring", 1, seq_len=64))
    q, kv = torch.zeros(1, 64, 4, 16), torch.zeros(1, 64, 2, 16)
    with pytest.raises(UserError, match=r"^group: has 1 ranks but the ring schedule has 2"):
        attention(q, kv, kv, _write(tmp_path, "r2", "ring", 2))
    with pytest.raises(UserError, match=r"^k: has shape \(1, 64, 4, 16\), the schedule's rank needs \(1, 64, 2, 16\)"):
        attention(q, q, kv, ring1)
    with pytest.raises(UserError, match=r"^q: is torch.bfloat16, the schedule's workload is fp32"):
        attention(q.bfloat16(), kv, kv, ring1)
    fwd_only = _write(tmp_path, "fwd", "ring", 1, seq_len=64, passes="fwd")
    with pytest.raises(UserError, match="has no bwd pass, so it cannot train; plan it with --pass fwd"):
        attention(q.requires_grad_(), kv, kv, fwd_only)
    with torch.no_grad():                   # inference with a forward-only schedule is fine
        assert attention(q, kv, kv, fwd_only).shape == (1, 64, 4, 16)


def test_uninitialized_world_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    prog = as_program(_write(tmp_path, "r1", "ring", 1, seq_len=64))
    with pytest.raises(UserError, match="torch.distributed is not initialized; call"):
        attention(torch.zeros(1, 64, 4, 16), torch.zeros(1, 64, 2, 16), torch.zeros(1, 64, 2, 16), prog)


def test_ulysses_backward_inputs_are_refused(tmp_path):
    prog = as_program(_write(tmp_path, "u", "ulysses", 2, seq_len=64))
    with pytest.raises(UserError, match="starts its bwd pass from chunks .* that it does not hold"):
        local_chunk(prog, 0)


def test_shard_is_the_zigzag_chunk_and_unshard_inverts_it(tmp_path):
    prog = as_program(_write(tmp_path, "r4", "ring", 4, seq_len=64))
    x = torch.arange(64).view(1, 64, 1, 1).float()
    # zigzag on 4 ranks: rank r holds the 8-token pieces r and 7 − r
    want = np.concatenate([np.arange(8 * 1, 8 * 2), np.arange(8 * 6, 8 * 7)])
    assert shard(x, prog, 1).flatten().long().tolist() == want.tolist()
    assert torch.equal(unshard([shard(x, prog, r) for r in range(4)], prog), x)
    with pytest.raises(UserError, match="^x: has 32 tokens along dim 1, the schedule has S = 64"):
        shard(x[:, :32], prog, 0)


@pytest.mark.timeout(180)
def test_example_train_step_matches_single_process(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))          # the spawned ranks import train_step too
    import train_step

    for attempt in (1, 2):     # one more try on a native teardown crash only, as _spawn does
        try:
            res = train_step.train_step("mesh", 4)
            break
        except RunFailed as err:
            if attempt == 2 or not _native_crash(err):
                raise
    assert res["loss_rel_err"] <= train_step.LOSS_RTOL
    bad = {n: e for n, e in res["grads"].items() if e[0] > train_step.GRAD_RTOL * e[1]}
    assert not bad and res["ok"], f"gradients off: {bad}"
    assert set(res["grads"]) >= {"q.weight", "kv.weight", "proj.weight", "tok.weight"}


@pytest.mark.timeout(240)
def test_training_on_packed_documents_with_a_plan_per_batch(monkeypatch):
    """benchmarks/train_docs.py: three steps, a new pack and a new doc-place plan each, on 2 CPU ranks; every
    step's loss and gradients against the float64 model that trains on the whole pack in one process."""
    monkeypatch.syspath_prepend(str(BENCH))
    import train_docs

    for attempt in (1, 2):
        try:
            res = train_docs.train_docs(ranks=2, steps=3)
            break
        except RunFailed as err:
            if attempt == 2 or not _native_crash(err):
                raise
    assert len(res["steps"]) == 3 and any(s["split"] for s in res["steps"])      # a document split somewhere
    for s in res["steps"]:
        assert s["loss_rel_err"] <= train_docs.LOSS_RTOL
        assert all(e <= train_docs.GRAD_RTOL * m for e, m in s["grads"].values()), s["grads"]
    assert len({round(s["ref_loss"], 6) for s in res["steps"]}) == 3              # the model did train
