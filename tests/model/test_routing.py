"""Routing options between nodes (issue 9, item 3): a rail-optimised fabric, cross-rail traffic via the spine
(with an oversubscription ratio) or via an NVLink hop to the right rail first (PXN); shown in ``topo show``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search.candidate import predict


def rail(tmp_path, **network) -> str:
    """dgx-h100-rail with its network changed; returns the file's path."""
    from importlib import resources
    spec = yaml.safe_load(resources.files("meshplan").joinpath("topologies/dgx-h100-rail.yaml").read_text())
    spec["network"] |= network
    spec["name"] = "rail-test"
    path = tmp_path / "rail.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def names(t: Topology, a: int, b: int) -> list[str]:
    return [t.link_name(x) for x in t.route(a, b)]


def test_same_rail_stays_in_its_leaf_and_cross_rail_climbs_the_spine():
    t = Topology.load("dgx-h100-rail", gpus=16)
    assert not any("spine" in x for x in names(t, 0, 8))              # GPU 0 -> GPU 8: both on rail 0
    cross = names(t, 0, 9)                                               # rail 0 -> rail 1
    assert "n0/rail0 -> spine" in cross and "spine -> n1/rail1-in" in cross
    lat, bw = t.pair_stats(np.array([0, 0]), np.array([8, 9]))
    assert bw[0] == pytest.approx(45e9) and bw[1] == pytest.approx(45e9 / 2.0)   # the 2:1 spine halves it
    assert lat[1] - lat[0] == pytest.approx(1e-6)                        # spine_latency_us
    assert t.node_symmetric                                              # spine shares are per node: still symmetric


def test_pxn_hops_over_nvlink_to_the_right_rail(tmp_path):
    t = Topology.load(rail(tmp_path, cross_rail="pxn"), gpus=16)
    r = names(t, 0, 9)
    assert r[:2] == ["n0/gpu0 -> n0/nvswitch", "n0/nvswitch -> n0/gpu1"]   # to GPU 1, on rail 1
    assert "n0/gpu1 -> n0/nic1" in r and not any("spine" in x for x in r)
    assert t.pair_stats(0, 9)[1] == pytest.approx(45e9)


def test_link_loads_follow_the_routes():
    t = Topology.load("dgx-h100-rail", gpus=16)
    src, dst = np.array([0, 3, 7, 9]), np.array([9, 11, 8, 2])
    load = t.link_loads(src, dst, 1.0)
    expect = np.zeros(t.n_links)
    for a, b in zip(src, dst):
        np.add.at(expect, t.route(int(a), int(b)), 1.0)
    assert np.array_equal(load, expect)


def test_oversubscribed_spine_slows_the_ring_and_pxn_avoids_it(tmp_path):
    """Ring over 16 GPUs: its two inter-node hops (7 -> 8, 15 -> 0) cross rails (7 -> 0)."""
    w = resolve(seq_len="64K", heads=8, kv_heads=8, head_dim=128, passes="fwd")
    time = {}
    for name, net in (("nonblocking", {"kind": "nonblocking"}), ("spine4", {"spine_oversubscription": 4.0}),
                      ("pxn", {"cross_rail": "pxn", "spine_oversubscription": 4.0})):
        t = Topology.load(rail(tmp_path, **net), gpus=16)
        time[name] = predict("ring", w, t, 16, {}).predicted.makespan_s
    assert time["spine4"] > 1.2 * time["nonblocking"]
    assert time["pxn"] < time["spine4"]


def test_topo_show_reports_the_routing():
    res = CliRunner().invoke(app, ["topo", "show", "dgx-h100-rail", "--gpus", "16", "--json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["network"] == {"kind": "rail", "latency_us": 3.0, "rails": 8, "cross_rail": "spine",
                               "spine_oversubscription": 2.0, "spine_latency_us": 1.0}
    cross = next(r for r in body["routes"] if (r["src"], r["dst"]) == (0, 9))
    assert "spine" in cross["path"] and cross["GBps"] == pytest.approx(22.5)
    text = CliRunner().invoke(app, ["topo", "show", "dgx-h100-rail", "--gpus", "16"]).output
    assert "rail-optimised" in text and "2:1 oversubscribed" in text


def test_bad_oversubscription_is_refused(tmp_path):
    res = CliRunner().invoke(app, ["topo", "show", rail(tmp_path, spine_oversubscription=0.5), "--gpus", "16"])
    assert res.exit_code == 2 and "spine_oversubscription" in res.output and "Traceback" not in res.output
