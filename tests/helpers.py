"""Helpers shared by tests in several folders (each test module imports what it needs from here)."""

from __future__ import annotations

import hashlib

import numpy as np
from typer.testing import CliRunner

from meshplan.algorithms import get
from meshplan.cli.app import app
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import RECV

runner = CliRunner()


def run(*args):
    """``meshplan ARGS`` through typer's runner (stdout and stderr apart)."""
    return runner.invoke(app, [str(a) for a in args])


def one_line_error(result, *needles):
    """The contract's refusal: exit 2, one ``error:`` line naming each of ``needles``, nothing on stdout."""
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    err = result.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error:") and "Traceback" not in err, err
    assert result.stdout == ""
    for n in needles:
        assert n in err, err


def reference_attention(q, k, v, do, scale, allowed):
    """Float64 attention and gradients, [B, H, S, D] (k, v already expanded to H heads)."""
    import torch

    q, k, v, do = (t.double() for t in (q, k, v, do))
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[..., None]).masked_fill(~allowed, 0.0)
    o = p @ v
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return o, lse, ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


def fake_measurement(schedule_path, out, scale: float = 1.25):
    """A Measurement JSON of ``schedule_path`` whose op times are the simulated ones times ``scale`` (no torch)."""
    from meshplan.cost.simulate import simulate
    from meshplan.model.topology import Topology
    from meshplan.plan.json.io import from_json, read_document
    from meshplan.plan.json.measurement import MeasurementJSON
    from meshplan.plan.schedule import PASS_NAMES

    doc, raw = read_document(schedule_path)
    sched = from_json(doc)
    sim = simulate(sched, Topology.load(sched.topology["name"], sched.topology["devices"]))
    off = np.array([sim.pass_offset[int(p)] for p in sched.ops.phase])
    start, end = (sim.start - off) * scale, (sim.end - off) * scale
    ids, ptr = [op.id for r in doc.ranks for op in r.ops], sched.rank_ptr

    def spread(t):
        return {"min_s": t, "p25_s": t, "p75_s": t, "max_s": t}

    passes = {PASS_NAMES[p]: {"makespan_s": t * scale, "spread": spread(t * scale)}
              for p, t in sim.pass_makespan.items()}
    total = sum(sim.pass_makespan.values()) * scale
    ranks = [{"rank": r, "peak_memory_bytes": 0,
              "ops": [{"id": ids[i], "start_s": float(start[i]), "end_s": float(end[i])}
                      for i in range(ptr[r], ptr[r + 1])]} for r in range(sched.n_ranks)]
    body = {"schedule": hashlib.sha256(raw).hexdigest(), "schedule_path": str(schedule_path),
            "algorithm": sched.algorithm, "env": {"backend": "gloo"}, "settings": {},
            "numerics": {"checked": False, "passed": None}, "ranks": ranks, "passes": passes, "makespan_s": total,
            "makespan_spread": spread(total), "peak_memory_bytes": 0, "peak_memory_kind": "live-tensors", "wall_s": 1.0}
    out.write_text(MeasurementJSON.model_validate(body).model_dump_json())
    return out


def build(name, n, passes="fwd+bwd", topo="h100x32", **kw):
    """(schedule, workload) of method ``name`` on ``n`` ranks of ``topo``, 64 tokens per rank by default."""
    knobs = kw.pop("knobs", {})
    w = resolve(passes=passes, **({"seq_len": 64 * n} | kw))
    t = Topology.load(topo, gpus=n)
    alg = get(name)
    return alg.schedule(alg.plan(w, t, n, alg.normalize(knobs)), t), w


def recv_bytes(sched, phase):
    """[n_ranks] bytes each rank receives in pass ``phase``."""
    o = sched.ops
    sel = (o.kind == RECV) & (o.phase == phase)
    return np.bincount(o.rank[sel], weights=o.size_bytes[sel], minlength=sched.n_ranks)


def sizes(w, n, dkv_bytes=4):
    """Bytes of one rank's (KV, Q, LSE, dK/dV) chunk of workload ``w`` on ``n`` ranks."""
    c = w.seq_len // n
    kvc = 2 * w.batch * c * w.n_kv_heads * w.head_dim * w.elem_bytes
    qc = w.batch * c * w.n_heads * w.head_dim * w.elem_bytes
    lc = 4 * w.batch * c * w.n_heads
    return kvc, qc, lc, kvc * dkv_bytes // w.elem_bytes
