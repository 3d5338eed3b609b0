"""A calibration of a GPU topology's link classes fitted from nccl-tests output (the file's types and how a topology
takes them: :mod:`meshplan.model.nccl_calibration_file`, whose docstring gives each fitted number)."""

from __future__ import annotations

import datetime

import numpy as np

from meshplan.core.errors import UserError
from meshplan.core.units import round_sig
from meshplan.model.nccl_calibration_file import FileFit, IntraFit, NcclCalibrationSpec, NetFit
from meshplan.model.topology_spec import TopologySpec
from meshplan.truth.nccl_tests import CollectiveFit, cross_node_rate


def _median(xs) -> float:
    return round_sig(float(np.median(xs)))


def build(fits: list[tuple[CollectiveFit, str]], spec: TopologySpec) -> NcclCalibrationSpec:
    """The calibration of ``spec`` from fitted files, each with its class (``nvlink`` or ``net``)."""
    rows = [_file_fit(f, cls, spec) for f, cls in fits]
    body = {"kind": "nccl-tests", "name": spec.name, "model": spec.node.device.model,
            "fitted_at": datetime.date.today(), "fits": rows}
    intra = [r for r in rows if r.link_class == "nvlink"]
    if intra:
        alpha, a_src = _alpha(intra)
        body["nvlink"] = IntraFit(alpha_us=alpha, usable_GBps=_median([r.rate_GBps for r in intra]),
                                  source=f"usable_GBps: {_names(intra)}; alpha_us: {a_src}")
    net = [r for r in rows if r.link_class == "net"]
    if net:
        alpha, a_src = _alpha(net)
        flows, colls = [r for r in net if r.collective == "sendrecv"], [r for r in net if r.collective != "sendrecv"]
        src = [f"alpha_us: {a_src}"] + [f"{k}: {_names(v)}" for k, v in (("per_flow_GBps", flows),
                                                                        ("node_aggregate_GBps", colls)) if v]
        body["net"] = NetFit(alpha_us=alpha, per_flow_GBps=_median([r.rate_GBps for r in flows]) if flows else None,
                             node_aggregate_GBps=_median([r.rate_GBps for r in colls]) if colls else None,
                             source="; ".join(src))
    return NcclCalibrationSpec.model_validate(body)


def _file_fit(f: CollectiveFit, cls: str, spec: TopologySpec) -> FileFit:
    run, rate = f.run, f.busbw_bytes_per_s
    if cls == "net":
        if run.hosts == 1:
            raise UserError(f"--from-nccl-tests net:{run.source}", "its ranks are all on one host: no transfer "
                            "crossed a node", "give a multi-node run, or leave out the prefix")
        rate = cross_node_rate(f)
        nics = spec.node.nics
        if nics is None:
            raise UserError(f"--from-nccl-tests {run.source}", f"a net fit, but {spec.name} has no NICs",
                            "give a multi-node topology (node.nics)")
        if run.collective != "sendrecv":    # the NICs the run's ranks used, of the node's count
            used = (min(run.ranks_per_host, spec.node.gpus) - 1) * nics.count // spec.node.gpus + 1
            rate *= nics.count / used
    return FileFit(file=run.source, collective=run.collective, ranks=run.ranks, hosts=run.hosts, gpu=run.gpu,
                   link_class=cls, alpha_us=round_sig(f.alpha_s * 1e6), busbw_GBps=round_sig(f.busbw_bytes_per_s / 1e9),
                   rate_GBps=round_sig(rate / 1e9), max_error=round_sig(f.max_error),
                   rows=[(int(s), float(f"{t * 1e6:.6g}")) for s, t in zip(run.size_bytes, run.time_s)])


def _alpha(rows: list[FileFit]) -> tuple[float, str]:
    p2p = [r for r in rows if r.collective == "sendrecv"]
    if p2p:
        return _median([r.alpha_us for r in p2p]), _names(p2p)
    return _median([r.alpha_us for r in rows]), f"{_names(rows)} (a collective's zero-size time: an upper bound)"


def _names(rows: list[FileFit]) -> str:
    return ", ".join(r.file for r in rows)
