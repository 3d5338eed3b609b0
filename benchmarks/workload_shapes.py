"""The README's numbers for inference shapes, packed documents and the CHARM+ memory table, by hand:
``python benchmarks/workload_shapes.py`` (about a minute). Writes ``benchmarks/results/workload_shapes.json``.

- Inference on 16 H100s of ``h100x16`` (Llama-3-8B attention): Meta's pass-KV / pass-Q rule against the best
  simulated ``ring`` and ``pass-q`` plans (:func:`meshplan.search.inference.rule_report`), prefill with a short and a
  long cache and a decode step.
- Packed documents on 4 CPU ranks: the work imbalance of Ring with the documents cut one by one (per-doc zigzag)
  against zigzag and contiguous over the packed stream.
- ``meshplan reproduce charm-memory``: predicted against published peak memory
  (:func:`meshplan.truth.reproduce.reproduce_memory`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from meshplan.core.fileio import write_atomic
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search import run_search
from meshplan.search.candidate import predict
from meshplan.search.inference import rule_report
from meshplan.truth.reproduce import reproduce_memory

INFERENCE = [("8K cached + 128K new", 136 * 1024, 8 * 1024, 1), ("112K cached + 16K new", 128 * 1024, 112 * 1024, 1),
             ("1M cached + 1 new (decode, batch 8)", 2**20 + 1, 2**20, 8)]
DOCS = "docs:100+4,1+7,396+4"


def main() -> None:
    t16 = Topology.load("h100x16", gpus=16)
    inference = []
    for label, seq, prefix, batch in INFERENCE:
        w = resolve(seq_len=seq, prefix_len=prefix, batch=batch, passes="fwd")
        rep = rule_report(run_search(w, t16, 16, algos=["ring", "pass-q"]))
        inference.append({"case": label} | rep)
        print(label, rep["rule"]["choice"], {k: v["time_s"] for k, v in rep["simulated"].items()}, flush=True)
    cpu = Topology.load("cpu-local", gpus=4)
    docs = {}
    for layout, doc_layout in (("zigzag", "per-doc"), ("zigzag", "packed"), ("contiguous", "packed")):
        w = resolve(seq_len=512, mask=DOCS, layout=layout, doc_layout=doc_layout)
        docs[f"{layout} {doc_layout}"] = predict("ring", w, cpu, 4, {}).predicted.total.work_imbalance
    print(docs, flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "inference": inference, "docs_mask": DOCS, "docs": docs,
           "memory": reproduce_memory()}
    path = write_atomic(Path(__file__).resolve().parent / "results" / "workload_shapes.json",
                        (json.dumps(out, indent=1) + "\n").encode())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
