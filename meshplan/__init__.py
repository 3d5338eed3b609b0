"""meshplan: plan, simulate and run distributed attention (context parallelism) for long-context LLMs.

The pipeline (docs/architecture.md): Topology + Workload -> AttnMatrix -> Plan -> Schedule -> Timeline/Metrics,
and Schedule JSON -> executor -> Measurement -> Comparison; the packages follow it (core, model, plan, cost,
algorithms, search, truth, show, cli; the executor at the edge).

The library calls users make, importable from here (each loaded on first use, so ``import meshplan`` imports nothing
but the standard library)::

    import meshplan
    topo = meshplan.Topology.load("h100x32", gpus=256)
    workload = meshplan.resolve(model="llama3-8b", seq_len="1M")
    report = meshplan.run_pipeline(meshplan.SearchRequest(workload, topo, gpus=256))
    best = report.best                      # a Candidate: algorithm, knobs, plan, schedule, typed prediction
    best.predicted.makespan_s               # seconds, forward + backward; report.json() is search --json's body
    meshplan.write_schedule(best.schedule, "best.json")

A packed batch from its document boundaries (``cu_seqlens``), planned with doc-place beside per-document Ring and
the best fixed method (``meshplan plan-batch``)::

    got = meshplan.plan_batch([0, 1000, 3000, 8192], topo, 8, meshplan.resolve(model="llama3-8b", seq_len=8192))
    got.best.predicted.makespan_s, got.plan_s       # the fastest plan's time; seconds spent planning doc-place

A request searches every token layout unless ``layout_pinned=True`` (then only ``workload.layout``, as
``meshplan search --layout`` does); see :class:`meshplan.search.pipeline.SearchRequest` for the rest.
"""

__version__ = "0.1.0"

#: name -> the module that defines it
_FACADE = {
    "Topology": "meshplan.model.topology",
    "Workload": "meshplan.model.workload",
    "resolve": "meshplan.model.workload",
    "predict": "meshplan.search.candidate",
    "run_search": "meshplan.search",
    "SearchRequest": "meshplan.search.pipeline",
    "SearchReport": "meshplan.search.pipeline",
    "run_pipeline": "meshplan.search.pipeline",
    "plan_batch": "meshplan.search.batch",
    "simulate": "meshplan.cost.simulate",
    "verify": "meshplan.plan.verify",
    "read_schedule": "meshplan.plan.json.io",
    "write_schedule": "meshplan.plan.json.io",
}
__all__ = ["__version__", *_FACADE]


def __getattr__(name: str):
    if name in _FACADE:
        import importlib

        return getattr(importlib.import_module(_FACADE[name]), name)
    raise AttributeError(f"module 'meshplan' has no attribute {name!r}")
