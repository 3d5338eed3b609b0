"""``meshplan calibrate --repeat N``: runs merged into one raw (a timing's median over the runs, samples pooled),
checked against the fit of the run the medians pick, and the flag's refusals."""

from __future__ import annotations

import json

import pytest
import yaml
from test_calibrate import facts, synthetic_raw
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.model.calibration_file import Raw, load_calibration
from meshplan.truth.calibration_fit import fit_calibration
from meshplan.truth.calibration_merge import merge_raws


def _run(scale: float) -> dict:
    """The synthetic raw with every timing of one-per-run measurements (kernels, matmuls, merges, transfers,
    core sharing) times ``scale``: a run that fell into a slow (> 1) or fast (< 1) spell of the host."""
    raw = synthetic_raw().model_dump(mode="json", by_alias=True)
    for key in ("gemm", "merges", "head_dim_kernels"):
        raw[key] = [[*row[:-1], row[-1] * scale] for row in raw[key]]
    for key in ("kernels", "p2p"):
        raw[key] = [row | {"time_s": row["time_s"] * scale} for row in raw[key]]
    raw["sharing"] = [[k, t * scale] for k, t in raw["sharing"]]
    return raw


def _fitted(calib) -> dict:
    body = calib.model_dump(mode="json")
    body.pop("raw")
    return body


def test_merged_runs_fit_as_the_median_run():
    """Three runs, one in a slow spell (x1.3) and one slightly fast (x0.97): every keyed timing's median is the
    x1 run's, so the merged raw fits to exactly that run's parameters; the slow run moves nothing."""
    runs = [_run(1.3), _run(1.0), _run(0.97)]
    merged = Raw.model_validate(merge_raws(runs))
    assert merged.repeats == 3
    assert _fitted(fit_calibration(merged, facts(), "cpu-local")) == \
        _fitted(fit_calibration(Raw.model_validate(runs[1]), facts(), "cpu-local"))
    one = synthetic_raw()
    assert len(merged.kernels) == len(one.kernels) and len(merged.p2p) == len(one.p2p)
    assert len(merged.overlap) == 3 * len(one.overlap) and len(merged.launch_s) == 3 * len(one.launch_s)
    # a single slow run alone would not fit so: the merge is what removed it
    assert _fitted(fit_calibration(Raw.model_validate(runs[0]), facts(), "cpu-local")) != _fitted(
        fit_calibration(merged, facts(), "cpu-local"))


def test_one_run_merges_to_itself():
    """One run is its own merge (core sharing's rows come back sorted within a rank count)."""
    raw = synthetic_raw().model_dump(mode="json", by_alias=True)
    merged, one = Raw.model_validate(merge_raws([raw])), synthetic_raw()
    assert merged.model_copy(update={"sharing": sorted(merged.sharing)}) == \
        one.model_copy(update={"sharing": sorted(one.sharing)})


def test_sharing_keeps_the_median_of_each_rank_position():
    """Per rank count, ranks sorted fastest first within a run, the median over runs of each position."""
    runs = [{"sharing": [(1, 1.0), (2, 1.1), (2, 1.4)]},
            {"sharing": [(1, 3.0), (2, 1.9), (2, 1.2)]},
            {"sharing": [(1, 2.0), (2, 1.0), (2, 1.3)]}]
    assert merge_raws(runs)["sharing"] == [(1, 2.0), (2, 1.1), (2, 1.4)]


def test_runs_of_another_dtype_or_link_are_refused():
    with pytest.raises(ValueError, match="raw.dtype"):
        merge_raws([{"dtype": "fp32"}, {"dtype": "bf16"}])
    with pytest.raises(ValueError, match="raw.link_class"):
        merge_raws([{"link_class": "loopback"}, {"link_class": None}])
    with pytest.raises(ValueError, match="no calibration runs"):
        merge_raws([])


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_repeat_runs_the_benchmarks_n_times_and_writes_the_merge(tmp_path, monkeypatch):
    """The CLI measures N times (here a stand-in for the benchmarks, so the test is exact and quick) and writes the
    fit of the merged raw; the file refits to itself."""
    import meshplan.executor.calibrate.bench as bench
    runs = iter([_run(1.0), _run(1.3), _run(0.97)])
    host = {"cpu": "test CPU", "isa": None, "cores": 2, "gpu": None, "torch": "0", "backend": "gloo",
            "threads_per_rank": 1, "load_1min": 0.1}
    busy = iter([0.01, 0.4, 0.02])
    monkeypatch.setattr(bench, "measure", lambda *a: (next(runs), host | {"others_busy_cores": next(busy)}))
    out = tmp_path / "rep.yaml"
    r = _cli("calibrate", "--repeat", 3, "--backend", "gloo", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    assert r.stderr.count("calibrate: run ") == 3
    calib = load_calibration(out)
    assert calib.raw.repeats == 3 and calib.device.others_busy_cores == 0.4     # the noisiest run is reported
    assert _fitted(calib) | {"device": None, "wall_s": None} == _fitted(
        fit_calibration(Raw.model_validate(_run(1.0)), facts(), "cpu-local")) | {"device": None, "wall_s": None}
    before = out.read_text()
    assert _cli("calibrate", "--refit", "--out", out).exit_code == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load(before)
    assert json.loads(r.stdout)["calibration"] == str(out) and json.loads(r.stdout)["repeats"] == 3


@pytest.mark.parametrize("args", [["--repeat", 0], ["--repeat", 2, "--refit"], ["--repeat", 2, "--memory-only"]])
def test_repeat_refusals_are_one_line(tmp_path, args):
    out = tmp_path / "c.yaml"
    r = _cli("calibrate", *args, "--out", out)
    assert r.exit_code == 2 and "--repeat" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()
