"""Fit the H100 cluster's parameters to the CHARM+ tables and write them where the planner reads them.

``python benchmarks/fit_h100.py`` runs ``meshplan reproduce charm-h100 --fit`` (micro-level fits on Ring's
per-step columns, declared parameters on the declared rows; :mod:`meshplan.truth.reproduce_fit`), writes the
fitted kernel table to ``meshplan/topologies/kernels/fa2-hopper-fit.yaml``, prints the values that
``h100x16.yaml`` and ``h100x32.yaml`` carry (copied there by hand, with their comments; a test checks that
they agree with a fresh fit), and saves the reports in ``benchmarks/results/reproduce_charm_h100.json`` and
``reproduce_charm_ablation.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from meshplan.core.fileio import write_atomic  # noqa: E402
from meshplan.truth.reproduce import reproduce_ablation, reproduce_h100  # noqa: E402
from meshplan.truth.reproduce_fit import FittedParams, kernel_table_body, topology_values  # noqa: E402


def main() -> None:
    t0 = time.perf_counter()
    body = reproduce_h100(fit=True)
    fitted = FittedParams(**{k: v for k, v in body["fitted"].items() if k in FittedParams.__dataclass_fields__})
    kernel = kernel_table_body(fitted, "fa2-hopper-fit")
    head = ("# fa2-hopper-fit: FlashAttention-2 on the CHARM+ paper's H100 cluster, fitted by benchmarks/fit_h100.py\n"
            "# (meshplan reproduce charm-h100 --fit): e = e_max * (g(s_q) * g(s_kv))^a, g(s) = s / (s + s_half),\n"
            f"# e_max = {fitted.e_fwd / (1 - fitted.kappa):.4f}, s_half = {fitted.s_half:.1f}, "
            f"a = {fitted.exponent:.4f} (the kernel alone; Ring's measured compute ran at 1 - kappa of it).\n")
    out = HERE.parent / "meshplan" / "topologies" / "kernels" / "fa2-hopper-fit.yaml"
    write_atomic(out, (head + yaml.safe_dump(kernel, sort_keys=False, width=120, default_flow_style=None)).encode())
    print(json.dumps(topology_values(fitted), indent=1))
    body["date"], body["wall_s"] = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter() - t0
    ablation = reproduce_ablation() | {"date": body["date"]}
    write_atomic(HERE / "results" / "reproduce_charm_ablation.json", json.dumps(ablation, indent=1).encode())
    write_atomic(HERE / "results" / "reproduce_charm_h100.json", json.dumps(body, indent=1, default=float).encode())
    print(json.dumps(body["summary"], indent=1), f"\n{body['wall_s']:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
