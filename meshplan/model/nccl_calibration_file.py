"""Calibration files fitted from nccl-tests output (``meshplan calibrate --from-nccl-tests``): the link classes'
alpha and bandwidth of a GPU topology, without torch. A topology names one like any calibration
(``calibration: FILE``); ``kind: nccl-tests`` tells the two apart
(:func:`meshplan.model.calibration_file.load_calibration`).

Which class a file calibrates: its prefix (``intra:FILE``, ``nvlink:FILE``, ``net:FILE``), else its ``#  Rank``
lines — ranks on one host: the intra-node class (``nvlink``, an NVSwitch fabric's ports); on several: ``net``.
``intra:`` on several hosts is for NVLink domains that span hosts (multi-node NVLink, e.g. GB200 NVL72 trays),
and is refused when the file's ranks are more than one node of the topology holds (they crossed the network);
``net:`` on one host is refused (nothing crossed a node).
Per class (the files' own fits are kept in ``fits``, each number's files in ``source``):

* ``nvlink.usable_GBps``: the median of the files' busbw (a GPU's port rate, per direction, for all three
  tests); ``net.per_flow_GBps``: the median busbw of the multi-node sendrecv files (one flow per node boundary);
  ``net.node_aggregate_GBps``: the median node outbound rate of the multi-node collectives
  (:func:`meshplan.truth.nccl_tests.cross_node_rate`), scaled to all the topology's NICs when the run used fewer
  (GPU k uses NIC k · count // gpus, as the topology says);
* ``alpha_us``: the median alpha of the class's sendrecv files — a transfer's time at zero size, what the cost
  model's ``T(S) = alpha_sw + Σ hop latency + S / rate`` gives at S = 0 — else of its collectives (a whole
  collective's zero-size time: an upper bound on one transfer's).

How a topology takes them is :func:`apply_nccl_calibration`; the fit itself is :mod:`meshplan.truth.nccl_fit`.
"""

from __future__ import annotations

import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

from meshplan.core.errors import UserError
from meshplan.core.units import round_sig
from meshplan.model.topology_spec import TopologySpec

ClassName = Literal["nvlink", "net"]
PREFIXES = {"intra": "nvlink", "nvlink": "nvlink", "net": "net"}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IntraFit(_Strict):
    """Inside a node (NVSwitch): a transfer's zero-size time and a GPU port's usable bandwidth."""

    alpha_us: NonNegativeFloat = Field(description="becomes the topology's p2p_overhead_us (the ports' latency 0)")
    usable_GBps: PositiveFloat = Field(description="the NVSwitch port per direction: the median of the files' busbw")
    source: str = Field(description="the files each number is the median of")


class NetFit(_Strict):
    """Between nodes: a transfer's zero-size time, one flow's rate and all of a node's NICs together."""

    alpha_us: NonNegativeFloat = Field(description="p2p_overhead_us + network.latency_us (the NIC hops' latency 0)")
    per_flow_GBps: PositiveFloat | None = Field(None, description="nics.per_flow_GBps: multi-node sendrecv's busbw")
    node_aggregate_GBps: PositiveFloat | None = Field(
        None, description="nics.node_aggregate_GBps (each NIC port gets 1/count of it): multi-node collectives")
    source: str = Field(description="the files each number is the median of")


class FileFit(_Strict):
    """One file's fit, ``t(S) = alpha + factor · S / busbw`` (meshplan.truth.nccl_tests)."""

    file: str
    collective: Literal["sendrecv", "all_gather", "alltoall"]
    ranks: PositiveInt
    hosts: PositiveInt
    gpu: str = Field(description="the device names of the '#  Rank' lines")
    link_class: ClassName
    alpha_us: NonNegativeFloat
    busbw_GBps: PositiveFloat = Field(description="nccl-tests' bus bandwidth, fitted")
    rate_GBps: PositiveFloat = Field(description="what its class takes: busbw, or the node's outbound rate "
                                     "(multi-node collectives)")
    max_error: NonNegativeFloat = Field(description="max |fit − measured| / measured over rows of ≥ 1 MiB on the wire")
    rows: list[tuple[NonNegativeInt, PositiveFloat]] = Field(description="(size B, out-of-place time us) fitted")


