"""``meshplan reproduce``: predicted vs published for the CHARM+ tables (:mod:`meshplan.truth.reproduce`)."""

from __future__ import annotations

from typing import Any


def reproduce_command(table: str, data: str | None, fit: bool, as_json: bool, emit) -> None:
    """Run the reproduction of ``table`` and print it (a rich table, or JSON)."""
    from meshplan.core.errors import UserError
    from meshplan.truth.reproduce import reproduce_ablation, reproduce_h100, reproduce_memory

    if table == "charm-h100":
        body = reproduce_h100(data, fit=fit)
        emit(body, as_json, lambda c: _print_h100(body, c))
    elif table == "charm-ablation":
        if fit:
            raise UserError("--fit", "the ablation table has no fit", "use --fit with charm-h100")
        body = reproduce_ablation(data)
        emit(body, as_json, lambda c: _print_ablation(body, c))
    elif table == "charm-memory":
        if fit:
            raise UserError("--fit", "the memory table has no fit", "use --fit with charm-h100")
        body = reproduce_memory(data)
        emit(body, as_json, lambda c: _print_memory(body, c))
    else:
        raise UserError("TABLE", f"unknown table {table!r}", "use charm-h100, charm-ablation or charm-memory")


def _print_h100(body: dict[str, Any], console) -> None:
    from rich.table import Table

    t = Table(title="CHARM+ 2x8 H100 (16 GPUs): predicted vs published, ms  (* = declared row, not in the error)")
    for col in ("row", "CCR", "method", "predicted", "measured", "error %"):
        t.add_column(col, justify="left" if col in ("row", "method") else "right")
    for r in body["rows"]:
        t.add_row(r["row"] + (" *" if r["declared"] else ""), f"{r['ring_ccr_published']:.2f}", r["method"],
                  f"{r['predicted_ms']:.2f}", f"{r['measured_ms']:.2f}", f"{r['error_pct']:+.1f}")
    console.print(t)
    for m, s in body["summary"].items():
        console.print(f"{m:6s} MAPE {s['mape_pct']:5.1f} %   max {s['max_abs_error_pct']:5.1f} %   "
                      f"mean {s['mean_error_pct']:+5.1f} %   over {s['rows']} rows not declared")
    if "fitted" in body:
        f = body["fitted"]
        console.print(f"fitted: alpha {f['alpha_s'] * 1e6:.1f} us, cross-node flow {f['flow_bw_GBps']:.2f} GB/s, "
                      f"kernel launch {f['launch_s'] * 1e6:.1f} us, e_fwd {f['e_fwd']:.3f} (under transfer), "
                      f"s_half {f['s_half']:.0f}, a {f['exponent']:.3f}, bwd factor {f['kernel_bwd_factor']:.3f}; "
                      f"declared: node aggregate {f['node_aggregate_GBps']:.0f} GB/s, kappa {f['kappa']:.2f}, "
                      f"CHARM+ query order {f['query_order']}")


def _print_ablation(body: dict[str, Any], console) -> None:
    from rich.table import Table

    t = Table(title=f"CHARM+ ablation (forward; B = {body['batch_assumed']} assumed): ratios to Ring")
    for col in ("topology", "GPUs", "S", "ratio", "predicted", "measured", "direction"):
        t.add_column(col)
    for it in body["rows"]:
        for k, v in it.items():
            if k.endswith("_over_ring"):
                t.add_row(it["topology"], str(it["gpus"]), str(it["S"]), k.replace("_over_ring", "/ring"),
                          f"{v['predicted']:.2f}", f"{v['measured']:.2f}", "right" if v["same_direction"] else "WRONG")
    console.print(t)
    console.print(f"directions right: {body['directions_right']} of {body['directions_total']}")


def _print_memory(body: dict[str, Any], console) -> None:
    from rich.table import Table

    each = Table(title=f"CHARM+ peak memory, 8 L20, fwd+bwd (D = {body['head_dim_assumed']} assumed): per rank, "
                       "MB (pred: the schedule's buffers; total: + workspace and runtime, the memory model)")
    versus = Table(title="CHARM+ against Ring: the ratio, and the difference in MB")
    for col in ("B", "S", "heads", "Ring pred", "total", "meas", "CHARM+ pred", "total", "meas"):
        each.add_column(col, justify="right")
    for col in ("B", "S", "heads", "ratio pred", "meas", "extra pred", "total", "meas"):
        versus.add_column(col, justify="right")
    for r in body["rows"]:
        p, m, tot = r["predicted_MB"], r["measured_MB"], r["predicted_total_MB"]
        shape = (str(r["B"]), str(r["S"]), str(r["heads"]))
        each.add_row(*shape, f"{p['ring']:.0f}", f"{tot['ring']:.0f}", f"{m['ring']:.0f}", f"{p['charm']:.0f}",
                     f"{tot['charm']:.0f}", f"{m['charm']:.0f}")
        versus.add_row(*shape, f"{r['ratio']['predicted']:.3f}", f"{r['ratio']['measured']:.3f}",
                       f"{r['difference_MB']['predicted']:.0f}", f"{r['total_difference_MB']:.0f}",
                       f"{r['difference_MB']['measured']:.0f}")
    console.print(each)
    console.print(versus)
    console.print(f"direction (CHARM+ needs more than Ring) right in {body['directions_right']} of "
                  f"{body['directions_total']}; predicted extra / measured extra: median "
                  f"{body['difference_ratio_median']:.1f}x (buffers), {body['total_difference_ratio_median']:.1f}x "
                  f"(memory model). Not modelled: {body['missing']}")
