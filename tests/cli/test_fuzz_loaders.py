"""Fuzzed loaders (issue 22, part 7): arbitrary mutations of schedule JSON, topology YAML, calibration files,
nccl-tests output and mask specs give exit 2 with one line — never a traceback, a hang (each example has a
deadline) or a half-written output file."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from meshplan.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
TORCH = importlib.util.find_spec("torch") is not None
DATA = Path(__file__).resolve().parents[1] / "data"
EXAMPLES = int(os.environ.get("MESHPLAN_FUZZ_EXAMPLES", 60))     # a longer hunt: MESHPLAN_FUZZ_EXAMPLES=2000
FUZZ = settings(max_examples=EXAMPLES, deadline=5000, derandomize=EXAMPLES <= 60,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def clean(result, allowed=(0, 2)) -> None:
    """Exit in ``allowed``, no escaped exception, and a refusal is one line on stderr."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in allowed, (result.exit_code, result.stdout[-300:], result.stderr[-300:])
    if result.exit_code == 2:
        err = result.stderr.strip()
        assert err.startswith("error:") and "\n" not in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------------- mutations of text
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True),
                    st.text(max_size=12), st.just([]), st.just({}))


def _paths(node, prefix=()):
    """Every (path, value) of a JSON-like tree."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node[:6]):             # the first few of long lists
            yield from _paths(v, prefix + (i,))


def _mutate(doc, data) -> object:
    """One structural mutation: replace a value, delete a key, or duplicate a list item."""
    doc = json.loads(json.dumps(doc))
    paths = [p for p, _ in _paths(doc) if p]
    path = data.draw(st.sampled_from(paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    how = data.draw(st.sampled_from(["replace", "delete", "duplicate"]))
    if how == "replace":
        parent[path[-1]] = data.draw(scalars)
    elif how == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif isinstance(parent, list):
        parent.insert(path[-1], parent[path[-1]])
    else:
        parent[path[-1]] = data.draw(scalars)
    return doc


def _corrupt(text: str, data) -> str:
    """Byte-level damage: truncate, or splice random characters in."""
    if data.draw(st.booleans()):
        return text[:data.draw(st.integers(0, len(text)))]
    at = data.draw(st.integers(0, len(text)))
    return text[:at] + data.draw(st.text(max_size=20)) + text[at:]


# ------------------------------------------------------------------------------------------------- schedules
@pytest.fixture(scope="module")
def schedule(tmp_path_factory):
    path = tmp_path_factory.mktemp("fz") / "s.json"
    r = invoke("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 32, "--heads", 2,
               "--kv-heads", 1, "--head-dim", 8, "--mask", "docs:10+2,20", "--doc-layout", "packed", "--out", path)
    assert r.exit_code == 0, r.stderr
    return json.loads(path.read_text())


@pytest.mark.heavy
@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_mutated_schedules_are_valid_invalid_or_refused(schedule, tmp_path, data):
    path = tmp_path / "m.json"
    if data.draw(st.booleans()):
        path.write_text(json.dumps(_mutate(schedule, data)))
    else:
        path.write_text(_corrupt(json.dumps(schedule), data))
    valid = invoke("validate", path)
    clean(valid, (0, 1, 2))
    if valid.exit_code and TORCH:                # refused before any rank starts, with one line
        m = tmp_path / "m.json"
        m.unlink(missing_ok=True)
        r = invoke("run", path, "--out", m)
        clean(r, (2,))
        assert not m.exists()
    out = tmp_path / "trace.json"
    out.unlink(missing_ok=True)                  # examples share the folder
    r = invoke("simulate", path, "--trace", out)
    clean(r)
    assert r.exit_code == 0 or not out.exists()


# ------------------------------------------------------------------------------------- topologies, calibrations
@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_mutated_topologies_load_or_are_refused(tmp_path, data):
    import yaml
    src = yaml.safe_load((DATA / "unit-nvswitch.yaml").read_text())
    path = tmp_path / "t.yaml"
    if data.draw(st.booleans()):
        path.write_text(yaml.safe_dump(_mutate(src, data)))
    else:
        path.write_text(_corrupt((DATA / "unit-nvswitch.yaml").read_text(), data))
    clean(invoke("topo", "show", path))


@pytest.fixture(scope="module")
def calibration_home(tmp_path_factory):
    """A copy of cpu-local with its calibration beside it (so the calibration file can be mutated)."""
    home = tmp_path_factory.mktemp("cal")
    shutil.copy(ROOT / "meshplan" / "topologies" / "cpu-local.yaml", home / "cpu.yaml")
    return home


@pytest.mark.heavy
@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data())
def test_mutated_calibrations_load_or_are_refused(calibration_home, data):
    import yaml
    src_path = ROOT / "meshplan" / "topologies" / "calibration" / "cpu-local.yaml"
    src = yaml.safe_load(src_path.read_text())
    (calibration_home / "calibration").mkdir(exist_ok=True)
    path = calibration_home / "calibration" / "cpu-local.yaml"
    if data.draw(st.booleans()):
        path.write_text(yaml.safe_dump(_mutate(src, data)))
    else:
        path.write_text(_corrupt(src_path.read_text(), data))
    clean(invoke("topo", "show", calibration_home / "cpu.yaml"))
    before = path.read_bytes()
    r = invoke("calibrate", "--refit", "--out", path)
    clean(r)
    if r.exit_code != 0:
        assert path.read_bytes() == before                      # a refused refit writes nothing


# ------------------------------------------------------------------------------------------------ nccl-tests
@pytest.mark.timeout(600)
@FUZZ
@given(data=st.data(), name=st.sampled_from(["sendrecv_perf-2x8.txt", "alltoall_perf-2x8.txt"]))
def test_mutated_nccl_tests_output_fits_or_is_refused(tmp_path, data, name):
    text = (DATA / "nccl_tests" / name).read_text()
    lines = text.splitlines(keepends=True)
    if data.draw(st.booleans()):
        i = data.draw(st.integers(0, len(lines) - 1))
        words = lines[i].split()
        if words:
            j = data.draw(st.integers(0, len(words) - 1))
            words[j] = data.draw(st.sampled_from(["nan", "-1", "1e308", "0", "x", "", "N/A", "99999999999"]))
            lines[i] = " ".join(words) + "\n"
        text = "".join(lines)
    else:
        text = _corrupt(text, data)
    src = tmp_path / name
    src.write_text(text)
    out = tmp_path / "cal.yaml"
    out.unlink(missing_ok=True)
    r = invoke("calibrate", "--topo", "h100x16", "--from-nccl-tests", src, "--out", out)
    clean(r)
    assert r.exit_code == 0 or not out.exists()


# ----------------------------------------------------------------------------------------------------- masks
mask_specs = st.one_of(
    st.text(max_size=30),
    st.builds(lambda k, a: f"{k}:{a}", st.sampled_from(["docs", "window", "cu_seqlens", "causal", "full", "doc"]),
              st.text(alphabet="0123456789,+-KMk. x", max_size=24)),
    st.builds(lambda xs: "docs:" + ",".join(xs), st.lists(st.sampled_from(["4", "8", "0", "-4", "4+4", "4+-1", "1K",
                                                                          "3+1", "", "+", "8+0"]), max_size=6)))


@pytest.mark.timeout(600)
@FUZZ
@given(spec=mask_specs)
def test_arbitrary_mask_specs_plan_or_are_refused(tmp_path, spec):
    out = tmp_path / "s.json"
    out.unlink(missing_ok=True)
    r = invoke("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 64, "--heads", 1,
               "--kv-heads", 1, "--head-dim", 8, "--pass", "fwd", f"--mask={spec}", "--out", out)
    clean(r)
    assert r.exit_code == 0 or not out.exists()
