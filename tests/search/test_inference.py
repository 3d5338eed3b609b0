"""Inference with a KV cache (prefill with a cached prefix, decode) and packed documents (issue 8, items 2–3):
the rule against hand-computed bytes, schedules that verify, the search's rule report, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from meshplan.algorithms import get
from meshplan.cli.app import app
from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Mask, resolve
from meshplan.plan.verify import verify
from meshplan.search.candidate import predict
from meshplan.search.inference import meta_rule


def wl(**kw):
    return resolve(**({"passes": "fwd"} | kw))


@pytest.mark.parametrize("name", ["ring", "pass-q", "ulysses", "usp", "mesh", "loongtrain", "startrail", "merge"])
@pytest.mark.parametrize("seq,prefix", [(4096 + 512, 4096), (4096 + 1, 4096), (4096 + 3, 4096)])
def test_prefill_and_decode_schedules_verify(name, seq, prefix):
    t = Topology.load("cpu-local", gpus=4)
    w = wl(seq_len=seq, prefix_len=prefix, heads=8, kv_heads=2, head_dim=16)
    alg = get(name)
    knobs = alg.normalize({"ulysses_degree": "2"} if name == "usp" else {})
    report = verify(alg.schedule(alg.plan(w, t, 4, knobs), t))
    assert report.ok, report.violations


def test_prefix_bytes_by_hand():
    """Pass-Q moves query chunks of T/N tokens, Ring KV chunks of S/N tokens (docs/algorithms.md sizes)."""
    t = Topology.load("h100x16", gpus=8)
    w = wl(seq_len=65536 + 8192, prefix_len=65536, heads=32, kv_heads=8, head_dim=128)
    ring = predict("ring", w, t, 8, {}).predicted.json()
    kv_chunk = 2 * (73728 // 8) * 8 * 128 * 2
    assert ring["comm_bytes_per_gpu_max"] == 7 * kv_chunk                      # (N − 1) · KVc
    passq = predict("pass-q", w, t, 8, {}).predicted.json()
    q_chunk, o_chunk = (8192 // 8) * 32 * 128 * 2, (8192 // 8) * 32 * (128 * 2 + 4)
    assert passq["comm_bytes_per_gpu_max"] == 7 * q_chunk + 7 * o_chunk        # (N − 1) · (Qc + Oc + Lc)


def test_meta_rule_by_hand():
    """The rule's byte test is T/(T+P) >= 2·Hkv/H; decode with a long cache goes to pass-Q, prefill to Ring."""
    t = Topology.load("h100x16", gpus=16)
    decode = meta_rule(wl(seq_len=2**20 + 1, prefix_len=2**20, batch=4), t, 16)
    assert decode.choice == "pass-q" and decode.miss_rate == pytest.approx(1 / (2**20 + 1))
    assert decode.threshold == pytest.approx(2 * 8 / 32)
    assert decode.q_bytes == pytest.approx(4 * 1 / 16 * 32 * 128 * 2)
    assert decode.kv_bytes == pytest.approx(2 * 4 * (2**20 + 1) / 16 * 8 * 128 * 2)
    full = meta_rule(wl(seq_len=131072 + 8192, prefix_len=8192), t, 16)
    assert full.choice == "ring" and full.kv_step_s <= full.compute_step_s      # hidden behind compute
    half = meta_rule(wl(seq_len=4096, prefix_len=2048, heads=32, kv_heads=8), t, 16)
    assert half.kv_step_s > half.compute_step_s and half.miss_rate == 0.5 and half.choice == "ring"  # 0.5 >= 0.5


def test_search_reports_the_rule():
    res = CliRunner().invoke(app, ["search", "--gpus", "16", "--topo", "h100x16", "--seq-len", "1048577",
                                   "--prefix-len", "1M", "--batch", "8", "--pass", "fwd", "--algos", "ring,pass-q",
                                   "--write", "0", "--json"])
    assert res.exit_code == 0, res.output
    inf = json.loads(res.stdout)["inference"]
    assert inf["rule"]["choice"] == "pass-q" and inf["simulated_choice"] == "pass-q" and inf["agree"]
    assert inf["simulated"]["ring"]["time_s"] > 10 * inf["simulated"]["pass-q"]["time_s"]
    assert inf["new_tokens"] == 1 and inf["rule_regret_pct"] == 0.0


