"""Padding inside documents, in every layout (issue 22, part 1): never a query row or a key anywhere — the matrix,
the mask, the verifier, the executor and every refusal's suggestion agree; padding rows come back O = 0 and
LSE = −inf."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from helpers import one_line_error, run
from test_matrix import brute_pairs, wl

from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix
from meshplan.model.workload import Mask

PACKED_PADDED = ["docs:5+3,6+2,8", "docs:7+2,9,5+1", "docs:1+7,16", "docs:3+1,3+1,3+1,3+1,3+1,3+1"]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("mask", PACKED_PADDED)
@pytest.mark.parametrize("valid", [None, 20])
def test_packed_documents_with_padding_match_brute_force(layout, mask, valid):
    """Pairs per block as enumerated; every real token on one rank, no padding token among the valid ones."""
    w = wl(24, layout, mask, valid, doc_layout="packed")
    for n in (2, 3) if layout != "zigzag" else (2, 3):
        if 24 % (2 * n if layout == "zigzag" else n):
            continue
        m = AttnMatrix(w, n)
        assert np.array_equal(m.pairs, brute_pairs(w, m))
        real = w.is_real(np.arange(24))
        assert m.valid_count.sum() == real.sum()
        for i in range(n):                             # the descriptors' rows: real tokens only
            pos = m.chunks.positions(i)
            rows = [r for a, b in m.local_ranges(i, np.ones(m.q_involved.shape[2], bool), query=True)
                    for r in range(a, b)]
            assert real[pos[rows]].all() and len(rows) == real[pos].sum()


def test_the_issues_count_36_pairs_not_72():
    m = AttnMatrix(wl(16, "zigzag", "docs:5+3,6+2", doc_layout="packed"), 2)
    assert m.pairs.sum() == 5 * 6 // 2 + 6 * 7 // 2 == 36


@pytest.mark.parametrize("mask", ["docs:5+3,6+2,8", "docs:1+7,16", "docs:24"])
def test_mask_rule_and_key_runs_leave_padding_out(mask):
    """``permits`` is the brute-force rule; ``key_ranges`` its runs over ascending keys (none for a padding row)."""
    m = Mask.parse(mask)
    pos = np.arange(24)
    bounds = m.doc_bounds
    doc = np.searchsorted(bounds, pos, side="right") - 1
    real = pos < bounds[doc] + np.asarray(m.doc_real_lens())[doc]
    want = (pos[None, :] <= pos[:, None]) & (doc[:, None] == doc[None, :]) & real[:, None] & real[None, :]
    assert np.array_equal(m.permits(pos, pos), want)
    lo, hi = m.key_ranges(pos, pos)
    runs = (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
    assert np.array_equal(runs, want)


def _widen_rows_to_padding(doc: dict) -> None:
    """What the planner used to write: a compute op whose q_rows take its chunk's padding rows too."""
    sizes = {c["id"]: sum(s[2] for s in c["segments"]) for c in doc["chunks"]}
    for op in (op for r in doc["ranks"] for op in r["ops"]):
        if op["kind"] == "compute" and len(op["q_chunks"]) == 1:
            n = sizes[op["q_chunks"][0]]
            if op["q_rows"] != [[0, n]]:
                op["q_rows"] = [[0, n]]
                return
    raise AssertionError("no op to widen")


