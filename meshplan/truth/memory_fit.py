"""The memory model's fit (:mod:`meshplan.cost.memory`): its coefficients from ops run alone, and
``overhead_factor`` from one declared run (:data:`DECLARED_RUN`) planned here and run by the executor during
calibration; that run is not among those the model is judged on.
"""

from __future__ import annotations

import numpy as np

from meshplan import algorithms
from meshplan.core.units import round_sig
from meshplan.cost.memory import model_peak_bytes, op_workspace_bytes
from meshplan.model.memory_spec import MemorySpec, OpCoefficients
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload, resolve
from meshplan.plan.schedule import Schedule
from meshplan.search.candidate import make_candidate, predict

# the one end-to-end run calibration fits overhead_factor on (benchmarks/memory_cpu.py's runs differ from it)
DECLARED_RUN = {"algorithm": "mesh", "ranks": 4, "seq_len": 4096, "heads": 4, "head_dim": 64, "dtype": "bf16",
                "passes": "fwd+bwd"}


def declared_workload():
    """The Workload of :data:`DECLARED_RUN`."""
    d = DECLARED_RUN
    return resolve(seq_len=d["seq_len"], heads=d["heads"], kv_heads=d["heads"], head_dim=d["head_dim"],
                   dtype=d["dtype"], passes=d["passes"])


def declared_candidate():
    """:data:`DECLARED_RUN` planned and simulated on ``cpu-local`` (a :class:`meshplan.search.candidate.Candidate`)."""
    n = DECLARED_RUN["ranks"]
    return predict(DECLARED_RUN["algorithm"], declared_workload(), Topology.load("cpu-local", n), n, {})


def sample_schedules(cuda: bool, quick: bool) -> list[Schedule]:
    """The small 2-rank schedules whose compute ops ``meshplan calibrate`` runs alone for the memory samples
    (:func:`meshplan.executor.calibrate.memory.compute_samples`): Ring (its backward starts from O) and pass-Q (from
    D), per dtype and size, planned on ``cpu-local`` (the shapes are what matter, not the host)."""
    tokens = (256, 1024) if quick else (512, 1024, 2048)
    heads, head_dim = (16, 128) if cuda else (4, 64)
    topo = Topology.load("cpu-local", 2)
    out = []
    for dtype in ("bf16", "fp32"):
        for algo in ("ring", "pass-q"):
            for t in tokens:
                w = Workload(batch=1, seq_len=2 * t, n_heads=heads, n_kv_heads=heads, head_dim=head_dim,
                             dtype=dtype)
                out.append(algorithms.get(algo).schedule(make_candidate(algo, w, topo, 2, {}).plan, topo))
    return out


def fit_overhead(spec: MemorySpec, measured_bytes: float) -> float:
    """``overhead_factor``: the declared run's measured memory over ``spec``'s peak for it without the factor (at
    least 1)."""
    cand = declared_candidate()
    plain = spec.model_copy(update={"overhead_factor": 1.0, "runtime_bytes": 0.0})
    ws, off = op_workspace_bytes(cand.schedule, plain), cand.sim.pass_offset
    peak = max(model_peak_bytes(cand.schedule, plain, p, cand.sim.start - off[p], cand.sim.end - off[p], ws)
               for p in cand.schedule.passes)
    return round_sig(max(1.0, (measured_bytes - spec.runtime_bytes) / peak))


def fit_memory(samples: list[dict], runtime_bytes: float = 0.0) -> MemorySpec:
    """The coefficients from ``raw.memory`` samples (:mod:`meshplan.executor.calibrate.memory`).

    Compute ops, per dtype: non-negative least squares of the rise on ``[1, fwd q elems, fwd kv elems, bwd q
    elems, bwd kv elems]`` (scipy's NNLS; one ``fixed_bytes`` for both passes). Merges and wire images: the
    median of rise / bytes. ``tolerance_pct``: the largest relative error of the fit on its compute samples.
    ``overhead_factor``: from the ``declared-run`` sample, where there is one (:func:`fit_overhead`).

    Raises:
        ValueError: no compute samples.
    """
    from scipy.optimize import nnls

    compute: dict[str, OpCoefficients] = {}
    worst = 0.0
    for dtype in sorted({s["dtype"] for s in samples if s["kind"] == "compute"}):
        rows = [s for s in samples if s["kind"] == "compute" and s["dtype"] == dtype]
        a = np.zeros((len(rows), 5))
        y = np.array([float(s["rise_bytes"]) for s in rows])
        for i, s in enumerate(rows):
            e = s["batch"] * s["heads"] * s["head_dim"]
            col = 1 if s["pass"] == "fwd" else 3
            a[i, 0], a[i, col], a[i, col + 1] = 1.0, e * s["s_q"], e * s["s_kv"]
        scale = np.maximum(y, 1.0)                          # relative residuals: small ops count as much
        x, _ = nnls(a / scale[:, None], y / scale)
        worst = max(worst, float(np.max(np.abs(a @ x - y) / scale)) * 100)
        compute[dtype] = OpCoefficients(fwd_q_bytes_per_elem=round_sig(x[1]), fwd_kv_bytes_per_elem=round_sig(x[2]),
                                        bwd_q_bytes_per_elem=round_sig(x[3]), bwd_kv_bytes_per_elem=round_sig(x[4]),
                                        fixed_bytes=round(float(x[0])))
    if not compute:
        raise ValueError("no compute-op memory samples")

    def ratio(kind: str) -> float:
        r = [s["rise_bytes"] / s["size_bytes"] for s in samples if s["kind"] == kind and s["size_bytes"]]
        return round_sig(float(np.median(r))) if r else 0.0

    spec = MemorySpec(source="meshplan calibrate: each executor op run alone, its memory rise measured "
                             "(meshplan.executor.calibrate.memory); NNLS fit",
                      compute=compute, merge_bytes_per_byte=ratio("merge"),
                      transfer_bytes_per_byte=ratio("transfer"), runtime_bytes=round(runtime_bytes),
                      tolerance_pct=round_sig(worst))
    runs = [s["rise_bytes"] for s in samples if s["kind"] == "declared-run"]
    if runs:
        spec = spec.model_copy(update={"overhead_factor": fit_overhead(spec, float(np.median(runs))),
                                       "source": spec.source + "; overhead_factor from the declared run"})
    return spec
