"""search as a library call: a typed request in, a typed report out, progress as it goes; the CLI prints the same."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from meshplan.algorithms.base import BuildCache
from meshplan.cli.app import app
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search import run_search
from meshplan.search.pipeline import SearchRequest, run_pipeline


def test_the_pipeline_reports_what_the_cli_prints(tmp_path):
    topo = Topology.load("h100x16", gpus=16)
    calls = []
    request = SearchRequest(resolve(seq_len="64K"), topo, 16, write=1, out_dir=str(tmp_path / "lib"))
    report = run_pipeline(request, lambda done, total, label: calls.append((done, total, label)))
    best = report.best
    assert best.model_level == "simulated"
    assert best.predicted.makespan_s == min(c.predicted.makespan_s for c in report.result.candidates
                                            if c.model_level == "simulated" and not c.forward_only)
    assert calls and any(total is not None and done < total for done, total, _ in calls)
    assert any("writing" in label for *_, label in calls)
    assert len(list((tmp_path / "lib").iterdir())) == 1
    out = CliRunner().invoke(app, ["search", "--gpus", "16", "--topo", "h100x16", "--seq-len", "64K", "--json",
                                   "--out", str(tmp_path / "cli")])
    assert out.exit_code == 0, out.output
    cli = json.loads(out.stdout)
    lib = report.json()
    assert [(c["algorithm"], c["layout"], c["knobs"]) for c in cli["candidates"]] == \
        [(c["algorithm"], c["layout"], c["knobs"]) for c in lib["candidates"]]
    assert cli["candidates"][0]["predicted"] == lib["candidates"][0]["predicted"]
    assert cli["frameworks"] == lib["frameworks"]


def test_prediction_json_is_the_contracts_shape():
    topo = Topology.load("h100x16", gpus=8)
    result = run_search(resolve(seq_len="32K", passes="fwd+bwd"), topo, 8, algos=["ring"])
    pred = result.candidates[0].predicted
    body = pred.json()
    assert body["makespan_s"] == pred.makespan_s == body["total"]["makespan_s"]
    assert body["fwd"]["makespan_s"] + body["bwd"]["makespan_s"] == \
        __import__("pytest").approx(pred.makespan_s)
    assert not any(k.startswith("_") for k in body) and all(not k.startswith("_") for k in body["fwd"])
    json.dumps(body)                                    # plain floats only


def test_mesh_builds_are_shared_within_a_run_and_dropped_with_it():
    """Plans whose ops are the same share one build through the run's cache (each a copy with its own device map
    and knobs); a plan made outside a run builds alone; nothing is global."""
    from meshplan import algorithms
    from meshplan.search.candidate import make_candidate

    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len="64K")
    builds = BuildCache()
    a, b = (make_candidate("mesh", w, topo, 16, {"tile": "4x4", "mapping": m}, None, builds)
            for m in ("row-major", "row-major"))
    mesh = algorithms.get("mesh")
    sa, sb = mesh.schedule(a.plan, topo), mesh.schedule(b.plan, topo)
    assert a.plan is not b.plan and sa is not sb and sa.ops is sb.ops
    alone = make_candidate("mesh", w, topo, 16, {"tile": "4x4", "mapping": "row-major"})
    assert mesh.schedule(alone.plan, topo).ops is not sb.ops            # no cache: a build of its own
    builds.clear()
    assert not builds._built
    assert not hasattr(algorithms.get("mesh"), "forget_builds")