def test_a_file_computing_padding_rows_is_invalid(tmp_path):
    out = tmp_path / "a.json"
    r = run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 8, "--heads", 1,
            "--kv-heads", 1, "--head-dim", 64, "--mask", "docs:2+2,4", "--layout", "zigzag", "--doc-layout", "packed",
            "--pass", "fwd+bwd", "--dtype", "fp32", "--out", out)
    assert r.exit_code == 0, r.stderr
    assert run("validate", out).exit_code == 0
    doc = json.loads(out.read_text())
    _widen_rows_to_padding(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    v = run("validate", bad)
    said = " ".join(v.stdout.split())            # wrapped at the terminal's width
    assert v.exit_code == 1 and "real tokens that take part (padding computed" in said, v.stdout
    pytest.importorskip("torch")
    one_line_error(run("run", bad, "--out", tmp_path / "m.json"), "padding computed")
    assert not (tmp_path / "m.json").exists()


# ---------------------------------------------------------------------------------------------- the CLI's hints
BASE = ["--gpus", "2", "--topo", "cpu-local", "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--dtype", "fp32"]
REFUSED = [   # (what the user typed, what the refusal must offer)
    (["--mask", "docs:5,6"],
     ["--mask docs:5+3,6+2 --seq-len 16", "--doc-layout packed --mask docs:5,6+1 --seq-len 12"]),
    (["--mask", "docs:5,6", "--doc-layout", "packed"], ["--mask docs:5,6+1 --seq-len 12"]),
    (["--mask", "docs:5+1,6", "--gpus", "4", "--layout", "contiguous"],
     ["--mask docs:5+3,6+2 --seq-len 16", "--doc-layout packed --mask docs:5+1,6 --seq-len 12"]),
    (["--seq-len", "15"], ["--seq-len 16 --valid-len 15"]),
    (["--seq-len", "13", "--prefix-len", "8", "--pass", "fwd"], ["--seq-len 16 --valid-len 13"]),
]


def _suggestions(line: str) -> list[list[str]]:
    """The flag sets a refusal offers (after 'pad ...:' and ', or pack them:')."""
    fix = line.split("; ", 1)[1]
    parts = [p.split(": ", 1)[1] for p in fix.split(", or ") if ": --" in p]
    return [shlex.split(p.split(" (")[0]) for p in parts]


def _apply(typed: list[str], fix: list[str]) -> list[str]:
    """The user's flags with the suggested ones replacing theirs."""
    flags, i = {}, 0
    for seq in (BASE, typed, fix):
        i = 0
        while i < len(seq):
            flags[seq[i]] = seq[i + 1]
            i += 2
    return [x for kv in flags.items() for x in kv]


def _refusal(typed: list[str]) -> str:
    r = run("simulate", "--algo", "ring", *_apply(typed, []))
    one_line_error(r)
    return r.stderr.strip()


@pytest.mark.parametrize("typed,offered", REFUSED)
def test_every_refusal_offers_complete_flags(typed, offered):
    line = _refusal(typed)
    for want in offered:
        assert want in line, line


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_every_suggestion_runs_with_correct_numerics(tmp_path):
    """Each suggested command plans, verifies and runs (2 or 4 CPU ranks) with its numerics checked in full."""
    pytest.importorskip("torch")
    from meshplan.executor.launch import run_batch
    from meshplan.executor.worker import RunConfig

    jobs: dict[int, list] = {}
    for k, (typed, _) in enumerate(REFUSED):
        for j, fix in enumerate(_suggestions(_refusal(typed))):
            out = tmp_path / f"s{k}-{j}.json"
            flags = _apply(typed, fix)
            r = run("simulate", "--algo", "ring", *flags, "--out", out)
            assert r.exit_code == 0, (flags, r.stderr)
            jobs.setdefault(int(flags[flags.index("--gpus") + 1]), []).append(str(out))
    assert sum(map(len, jobs.values())) == 7
    for files in jobs.values():
        for res in run_batch([(f, RunConfig(iters=1, warmup=0, check=True, memory=False)) for f in files]):
            bad = {k: v["max_abs_err"] for k, v in res["numerics"]["tensors"].items() if not v["passed"]}
            assert res["numerics"]["checked"] == "full" and res["numerics"]["passed"], bad


@pytest.mark.timeout(300)
def test_the_issues_case_runs_with_padding_rows_zero(tmp_path):
    """``docs:2+2,4`` packed, zigzag, 2 ranks: numerics pass, and the dumped padding rows (2, 3) hold O = 0,
    LSE = −inf, dQ = 0, and dK = dV = 0."""
    pytest.importorskip("torch")
    out, dump = tmp_path / "a.json", tmp_path / "dump"
    r = run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 8, "--heads", 1,
            "--kv-heads", 1, "--head-dim", 64, "--mask", "docs:2+2,4", "--layout", "zigzag", "--doc-layout", "packed",
            "--pass", "fwd+bwd", "--dtype", "fp32", "--out", out)
    assert r.exit_code == 0, r.stderr
    r = run("run", out, "--iters", 1, "--warmup", 0, "--dump", dump, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["measurement"]["numerics"]["passed"] is True
    pad = [2, 3]
    assert (np.load(dump / "out.npy")[:, pad] == 0).all() and (np.load(dump / "dq.npy")[:, pad] == 0).all()
    assert np.isneginf(np.load(dump / "lse.npy")[:, :, pad]).all()
    assert (np.load(dump / "dk.npy")[:, pad] == 0).all() and (np.load(dump / "dv.npy")[:, pad] == 0).all()
    assert np.isfinite(np.load(dump / "lse.npy")[:, :, [0, 1, 4, 5, 6, 7]]).all()


def test_padding_refusals_raise_user_errors():
    with pytest.raises(UserError, match="or pack them: --doc-layout packed --mask docs:7,9 --seq-len 16"):
        AttnMatrix(wl(16, "zigzag", "docs:7,9"), 2)