class NcclCalibrationSpec(_Strict):
    """A calibration file of link classes fitted from nccl-tests output."""

    kind: Literal["nccl-tests"]
    name: str = Field(description="the topology it was fitted for")
    model: str = Field(description="that topology's node.device.model (must match)")
    fitted_at: datetime.date
    nvlink: IntraFit | None = None
    net: NetFit | None = None
    fits: list[FileFit]


def apply_nccl_calibration(spec: TopologySpec, calib: NcclCalibrationSpec) -> TopologySpec:
    """The topology with the fitted link classes in place of its own values:

    * ``nvlink``: ``fabric.port`` = {usable_GBps, latency_us: 0}; ``p2p_overhead_us`` = its alpha, so a pair in
      a node has latency alpha (``Topology.pair_stats``) — on one node the software cost and the hops' latency
      are one number, as in ``meshplan calibrate``'s own fit;
    * ``net``: the NICs' ``gpu_link`` and ``port`` latency 0 and ``network.latency_us`` = alpha −
      ``p2p_overhead_us``, so a pair across nodes has latency alpha; ``per_flow_GBps`` and
      ``node_aggregate_GBps`` as fitted, ``port`` = the aggregate / NIC count; links on a cross-node route
      slower than the per-flow rate are raised to it (one flow alone reaches what sendrecv measured).

    Raises:
        UserError: another device model; a class the topology does not have; a net alpha below the
            p2p_overhead_us every transfer pays.
    """
    if calib.model != spec.node.device.model:
        raise UserError("calibration", f"fitted for {calib.model!r}, but {spec.name}'s device is "
                        f"{spec.node.device.model!r}", f"run meshplan calibrate --topo {spec.name} --from-nccl-tests")
    d = spec.model_dump()
    if calib.nvlink is not None:
        if spec.node.fabric.kind != "nvswitch":
            raise UserError("calibration: nvlink", f"{spec.name} has a {spec.node.fabric.kind} fabric, no NVSwitch "
                            "ports (nccl-tests in a PCIe box measure the slowest of its links, which this fit cannot "
                            "tell apart)", "fit a topology with an nvswitch fabric")
        d["node"]["fabric"]["port"] = {"usable_GBps": calib.nvlink.usable_GBps, "latency_us": 0.0}
        d["p2p_overhead_us"] = calib.nvlink.alpha_us
    if calib.net is not None:
        _apply_net(d, spec, calib.net)
    return TopologySpec.model_validate(d)


def _apply_net(d: dict, spec: TopologySpec, net: NetFit) -> None:
    nics = spec.node.nics
    if nics is None:
        raise UserError("calibration: net", f"{spec.name} has no NICs", "fit a multi-node topology")
    over = d["p2p_overhead_us"]
    if net.alpha_us < over:
        raise UserError("calibration: net.alpha_us", f"{net.alpha_us} us is below {spec.name}'s p2p_overhead_us "
                        f"({over} us), which every transfer pays", "fit an intra-node file too (it sets it)")
    d["network"]["latency_us"] = round_sig(net.alpha_us - over)
    n = d["node"]["nics"]
    n["gpu_link"]["latency_us"] = n["port"]["latency_us"] = 0.0
    port, gpu_link = nics.port.bytes_per_s / 1e9, nics.gpu_link.bytes_per_s / 1e9
    if net.node_aggregate_GBps is not None:
        n["node_aggregate_GBps"] = net.node_aggregate_GBps
        port = net.node_aggregate_GBps / nics.count
        n["port"] = {"usable_GBps": round_sig(port), "latency_us": 0.0}
    if net.per_flow_GBps is not None:
        r = net.per_flow_GBps
        n["per_flow_GBps"] = r
        if port < r:
            n["port"] = {"usable_GBps": r, "latency_us": 0.0}
        if gpu_link < r:
            n["gpu_link"] = {"usable_GBps": r, "latency_us": 0.0}
        n["node_aggregate_GBps"] = max(n["node_aggregate_GBps"], r)


def dump_yaml(calib: NcclCalibrationSpec) -> str:
    """The file text: a header comment, then the fields (rows in flow style)."""
    import yaml

    head = (f"# {calib.name}: link classes fitted by `meshplan calibrate --from-nccl-tests` on {calib.fitted_at}\n"
            "# (meshplan/truth/nccl_fit.py); each class's `source` names its files, `fits` holds each file's fit.\n")
    body = calib.model_dump(mode="json")
    return head + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=160, allow_unicode=True)
