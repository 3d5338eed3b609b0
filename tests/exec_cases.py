"""Helpers for the executor tests: schedule files for small CPU cases, and batched runs per rank count."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.algorithms import get
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json.io import write_schedule


@dataclass
class Case:
    """One run: an algorithm on ``n`` CPU ranks with its knobs and workload, and how to run it."""

    name: str
    algo: str
    n: int
    knobs: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    run: dict = field(default_factory=dict)          # RunConfig fields (serialize, inputs_path, ...)
    edit: object = None                              # a function that edits the schedule JSON (negative controls)

    def write(self, folder: Path) -> Path:
        """Plan, schedule and write the case's schedule file (edited if ``edit`` is set)."""
        wl = {"seq_len": 512, "heads": 4, "kv_heads": 4, "head_dim": 32, "dtype": "bf16", "mask": "causal",
              "layout": "zigzag", "passes": "fwd+bwd"} | self.workload
        w = resolve(**wl)
        topo = Topology.load("cpu-local", gpus=self.n)
        alg = get(self.algo)
        plan = alg.plan(w, topo, self.n, alg.normalize(self.knobs))
        path = write_schedule(alg.schedule(plan, topo), folder / f"{self.name}.json")
        if self.edit is not None:
            doc = json.loads(path.read_text())
            self.edit(doc)
            path.write_text(json.dumps(doc))
        return path


def run_cases(cases: list[Case], folder: Path, timeout_s: float = 90.0) -> dict[str, dict]:
    """Run the cases (one rank count) in one spawned world; name -> measurement dict."""
    from meshplan.executor.launch import run_batch
    from meshplan.executor.worker import RunConfig

    jobs = [(str(c.write(folder)), RunConfig(iters=1, warmup=0, check=True, timeout_s=timeout_s, memory=False, **c.run))
            for c in cases]
    return {c.name: r for c, r in zip(cases, run_batch(jobs))}


def relabel_causal_diagonal_as_full(doc: dict) -> None:
    """Negative control: the first forward causal-diagonal piece claims to be full (the verifier accepts it)."""
    for op in (op for r in doc["ranks"] for op in r["ops"]):
        if op["kind"] == "compute" and op["mask"] == "causal" and op["pass"] == "fwd":
            op["mask"] = "full"
            return
    raise AssertionError("no causal piece to relabel")


def point_at_another_kv_chunk(doc: dict) -> None:
    """Negative control: a forward compute op reads another KV input tensor of its rank (another chunk)."""
    tensors = {t["id"]: t for t in doc["tensors"]}
    for r in doc["ranks"]:
        for op in (op for op in r["ops"] if op["kind"] == "compute" and op["pass"] == "fwd"):
            kv = next(i for i in op["inputs"] if tensors[i]["kind"] == "kv")
            other = [t["id"] for t in doc["tensors"] if t["rank"] == r["rank"] and t["kind"] == "kv"
                     and t["pass"] == "fwd" and t["role"] == "input" and t["chunks"] != tensors[kv]["chunks"]]
            if other:
                op["inputs"] = [other[0] if i == kv else i for i in op["inputs"]]
                return
    raise AssertionError("no compute op to repoint")


def c1_inputs(path: Path, S: int = 4096, W: int = 2, D: int = 128) -> Path:
    """BUGCASES C1: queries 40·u, the first S/(2W) keys 40·u, other keys 0.01·randn, V random (H = 1)."""
    rng = np.random.default_rng(11)
    u = rng.standard_normal(D)
    u /= np.linalg.norm(u)
    q = np.broadcast_to(40 * u, (1, S, 1, D)).copy()
    k = 0.01 * rng.standard_normal((1, S, 1, D))
    k[:, : S // (2 * W)] = 40 * u
    v = rng.standard_normal((1, S, 1, D))
    np.savez(path, q=q, k=k, v=v, dout=rng.standard_normal((1, S, 1, D)))
    return path


def c5_inputs(path: Path) -> Path:
    """BUGCASES C5: 7 real tokens (0–3 = 1.0, 4–6 = 2.0) padded to 8 with 100; H = 1, D = 8."""
    x = np.array([1, 1, 1, 1, 2, 2, 2, 100], dtype=np.float32)[None, :, None, None] * np.ones((1, 8, 1, 8))
    rng = np.random.default_rng(5)
    np.savez(path, q=x, k=x, v=x * np.arange(1, 9)[None, None, None, :], dout=rng.standard_normal(x.shape))
    return path


def overlaps(measurement: dict, schedule: Path) -> bool:
    """Whether some transfer's [start, end) overlaps some compute op's on the same rank and pass."""
    doc = json.loads(schedule.read_text())
    kind = {op["id"]: (op["kind"], op["pass"]) for r in doc["ranks"] for op in r["ops"]}
    for r in measurement["ranks"]:
        ops = [(kind[o["id"]], o["start_s"], o["end_s"]) for o in r["ops"]]
        comp = [(p, s, e) for (k, p), s, e in ops if k == "compute"]
        comm = [(p, s, e) for (k, p), s, e in ops if k in ("send", "recv")]
        if any(pc == pm and s1 < e2 and s2 < e1 for pc, s1, e1 in comp for pm, s2, e2 in comm):
            return True
    return False


def killed_by_the_system(rank: int, world: int, payload) -> None:
    """A spawned rank function whose rank 1 dies of SIGKILL (as the out-of-memory killer ends a process)."""
    import os
    import signal
    import time

    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