@pytest.mark.parametrize("args,flag", [
    (["--seq-len", "4096", "--prefix-len", "4096"], "--prefix-len"),       # a prefix as long as the context
    (["--seq-len", "4096", "--prefix-len", "5000"], "--prefix-len"),
    (["--seq-len", "4608", "--prefix-len", "4096", "--pass", "fwd+bwd"], "--prefix-len"),  # training with a cache
    (["--seq-len", "4609", "--prefix-len", "4001"], "--prefix-len"),       # cache not a multiple of 2N
    (["--seq-len", "4099", "--prefix-len", "4096"], "--seq-len"),          # 3 new tokens: not 2N, not < N
    (["--seq-len", "4096", "--mask", "docs:1000,3000"], "--mask"),          # documents do not add up
    (["--seq-len", "4096", "--mask", "docs:1001,3095"], "--mask"),          # not multiples of 2N per document
    (["--seq-len", "4096", "--mask", "docs:4096", "--doc-layout", "split"], "--doc-layout"),
])
def test_bad_inference_and_document_input(args, flag):
    base = ["simulate", "--algo", "ring", "--gpus", "2", "--topo", "cpu-local"]
    res = CliRunner().invoke(app, base + (args if "--pass" in args else args + ["--pass", "fwd"]))
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.strip().splitlines() if x]
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag}"), res.output
    assert "Traceback" not in res.output


def test_document_padding_suggestion_is_exact():
    with pytest.raises(UserError) as e:
        AttnMatrix(resolve(seq_len=4096, mask="docs:1001,3095"), 2)
    spec = str(e.value).split(", or pack them")[0].split("--mask ")[-1].split(" --seq-len ")
    padded = resolve(seq_len=int(spec[1].split()[0]), mask=spec[0])   # the suggested fix is accepted as is
    assert padded.mask.spec() == "docs:1001+3,3095+1" and padded.seq_len == 4100
    assert AttnMatrix(padded, 2).pairs.sum() == 1001 * 1002 // 2 + 3095 * 3096 // 2


def test_mask_spec_round_trips_with_padding():
    m = Mask.parse("docs:1000+24,3072")
    assert m.doc_lens == (1024, 3072) and m.doc_real_lens() == (1000, 3072) and Mask.parse(m.spec()) == m
    assert Mask.parse("cu_seqlens:0,1024,4096") == Mask.parse("docs:1024,3072")       # FlashAttention varlen
    for bad in ("cu_seqlens:5,10", "cu_seqlens:0,10,10", "cu_seqlens:0,x"):
        with pytest.raises(UserError, match="--mask"):
            Mask.parse(bad)


def test_per_document_zigzag_balances_the_work():
    """Packed documents: cutting each document by zigzag balances the ranks; zigzag over the packed stream does
    not (a long document at the end), and contiguous is worst."""
    t = Topology.load("cpu-local", gpus=4)
    docs = "docs:100+4,1+7,396+4"
    imb = {lay: predict("ring", resolve(seq_len=512, mask=docs, layout=lay[0], doc_layout=lay[1]), t, 4,
                        {}).predicted.total.work_imbalance
           for lay in [("zigzag", "per-doc"), ("zigzag", "packed"), ("contiguous", "packed")]}
    assert imb[("zigzag", "per-doc")] < 1.05 < imb[("zigzag", "packed")] < imb[("contiguous", "packed")]
    pairs = AttnMatrix(resolve(seq_len=512, mask=docs), 4).pairs.sum()
    assert pairs == sum(n * (n + 1) // 2 for n in (100, 1, 396))                 # padding never contributes
    # contiguous chunks of 128: the last holds rows 272..395 of the long document (and 4 padding rows, which
    # are not work): 41,478 of the 83,657 pairs
    last = sum(range(273, 397))
    assert last == 41478 and np.isclose(imb[("contiguous", "packed")], last / (pairs / 4), rtol=1e-9)


def test_files_without_doc_layout_read_as_packed(tmp_path):
    """Files written before per-document layouts cut the packed stream: read without the key, they stay packed."""
    from meshplan.plan.json.io import read_schedule, to_json_dict

    t = Topology.load("cpu-local", gpus=2)
    w = resolve(seq_len=64, mask="docs:20,44", layout="contiguous", doc_layout="packed", passes="fwd")
    alg = get("ring")
    doc = to_json_dict(alg.schedule(alg.plan(w, t, 2, alg.normalize({})), t))
    del doc["workload"]["doc_layout"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    back = read_schedule(path)
    assert back.workload.doc_layout == "packed" and verify(back).ok


@pytest.mark.parametrize("name", ["ring", "pass-q", "ulysses", "usp", "mesh", "loongtrain", "startrail", "merge"])
@pytest.mark.parametrize("seq,prefix,batch", [(65536 + 8192, 65536, 1), (65536 + 1, 65536, 4)])
def test_closed_forms_bound_inference(name, seq, prefix, batch):
    """The closed-form bound prunes the search: it must stay below the simulation with a cached prefix too."""
    t = Topology.load("h100x16", gpus=16)
    w = wl(seq_len=seq, prefix_len=prefix, batch=batch)
    c = predict(name, w, t, 16, {"ulysses_degree": "4"} if name == "usp" else {})
    assert c.bound_s <= c.predicted.makespan_s * (1 + 1e-9), (c.bound_s, c.predicted.makespan_s)
