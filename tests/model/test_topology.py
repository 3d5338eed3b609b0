"""Topologies: shipped files load, routes and capacities, placement rules, one-line YAML errors."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.core.errors import UserError
from meshplan.model.topo_files import shipped_topologies
from meshplan.model.topology import Topology

ISSUE_FILES = {"h100x16", "h100x32", "dgx-h100", "h20x16", "l20x8", "a100x8", "h200x8", "cpu-local", "h100x8"}


def test_every_shipped_file_loads_with_sources():
    assert ISSUE_FILES <= set(shipped_topologies())
    for name in shipped_topologies():
        t = Topology.load(name)
        assert t.n_devices > 0 and t.kernel.efficiency(4096, 4096, "fwd", False) > 0
        text = open(t.source).read()
        assert text.count("#") >= 5, f"{name}: every number needs its source in a comment"


def test_bare_names_and_paths_resolve():
    a = Topology.load("h100x32")
    b = Topology.load("h100x32.yaml")
    c = Topology.load(a.source)
    assert a.content_hash == b.content_hash == c.content_hash


def test_nvswitch_and_cross_node_routes():
    t = Topology.load("h100x16")
    inside = [t.link_name(x) for x in t.route(0, 5)]
    assert inside == ["n0/gpu0 -> n0/nvswitch", "n0/nvswitch -> n0/gpu5"]
    across = [t.link_name(x) for x in t.route(3, 12)]
    assert across[0] == "n0/gpu3 -> n0/nic3" and across[-1] == "n1/nic4 -> n1/gpu4" and "n0/net-out -> net" in across
    lat, bw = t.pair_stats([0, 3], [5, 12])
    # CHARM+ Table 2 inside a node; across, the flow bandwidth fitted to Ring's T_comm columns (reproduce_fit)
    assert bw[0] == pytest.approx(365.1e9) and bw[1] == pytest.approx(t.spec.node.nics.per_flow_GBps * 1e9)
    assert t.spec.node.nics.per_flow_GBps == pytest.approx(26.15)
    assert lat[1] > lat[0] > 0


def test_pcie_numa_routes():
    t = Topology.load("l20x8")
    assert t.route_bandwidth(0, 1) == pytest.approx(24.0e9)    # same switch
    assert t.route_bandwidth(0, 3) == pytest.approx(24.0e9)    # same socket, via the root complex
    assert t.route_bandwidth(0, 7) == pytest.approx(14.7e9)    # cross-NUMA (CHARM+ Table 2)
    names = [t.link_name(x) for x in t.route(0, 7)]
    assert "n0/socket0 -> n0/socket1" in names
    assert list(t.domain_of_device) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_gpu_placement_rules():
    assert Topology.load("h100x32", gpus=256).n_nodes == 32
    t = Topology.load("l20x8", gpus=4)
    assert t.n_devices == 4 and set(t.domain_of_device) == {0}   # a NUMA domain first
    assert Topology.load("cpu-local", gpus=5).n_devices == 5
    with pytest.raises(UserError, match=r"--gpus: 12 GPUs cannot be placed.*divisor of 8 \(1, 2, 4, 8\)"):
        Topology.load("h100x32", gpus=12)


def test_link_loads_follow_routes():
    t = Topology.load("h100x16")
    loads = t.link_loads(np.arange(16), (np.arange(16) + 1) % 16, 1.0)
    for src in range(16):
        for link in t.route(src, (src + 1) % 16):
            assert loads[link] >= 1.0
    out7 = t.route(7, 8)[0]
    assert loads[out7] == 1.0


def test_node_aggregate_and_per_flow_cap_are_separate():
    t = Topology.load("h100x32")
    r = t.route(0, 8)
    caps = t.link_capacity[r] / 1e9
    nics = t.spec.node.nics
    # the node aggregate appears twice on the route (out of node 0, into node 1), the NIC ports once each
    assert list(np.round(caps, 3)).count(nics.node_aggregate_GBps) == 2
    assert np.isfinite(t.link_flow_cap[r]).any() and nics.node_aggregate_GBps != nics.port.usable_GBps


def _write(tmp_path, text):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    return str(p)


BASE = """
name: t
nodes: 1
node:
  gpus: 2
  device: {model: x, peak_bf16_tflops: 1, peak_fp32_tflops: 1, memory_GB: 1, hbm_GBps: 1, kernel: fa2-hopper}
  fabric: {kind: nvswitch, port: {usable_GBps: BW, latency_us: 1}}
p2p_overhead_us: 1
"""


@pytest.mark.parametrize("text,field", [
    (BASE.replace("BW", "10").replace("nodes: 1", "nodes: 1\nnodez: 2"), "nodez"),
    (BASE.replace("BW", "0"), "usable_GBps"),
    (BASE.replace("BW", "-5"), "usable_GBps"),
    (BASE.replace("BW", "10").replace("kernel: fa2-hopper", "kernel: nope"), "kernel"),
    ("name: t\nnodes: [", "invalid YAML"),
])
def test_bad_yaml_gives_one_line(tmp_path, text, field):
    with pytest.raises(UserError) as err:
        t = Topology.load(_write(tmp_path, text))
        t.kernel  # noqa: B018  (a kernel table is loaded on first use)
    msg = str(err.value)
    assert field in msg and "\n" not in msg


def test_unknown_topology_lists_shipped():
    with pytest.raises(UserError, match="h100x32"):
        Topology.load("no-such-cluster")


def test_domains_from_sockets_nodes_or_declaration(tmp_path):
    assert Topology.load("l20x8").n_domains == 2
    assert Topology.load("h100x32").n_domains == 4
    assert Topology.load("cpu-local", gpus=4).n_domains == 1
    text = open(Topology.load("cpu-local").source).read().replace("domains: 1 ", "domains: 2 ")
    p = tmp_path / "cpu2.yaml"
    p.write_text(text)
    assert list(Topology.load(str(p), gpus=4).domain_of_device) == [0, 0, 1, 1]


def test_kernel_envelope_is_monotone_and_bounds_the_table():
    """A measured table that dips at a larger size (a CPU's caches): the envelope at the larger shape is the
    best efficiency of any smaller one, so closed forms taken at an op's largest shape stay lower bounds."""
    from meshplan.model.kernel_tables import KernelTable, KernelTableSpec
    spec = KernelTableSpec(name="dip", source="test", launch_us=0, tokens=[64, 256, 1024],
                           fwd=[[0.2, 0.5, 0.4], [0.5, 0.6, 0.3], [0.4, 0.3, 0.35]], bwd_factor=1.0,
                           elementwise=[0.5, 0.9, 0.7])
    k = KernelTable(spec)
    assert k.efficiency(1024, 1024, "fwd", False) == pytest.approx(0.35)
    assert k.efficiency(1024, 1024, "fwd", False, envelope=True) == pytest.approx(0.6)
    assert k.efficiency(1024, 1024, "fwd", True, envelope=True) == pytest.approx(0.6 * 0.9)
    s = np.exp2(np.linspace(4, 11, 29))
    e = k.efficiency(s[:, None], s[None, :], "fwd", True, envelope=True)
    assert (np.diff(e, axis=0) >= -1e-15).all() and (np.diff(e, axis=1) >= -1e-15).all()
    assert (e >= k.efficiency(s[:, None], s[None, :], "fwd", True) - 1e-15).all()
