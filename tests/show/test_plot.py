"""``meshplan plot``: the data behind each plot against known answers, the files written (PNG magic, SVG), and
one-line refusals (exit 2) that leave no file behind."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import fake_measurement, one_line_error, run

from meshplan.show.plot_data import assignment_grid, mape_pct, parse_ranks, read_pairs, scaling_data, timeline_data

SMALL = ["--topo", "cpu-local", "--seq-len", "4K", "--heads", 4, "--kv-heads", 4, "--head-dim", 16,
         "--layout", "contiguous"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _simulate(tmp, name, algo, *extra):
    path = tmp / f"{name}.json"
    r = run("simulate", "--algo", algo, "--gpus", 4, *SMALL, *extra, "--out", path)
    assert r.exit_code == 0, r.stderr
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plot")
    return {"ring": _simulate(tmp, "ring", "ring"), "mesh": _simulate(tmp, "mesh", "mesh", "--tile", "2x2"),
            "usp": _simulate(tmp, "usp", "usp", "--ulysses-degree", 2, "--pass", "fwd"), "dir": tmp}


# ---------------------------------------------------------------------------------------------------- timeline
def test_timeline_png_and_svg_are_written(files, tmp_path):
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    r = run("plot", "timeline", files["ring"], "--out", png)
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == str(png) and png.read_bytes()[:8] == PNG_MAGIC
    assert run("plot", "timeline", files["mesh"], "--ranks", "0-1", "--out", svg).exit_code == 0
    assert b"<svg" in svg.read_bytes()[:1000]


def test_timeline_rows_and_predicted_times(files):
    d = timeline_data(str(files["ring"]))
    assert d.rows == [(r, s) for r in range(4) for s in ("compute", "kv", "dkv")]
    p = d.panels[0]
    assert len(d.panels) == 1 and p.label == "predicted"
    assert p.makespan_s == pytest.approx(p.end_s.max()) and len(p.pass_start_s) == 1   # fwd+bwd: one barrier
    assert (p.end_s >= p.start_s).all() and p.row.max() == len(d.rows) - 1
    d2 = timeline_data(str(files["ring"]), ranks="1,3")
    assert {r for r, _ in d2.rows} == {1, 3} and "ranks 1, 3 of 4" in d2.title


def test_timeline_with_a_measurement_is_drawn_beside_the_prediction(files, tmp_path):
    meas = fake_measurement(files["ring"], tmp_path / "m.json")
    d = timeline_data(str(files["ring"]), str(meas))
    pred, got = d.panels
    assert got.label == "measured" and got.makespan_s == pytest.approx(1.25 * pred.makespan_s)
    np.testing.assert_allclose(got.start_s, 1.25 * pred.start_s, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got.end_s, 1.25 * pred.end_s, rtol=1e-9, atol=1e-12)
    out = tmp_path / "tm.png"
    r = run("plot", "timeline", files["ring"], meas, "--out", out)
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_a_measurement_with_foreign_op_ids_is_refused(files, tmp_path):
    meas = fake_measurement(files["ring"], tmp_path / "m.json")
    doc = json.loads(meas.read_text())
    doc["ranks"][1]["ops"][0]["id"] = 99999
    meas.write_text(json.dumps(doc))
    out = tmp_path / "x.png"
    one_line_error(run("plot", "timeline", files["ring"], meas, "--out", out), "op 99999")
    assert not out.exists()
    other = fake_measurement(files["mesh"], tmp_path / "other.json")
    one_line_error(run("plot", "timeline", files["ring"], other, "--out", out), "another schedule")
    assert not out.exists()


def test_rank_selection():
    assert parse_ranks(None, 64) == (list(range(16)), True)
    assert parse_ranks(None, 8) == (list(range(8)), False)
    assert parse_ranks("0-2,5", 8) == ([0, 1, 2, 5], True)


# ---------------------------------------------------------------------------------------------------- matrix
def test_ring_owner_is_the_query_rows_home_and_causal_skips_the_upper_triangle(files, tmp_path):
    from meshplan.plan.json.io import read_schedule
    owner = assignment_grid(read_schedule(files["ring"]))
    i, j = np.indices((4, 4))
    np.testing.assert_array_equal(owner, np.where(j <= i, i, -1))
    out = tmp_path / "ring.png"
    assert run("plot", "matrix", files["ring"], "--out", out).exit_code == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_mesh_tile_owner(files, tmp_path):
    """Tile 2x2 on 4 ranks: rank 2·(i // 2) + j mod 2 computes block (i, j); the mask skips j > i."""
    from meshplan.plan.json.io import read_schedule
    sched = read_schedule(files["mesh"])
    assert sched.knobs["tile"] == "2x2"
    np.testing.assert_array_equal(assignment_grid(sched), [[0, -1, -1, -1], [0, 1, -1, -1], [2, 3, 2, -1],
                                                           [2, 3, 2, 3]])
    out = tmp_path / "mesh.svg"
    assert run("plot", "matrix", files["mesh"], "--out", out).exit_code == 0
    assert b"<svg" in out.read_bytes()[:1000]


def test_usp_blocks_of_multi_chunk_ops_and_head_zero(files):
    """USP (U = 2): ranks 0 and 2 hold head 0; each computes its two query chunks against all KV chunks."""
    from meshplan.plan.json.io import read_schedule
    i, j = np.indices((4, 4))
    expected = np.where(j <= i, np.where(i < 2, 0, 2), -1)
    np.testing.assert_array_equal(assignment_grid(read_schedule(files["usp"])), expected)


def test_matrix_by_algorithm_name(tmp_path):
    out = tmp_path / "m.png"
    r = run("plot", "matrix", "--algo", "ring", "--gpus", 2, *SMALL, "--out", out)
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC


# ---------------------------------------------------------------------------------------------------- scatter
ROWS = [{"label": "a", "algorithm": "ring", "predicted_s": 1.1, "measured_s": 1.0},
        {"label": "b", "algorithm": "ring", "predicted_s": 0.9, "measured_s": 1.0},
        {"label": "c", "algorithm": "mesh", "predicted_s": 2.0, "measured_s": 1.6}]


def test_scatter_mape_by_hand_json_and_csv(tmp_path):
    js, cs = tmp_path / "pairs.json", tmp_path / "pairs.csv"
    js.write_text(json.dumps(ROWS))
    cs.write_text("label,algorithm,predicted_s,measured_s\n" +
                  "".join(f"{r['label']},{r['algorithm']},{r['predicted_s']},{r['measured_s']}\n" for r in ROWS))
    assert mape_pct(read_pairs(js)) == pytest.approx((10 + 10 + 25) / 3)
    assert mape_pct(read_pairs(cs)) == pytest.approx(15.0)
    (tmp_path / "wrapped.json").write_text(json.dumps({"rows": ROWS}))
    assert len(read_pairs(tmp_path / "wrapped.json")) == 3
    out = tmp_path / "s.png"
    r = run("plot", "scatter", cs, "--out", out)
    assert r.exit_code == 0, r.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_scatter_missing_field_names_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([ROWS[0], {k: v for k, v in ROWS[1].items() if k != "measured_s"}]))
    out = tmp_path / "s.png"
    one_line_error(run("plot", "scatter", bad, "--out", out), "measured_s", "row 1")
    assert not out.exists()
    extra = tmp_path / "extra.csv"
    extra.write_text("label,algorithm,predicted_s,measured_s,oops\na,ring,1,1,2\n")
    one_line_error(run("plot", "scatter", extra, "--out", out), "oops")
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------- scaling
def test_scaling_data_skips_what_cannot_run(tmp_path):
    from meshplan.model.workload import resolve
    w = resolve(seq_len="4K", heads=2, kv_heads=2, head_dim=16, layout="contiguous", passes="fwd")
    d = scaling_data("cpu-local", [2, 4], ["ring", "ulysses"], w)
    assert d.gpus == {"ring": [2, 4], "ulysses": [2]} and d.skipped_at == {"ulysses": [4]}
    kv_chunk = [2 * (4096 // n) * 2 * 16 * 2 for n in (2, 4)]      # 2·c·Hkv·D·β bytes
    assert d.recv_bytes["ring"] == [(n - 1) * b for n, b in zip((2, 4), kv_chunk)]     # (N − 1)·KVc, forward
    out = tmp_path / "scale.svg"
    r = run("plot", "scaling", "--topo", "cpu-local", "--gpus", "2,4", "--algos", "ring,ulysses", "--seq-len", "4K",
            "--heads", 2, "--kv-heads", 2, "--head-dim", 16, "--pass", "fwd", "--out", out)
    assert r.exit_code == 0, r.stderr
    assert "skipped: ulysses at 4 GPUs" in r.stderr and b"<svg" in out.read_bytes()[:1000]


# ---------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("args,needles", [
    (["timeline", "{ring}", "--out", "{dir}/t.pdf"], ["--out", ".png or .svg"]),
    (["matrix", "{ring}", "--out", "{dir}/m.jpg"], ["--out"]),
    (["timeline", "{dir}/missing.json", "--out", "{dir}/t.png"], ["missing.json"]),
    (["timeline", "{ring}", "--ranks", "0-9", "--out", "{dir}/t.png"], ["--ranks", "0-3"]),
    (["scatter", "{dir}/none.json", "--out", "{dir}/s.png"], ["none.json"]),
    (["scaling", "--topo", "cpu-local", "--algos", "nope", "--gpus", "2", "--out", "{dir}/s.png"], ["--algos", "nope"]),
    (["matrix", "--out", "{dir}/m.png"], ["--algo"]),
])
def test_bad_input_is_one_line_and_writes_nothing(files, tmp_path, args, needles):
    fmt = {"ring": files["ring"], "dir": tmp_path}
    args = [a.format(**fmt) for a in args]
    one_line_error(run("plot", *args), *needles)
    assert not any(p.suffix in (".png", ".svg", ".pdf", ".jpg") for p in tmp_path.iterdir())
