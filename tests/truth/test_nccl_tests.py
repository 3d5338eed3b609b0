"""``meshplan calibrate --from-nccl-tests``: the fit recovers the alpha and bandwidth synthetic nccl-tests output
was made with (tests/data/nccl_tests, make_samples.py), a topology takes the written file, bad input is refused
with one line and nothing written."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.core.errors import UserError
from meshplan.model.calibration_file import load_calibration
from meshplan.model.topology import Topology
from meshplan.truth import nccl_tests

DIR = Path(__file__).resolve().parents[1] / "data" / "nccl_tests"
BW_REL, ALPHA_REL = 0.02, 0.10          # the stated tolerances: bandwidth 2 %, alpha 10 % (noise is ±0.5 %)


def _samples():
    spec = importlib.util.spec_from_file_location("make_samples", DIR / "make_samples.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MS = _samples()
FILES = sorted(MS.SAMPLES)


def _cli(*args):
    return CliRunner().invoke(app, ["calibrate", *[str(a) for a in args]])


@pytest.mark.parametrize("name", FILES)
def test_shipped_samples_are_what_the_script_writes(name):
    assert (DIR / name).read_text() == MS.render(name)


@pytest.mark.parametrize("name", FILES)
def test_fit_recovers_alpha_and_bandwidth(name):
    test, hosts, g, alpha, rate = MS.SAMPLES[name]
    run = nccl_tests.read(DIR / name)
    assert (run.collective, run.ranks, run.hosts, run.gpu) == (test, hosts * g, hosts, MS.GPU)
    f = nccl_tests.fit_run(run)
    # the busbw the generator's physics implies: bytes per rank on nccl-tests' definition over the generator's
    size = 1 << 30
    busbw = rate * size * nccl_tests.busbw_factor(test, hosts * g) / MS.wire(test, hosts, g, size)
    assert f.alpha_s == pytest.approx(alpha, rel=ALPHA_REL)
    assert f.busbw_bytes_per_s == pytest.approx(busbw, rel=BW_REL)
    if hosts > 1:                       # what a net class takes: one flow (sendrecv) or the node's outbound rate
        assert nccl_tests.cross_node_rate(f) == pytest.approx(rate, rel=BW_REL)
    assert f.max_error < 0.02


def test_busbw_definitions():
    assert nccl_tests.busbw_factor("sendrecv", 8) == 1.0
    assert nccl_tests.busbw_factor("all_gather", 8) == nccl_tests.busbw_factor("alltoall", 8) == 7 / 8


def test_cli_writes_a_calibration_a_topology_takes(tmp_path):
    out = tmp_path / "nccl.yaml"
    r = _cli("--topo", "h100x16", "--from-nccl-tests", ",".join(str(DIR / n) for n in FILES[:3]),
             *[x for n in FILES[3:] for x in ("--from-nccl-tests", DIR / n)], "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    body = json.loads(r.stdout)
    assert len(body["files"]) == 6 and {f["link_class"] for f in body["files"]} == {"nvlink", "net"}
    calib = load_calibration(out)
    assert "sendrecv_perf-1x8.txt" in calib.nvlink.source and "all_gather_perf-2x8.txt" in calib.net.source
    assert yaml.safe_load(out.read_text())["kind"] == "nccl-tests"

    source = Topology.load("h100x16").source
    (tmp_path / "topo.yaml").write_text(Path(source).read_text() + "calibration: nccl.yaml\n")
    topo = Topology.load(str(tmp_path / "topo.yaml"))
    spec = MS.SAMPLES
    lat, bw = topo.pair_stats(np.array([0, 0]), np.array([1, 8]))
    # in a node: sendrecv's alpha, the median port rate of the three tests
    assert lat[0] == pytest.approx(spec["sendrecv_perf-1x8.txt"][3], rel=ALPHA_REL)
    assert bw[0] == pytest.approx(np.median([spec[n][4] for n in FILES if n.endswith("1x8.txt")]), rel=BW_REL)
    # across nodes: sendrecv's alpha and its one flow; the node aggregate from the two collectives
    assert lat[1] == pytest.approx(spec["sendrecv_perf-2x8.txt"][3], rel=ALPHA_REL)
    assert bw[1] == pytest.approx(spec["sendrecv_perf-2x8.txt"][4], rel=BW_REL)
    aggregate = np.median([spec[n][4] for n in ("all_gather_perf-2x8.txt", "alltoall_perf-2x8.txt")])
    assert topo.spec.node.nics.node_aggregate_GBps * 1e9 == pytest.approx(aggregate, rel=BW_REL)
    assert topo.calibration is None and topo.kernel is not None     # the topology keeps its kernel table


def test_needs_no_torch(tmp_path):
    """The whole path runs with torch made unimportable."""
    out = tmp_path / "c.yaml"
    code = ("import sys; sys.modules['torch'] = None; from meshplan.cli.app import main; "
            f"main(['calibrate', '--topo', 'h100x16', '--from-nccl-tests', {str(DIR / FILES[0])!r}, '--out', "
            f"{str(out)!r}, '--json'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert load_calibration(out).nvlink is not None


def test_prefix_names_the_class(tmp_path):
    out = tmp_path / "c.yaml"
    r = _cli("--topo", "h100x16", "--from-nccl-tests", f"intra:{DIR / FILES[3]}", "--out", out, "--json")
    assert r.exit_code == 2 and "measured the network" in r.stderr   # 16 ranks on 2 hosts: more than a node
    assert not out.exists()
    r = _cli("--topo", "h100x16", "--from-nccl-tests", f"net:{DIR / 'sendrecv_perf-1x8.txt'}", "--out", out)
    assert r.exit_code == 2 and "one host" in r.stderr


def _variant(tmp_path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _bad_inputs(tmp_path) -> list[tuple[Path, str]]:
    sr = MS.render("sendrecv_perf-1x8.txt")
    lines = sr.splitlines(keepends=True)
    row = next(k for k, x in enumerate(lines) if x.strip().startswith("1048576 "))
    cut_row = lines[:row] + [" ".join(lines[row].split()[:5]) + "\n"] + lines[row + 1:]
    return [
        (_variant(tmp_path, "sendrecv.csv", "size,count,time_us,algbw,busbw\n8,2,8.1,0.0,0.0\n"),
         "expected the output of nccl-tests' sendrecv_perf, alltoall_perf or all_gather_perf"),
        (_variant(tmp_path, "reduce_scatter_perf.txt", sr.replace("sendrecv_perf", "reduce_scatter_perf")),
         "reduce_scatter_perf output is not supported; expected"),
        (_variant(tmp_path, "sendrecv_cut.txt", "".join(lines[:row]) + lines[row][:30]),
         "no '# Avg bus bandwidth' line"),
        (_variant(tmp_path, "sendrecv_edited.txt", "".join(cut_row)), "5 fields, expected 13 (size count type"),
        (_variant(tmp_path, "run.txt", sr.replace("sendrecv_perf", "all_gather_perf")),   # mislabelled
         "busbw / algbw is 1.000 (first off: the row of 8192 B), but all_gather over the 8 ranks listed gives 0.875"),
        (_variant(tmp_path, "sendrecv_norank.txt", "".join(x for x in lines if "Rank" not in x)), "'# Rank R Group"),
        (_variant(tmp_path, "sendrecv_small.txt", "".join(lines[:row] + lines[-4:])),
         "cannot fit alpha and bandwidth"),
    ]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "never.yaml"
    for path, expected in _bad_inputs(tmp_path):
        r = _cli("--topo", "h100x16", "--from-nccl-tests", path, "--out", out)
        assert r.exit_code == 2, (path.name, r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert expected in r.stderr and path.name in r.stderr, r.stderr
        assert not out.exists()


@pytest.mark.parametrize("args, expected", [
    (["--from-nccl-tests", DIR / FILES[0]], "--topo: cpu-local is CPU ranks over loopback"),   # the default topo
    (["--topo", "l20x8", "--from-nccl-tests", DIR / "sendrecv_perf-1x8.txt"], "fabric, no NVSwitch ports"),
    (["--topo", DIR.parent / "unit-nvswitch.yaml", "--from-nccl-tests", DIR / "sendrecv_perf-2x8.txt"], "has no NICs"),
    (["--topo", "h100x16", "--from-nccl-tests", f"foo:{DIR / FILES[0]}"], "'foo' is not a link class"),
    (["--topo", "h100x16", "--from-nccl-tests", DIR / "missing.txt"], "cannot read"),
    (["--topo", "h100x16", "--from-nccl-tests", DIR / "sendrecv_perf-2x8.txt"], "below h100x16's p2p_overhead_us"),
])
def test_refusals(tmp_path, args, expected):
    out = tmp_path / "never.yaml"
    r = _cli(*args, "--out", out)
    assert r.exit_code == 2 and expected in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()


def test_parse_errors_are_user_errors():
    with pytest.raises(UserError, match="not nccl-tests output"):
        nccl_tests.parse("# just a comment\n1 2 3\n", "x_sendrecv_perf.txt")
