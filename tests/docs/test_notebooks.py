"""The notebooks run end to end on small settings (``MESHPLAN_NB_SMALL=1``) and say what the library says.

Each notebook is executed with nbclient in a temporary working directory (nothing lands in the repository);
no cell may error, and its last cell prints one ``RESULT {json}`` line that is checked against a reference:
the library's own numbers (CHARM+ reproduction), a closed form (Ring's bytes), or the executor's contract
(positive measured makespans, numerics passed). The ``python3`` kernel is ipykernel's native spec, which
jupyter_client finds for the running interpreter even where no kernelspec is installed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy      # every notebook end to end: `pytest -m heavy`, and CI


nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def execute(name: str, tmp_path: Path, monkeypatch) -> dict:
    """Run notebook ``name`` with small settings; returns its RESULT dict."""
    monkeypatch.setenv("MESHPLAN_NB_SMALL", "1")          # the kernel inherits this process's environment
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()                                      # raises CellExecutionError on the first failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    assert errors == []
    lines = [line for o in outputs if o.output_type == "stream" for line in o.text.splitlines()
             if line.startswith("RESULT ")]
    assert len(lines) == 1, f"{name} printed {len(lines)} RESULT lines"
    return json.loads(lines[0].removeprefix("RESULT "))


def test_every_notebook_is_covered():
    assert ALL == ["charm_reproduction.ipynb", "cpu_predicted_vs_measured.ipynb", "mesh_vs_ring_scaling.ipynb"]


@pytest.mark.timeout(600)
def test_cpu_predicted_vs_measured(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    r = execute("cpu_predicted_vs_measured.ipynb", tmp_path, monkeypatch)
    assert r["runs"] >= 1 and len(r["measured_makespan_s"]) == r["runs"]
    assert all(t > 0 for t in r["measured_makespan_s"].values())
    assert all(c > 0 for c in r["ccr_measured"].values()) and all(c > 0 for c in r["ccr_predicted"].values())
    assert r["numerics_checked"] >= 1 and r["numerics_passed"] is True
    assert list(tmp_path.iterdir()) == []                 # schedules and measurements went to a temp dir


@pytest.mark.timeout(600)
def test_charm_reproduction(tmp_path, monkeypatch):
    from meshplan.truth.reproduce import reproduce_ablation, reproduce_h100

    r = execute("charm_reproduction.ipynb", tmp_path, monkeypatch)
    ref = reproduce_h100()["summary"]
    assert r["fit"] is False
    for method in ("ring", "charm", "tasp"):
        assert r["mape_pct"][method] == pytest.approx(ref[method]["mape_pct"], abs=0.1)
        assert r["max_abs_error_pct"][method] == pytest.approx(ref[method]["max_abs_error_pct"], abs=0.1)
    abl = reproduce_ablation()
    assert (r["ablation_directions_right"], r["ablation_directions_total"]) == \
        (abl["directions_right"], abl["directions_total"])
    assert r["tasp_cross_chunks_per_gpu"] == pytest.approx(15 / 8, rel=1e-6)      # node-aware: 15 pieces of KV/8
    assert r["tasp_flat_cross_chunks_per_gpu"] == pytest.approx(8.0, rel=1e-6)    # flat: 8 of 15 chunks cross


@pytest.mark.timeout(600)
def test_mesh_vs_ring_scaling(tmp_path, monkeypatch):
    r = execute("mesh_vs_ring_scaling.ipynb", tmp_path, monkeypatch)
    s, kv_heads, head_dim, elem_bytes = 128 * 1024, 8, 128, 2          # llama3-8b, 128K tokens, bf16
    assert r["seq_len"] == s and r["gpus"] == [8, 16, 32, 64] and r["levels"] == ["simulated"]
    for n, got in zip(r["gpus"], r["ring_fwd_bytes_per_gpu"]):
        assert got == (n - 1) * 2 * (s // n) * kv_heads * head_dim * elem_bytes   # N−1 K,V chunks of S/N tokens
    assert r["makespan_ms"]["mesh"][-1] < r["makespan_ms"]["ring"][-1]
    assert r["recv_bytes_per_gpu"]["mesh"][-1] < r["recv_bytes_per_gpu"]["ring"][-1]


def test_the_runner_lists_every_notebook():
    """``notebooks/run.py`` (the README's way to run them) sees every notebook, and refuses an unknown name."""
    import subprocess
    import sys
    script = NOTEBOOKS / "run.py"
    listed = subprocess.run([sys.executable, script, "--list"], capture_output=True, text=True, check=True)
    assert listed.stdout.split() == ALL
    bad = subprocess.run([sys.executable, script, "nope.ipynb"], capture_output=True, text=True)
    assert bad.returncode == 2 and "use one of" in bad.stderr
