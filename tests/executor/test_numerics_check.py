"""Every run checks its numerics (issue 22, part 2): the full float64 check when it is cheap, a sampled one at any
size, ``--no-check`` the only way to skip; both catch padding computed as real tokens (a test double: attention
of a workload whose padding is real), and honest results pass."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from meshplan.executor.data import Inputs, make_inputs, single_process  # noqa: E402
from meshplan.executor.numerics import judge  # noqa: E402
from meshplan.executor.program import program_of  # noqa: E402
from meshplan.executor.sample import check_mode, pick_sample  # noqa: E402
from meshplan.model.topology import Topology  # noqa: E402
from meshplan.model.workload import resolve  # noqa: E402
from meshplan.plan.json.measurement import Numerics  # noqa: E402
from meshplan.search.candidate import predict  # noqa: E402


def _program(seq_len: int, mask: str, heads: int = 2, head_dim: int = 128, dtype: str = "bf16",
             passes: str = "fwd+bwd"):
    w = resolve(seq_len=seq_len, heads=heads, kv_heads=heads, head_dim=head_dim, mask=mask, dtype=dtype,
                doc_layout="packed", passes=passes)
    return program_of(predict("ring", w, Topology.load("cpu-local", 2), 2, {}).schedule)


def _results(inputs: Inputs, w, backward: bool = True) -> dict[str, np.ndarray]:
    """What a run gathers, computed in one process by the executor's kernels for workload ``w``."""
    got = single_process(inputs, w, backward)
    return {k: (v.float() if k == "lse" else v.to(inputs.q.dtype).float()).numpy() for k, v in got.items()}


def _padding_as_real(w):
    """The test double's workload: the same documents with their padding counted as real tokens."""
    from meshplan.model.workload import Mask
    return w.with_(mask=Mask("docs", doc_lens=w.mask.doc_lens))


@pytest.mark.timeout(300)
def test_sampled_check_catches_padding_computed_as_real_at_4096():
    prog = _program(4096, "docs:2040,2052+4")
    w = prog.workload
    assert check_mode(w, None) == "sampled"
    sample = pick_sample(prog, seed=0)
    assert 16 <= len(sample) <= 2 * 40 and (~w.is_real(sample.pos)).any()      # padding rows are in the sample
    inp = make_inputs(w, seed=0)
    inp = Inputs(inp.q, inp.k, inp.v, sample.masked_dout(inp.dout))
    honest = judge(prog, inp, _results(inp, w), "sampled", sample)
    assert honest.checked == "sampled" and honest.passed, {k: v.max_abs_err for k, v in honest.tensors.items()}
    bug = judge(prog, inp, _results(inp, _padding_as_real(w)), "sampled", sample)
    failed = {k for k, v in bug.tensors.items() if not v.passed}
    assert bug.passed is False and {"out", "lse", "dk", "dv"} <= failed, failed
    assert bug.tensors["out"].max_abs_err > 10 * bug.tensors["out"].bound


def test_full_check_holds_padding_rows_to_zero():
    """The full check now covers padding rows: O = 0, LSE = −inf, dQ = 0 (it used to skip them)."""
    prog = _program(16, "docs:5+3,6+2", heads=1, head_dim=16, dtype="fp32")
    w = prog.workload
    inp = make_inputs(w, seed=0)
    assert judge(prog, inp, _results(inp, w), "full").passed
    bug = judge(prog, inp, _results(inp, _padding_as_real(w)), "full")
    assert bug.passed is False and not bug.tensors["out"].passed and not bug.tensors["lse"].passed


def test_sampled_check_of_a_forward_pass_and_a_wrong_kv_chunk():
    """Forward only: honest passes; results from other keys (a wrong KV chunk everywhere) fail on the sample."""
    prog = _program(2048, "causal", heads=4, head_dim=64, passes="fwd")
    w = prog.workload
    sample = pick_sample(prog, seed=3)
    inp = make_inputs(w, seed=1)
    assert judge(prog, inp, _results(inp, w, backward=False), "sampled", sample).passed
    other = Inputs(inp.q, torch.roll(inp.k, 256, dims=1), inp.v, inp.dout)
    assert not judge(prog, inp, _results(other, w, backward=False), "sampled", sample).passed


def test_check_modes_and_old_files():
    small, big = _program(256, "causal", heads=1, head_dim=16).workload, _program(4096, "causal").workload
    assert check_mode(small, None) == "full" and check_mode(big, None) == "sampled"
    assert check_mode(big, True) == "full" and check_mode(small, False) == "off"
    assert Numerics.model_validate({"checked": True, "passed": True}).checked == "full"
    assert Numerics.model_validate({"checked": False, "passed": None}).checked == "off"


@pytest.mark.timeout(600)
def test_runs_check_by_default_and_skip_only_when_told(tmp_path):
    """A run above the full check's cost is sampled by default; ``--no-check`` (check=False) is off."""
    from exec_cases import Case, point_at_another_kv_chunk

    from meshplan.executor.launch import run_batch
    from meshplan.executor.worker import RunConfig
    from meshplan.plan.json.io import write_schedule

    path = tmp_path / "big.json"
    write_schedule(predict("ring", resolve(seq_len=4096, heads=2, kv_heads=1, head_dim=128, mask="docs:2040,2052+4",
                                           doc_layout="packed"), Topology.load("cpu-local", 2), 2, {}).schedule, path)
    bad = Case("bad-kv", "ring", 2, workload={"mask": "full"}, edit=point_at_another_kv_chunk).write(tmp_path)
    default, off, wrong = run_batch([(str(path), RunConfig(iters=1, warmup=0, memory=False)),
                                     (str(path), RunConfig(iters=1, warmup=0, memory=False, check=False)),
                                     (str(bad), RunConfig(iters=1, warmup=0, memory=False, check="sampled"))])
    assert wrong["numerics"]["checked"] == "sampled" and wrong["numerics"]["passed"] is False   # each rank judged
    n = default["numerics"]
    assert n["checked"] == "sampled" and n["passed"] is True and n["sampled_triples"] >= 8
    assert set(n["tensors"]) == {"out", "lse", "dq", "dk", "dv"}
    assert off["numerics"] == {"checked": "off", "passed": None, "sampled_triples": None, "reference": "",
                               "tensors": {}}
