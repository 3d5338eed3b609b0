"""The executor on CPU ranks (gloo): numerics against float64 for every algorithm, BUGCASES C1–C8, negative
controls, overlap and ``--serialize``. One spawned world per rank count runs all its cases; the cases cover
algorithm × pass × mask × heads × dtype pairwise (the full product is ``slow``)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.heavy      # multi-rank runs: `pytest -m heavy`, and CI

pytest.importorskip("torch")

from exec_cases import (  # noqa: E402
    Case,
    c1_inputs,
    c5_inputs,
    overlaps,
    point_at_another_kv_chunk,
    relabel_causal_diagonal_as_full,
    run_cases,
)

GQA = {"heads": 4, "kv_heads": 2}
WORLD2 = [
    Case("ring-zz-causal-bf16-mha", "ring", 2),
    Case("c8-ring-full-bf16", "ring", 2, workload={"seq_len": 1024, "heads": 8, "kv_heads": 8, "head_dim": 64,
                                                     "mask": "full"}),
    Case("c3-ring-fp16", "ring", 2, workload={"seq_len": 1024, "head_dim": 64, "dtype": "fp16",
                                                "layout": "contiguous"}, run={"dump_dir": "c3"}),
    Case("c2-w2", "ring", 2, workload={"seq_len": 1024, "heads": 8, "kv_heads": 2, "head_dim": 64}),
    Case("passq-zz-full-fp32-gqa-fwd", "pass-q", 2, workload=GQA | {"mask": "full", "dtype": "fp32", "passes": "fwd"}),
    Case("passq-contig-causal-bf16-bwd", "pass-q", 2, workload={"layout": "contiguous", "passes": "bwd"}),
    Case("ring-zz-causal-fp32-gqa-bwd", "ring", 2, workload=GQA | {"dtype": "fp32", "passes": "bwd"}),
    Case("ring-hops-n-1-bf16-wire", "ring", 2, knobs={"dkv_hops": "n-1", "dkv_dtype": "bf16"}),
    Case("serialized", "ring", 2, run={"serialize": True}),
    Case("ulysses-zz-causal-bf16-mha", "ulysses", 2),
    Case("c6-ulysses-padded", "ulysses", 2, workload={"seq_len": 1024, "valid_len": 1023, "heads": 8, "kv_heads": 8,
                                                       "head_dim": 64, "layout": "contiguous", "passes": "fwd"}),
    Case("merge2-zz-causal-bf16", "merge", 2),
    Case("docplace2-fp32-bf16-wire", "doc-place", 2, knobs={"dkv_dtype": "bf16"},
         workload={"mask": "docs:60,300+12,140", "dtype": "fp32"}),
    Case("rmplus2-full-fp16", "rmplus", 2, workload={"mask": "full", "dtype": "fp16"}),
    Case("charm2-full-fp32-gqa-bwd", "charm", 2, knobs={"domains": "2"},
         workload=GQA | {"mask": "full", "dtype": "fp32", "passes": "bwd"}),
    Case("loongtrain-w1-fp16", "loongtrain", 2, knobs={"inner_ring": "1"}, workload={"dtype": "fp16"}),
    Case("bad-mask", "ring", 2, edit=relabel_causal_diagonal_as_full),
    Case("bad-kv", "ring", 2, workload={"mask": "full"}, edit=point_at_another_kv_chunk),
]
WORLD4 = [
    Case("mesh2x2-zz-causal-bf16-gqa", "mesh", 4, knobs={"tile": "2x2"}, workload=GQA),
    Case("mesh2x2-contig-full-fp16-keep", "mesh", 4, knobs={"tile": "2x2", "bwd_inputs": "keep"},
         workload={"layout": "contiguous", "mask": "full", "dtype": "fp16"}),
    Case("mesh2x2-window-fp32-fwd", "mesh", 4, knobs={"tile": "2x2"},
         workload={"mask": "window:100", "dtype": "fp32", "passes": "fwd"}),
    Case("passq-zz-causal-fp32", "pass-q", 4, workload={"dtype": "fp32"}),
    Case("ring-contig-docs-bf16", "ring", 4, workload={"layout": "contiguous", "mask": "docs:200,312"}),
    # a document split over 4 ranks: head-parallel (Ulysses 2 x ring 2), a plain ring (u = 1: 1 KV head), fetched
    Case("docplace-split-padded-bf16-gqa", "doc-place", 4, workload=GQA | {"mask": "docs:300,20+4,100,88"}),
    Case("docplace-ring-mqa-fp32", "doc-place", 4,
         workload={"heads": 3, "kv_heads": 1, "mask": "docs:300,20+4,100,88", "dtype": "fp32"}),
    Case("docplace-fetch-bf16", "doc-place", 4, knobs={"split": "fetch"}, workload={"mask": "docs:300,20+4,100,88"}),
    Case("c2-w4", "ring", 4, workload={"seq_len": 2048, "heads": 8, "kv_heads": 2, "head_dim": 64}),
    Case("c4-padded", "ring", 4, workload={"seq_len": 3000, "valid_len": 2999, "heads": 2, "kv_heads": 2,
                                             "head_dim": 64}),
    Case("ulysses-contig-full-fp16-gqa-repl", "ulysses", 4, workload=GQA | {"layout": "contiguous", "mask": "full",
                                                                            "dtype": "fp16"}),
    Case("usp2x2-zz-causal-bf16-gqa", "usp", 4, knobs={"ulysses_degree": "2"}, workload=GQA),
    Case("usp2x2-ringfirst-full-fp32-bwd", "usp", 4, knobs={"ulysses_degree": "2", "rank_order": "ring-first"},
         workload={"mask": "full", "dtype": "fp32", "passes": "bwd"}),
    Case("rmplus4-contig-full-fp16-gqa", "rmplus", 4, workload=GQA | {"layout": "contiguous", "mask": "full",
                                                                         "dtype": "fp16"}),
    Case("charm2x2-zz-causal-bf16", "charm", 4, knobs={"domains": "2"}),
    Case("loongtrain-w2-zz-causal-bf16", "loongtrain", 4, knobs={"inner_ring": "2"}),
    Case("startrail-c2-contig-causal-fp16-gqa", "startrail", 4, knobs={"team_size": "2"},
         workload=GQA | {"layout": "contiguous", "dtype": "fp16"}),
    # striped: ops over two chunks interleave their tokens (run block by block, meshplan.model.blockmask.Blocks)
    Case("mesh2x2-striped-causal-fp32", "mesh", 4, knobs={"tile": "2x2"}, workload={"layout": "striped",
                                                                                  "dtype": "fp32"}),
    Case("usp2x2-striped-causal-bf16-gqa", "usp", 4, knobs={"ulysses_degree": "2"},
         workload=GQA | {"layout": "striped"}),
    Case("merge4-contig-causal-fp32-fwd", "merge", 4, workload={"layout": "contiguous", "dtype": "fp32",
                                                                 "passes": "fwd"}),
    # inference (issue 8): a cached prefix of 448 tokens + 64 new (prefill), and + 1 (decode, batch 2)
    Case("ring-prefill-zz-bf16-gqa", "ring", 4, workload=GQA | {"seq_len": 512, "prefix_len": 448, "passes": "fwd"}),
    Case("passq-prefill-zz-fp32", "pass-q", 4, workload={"seq_len": 512, "prefix_len": 448, "passes": "fwd",
                                                         "dtype": "fp32"}),
    Case("ring-decode-bf16", "ring", 4, workload=GQA | {"seq_len": 449, "prefix_len": 448, "passes": "fwd",
                                                          "batch": 2}),
    Case("passq-decode-contig-bf16", "pass-q", 4, workload=GQA | {"seq_len": 449, "prefix_len": 448,
                                                                    "passes": "fwd", "layout": "contiguous"}),
    Case("usp-decode-bf16", "usp", 4, knobs={"ulysses_degree": "2"},
         workload=GQA | {"seq_len": 450, "prefix_len": 448, "passes": "fwd"}),
    Case("mesh-prefill-bf16", "mesh", 4, knobs={"tile": "2x2"},
         workload=GQA | {"seq_len": 512, "prefix_len": 256, "passes": "fwd"}),
    # packed documents, each cut by zigzag on its own, with padding inside documents (one on 1 real token:
    # ranks 1-3 hold only its padding)
    Case("ring-perdoc-zz-bf16", "ring", 4, workload=GQA | {"seq_len": 512, "mask": "docs:100+4,1+7,396+4"}),
    Case("mesh-perdoc-zz-fp32", "mesh", 4, knobs={"tile": "2x2"},
         workload={"seq_len": 512, "mask": "docs:250+6,250+6", "dtype": "fp32"}),
    Case("charm-perdoc-zz-bf16", "charm", 4, knobs={"domains": "2"},
         workload={"seq_len": 512, "mask": "docs:60+4,440+8"}),
] + [Case(f"c7-hkv{k}-{m}", "ring", 4, workload={"seq_len": 256, "heads": 4, "kv_heads": k, "head_dim": 64,
                                                  "mask": m}) for k in (1, 2) for m in ("causal", "full")]
WORLD8 = [
    Case("mesh2x4-zz-causal-bf16-gqa", "mesh", 8, knobs={"tile": "2x4"}, workload={"kv_heads": 1}),
    Case("mesh2x4-contig-full-fp32-fwd", "mesh", 8, knobs={"tile": "2x4"},
         workload={"layout": "contiguous", "mask": "full", "dtype": "fp32", "passes": "fwd"}),
    Case("ring8-zz-causal-fp16", "ring", 8, workload={"dtype": "fp16"}),
    Case("rmplus8-contig-causal-bf16-desc", "rmplus", 8, knobs={"level_order": "descending"},
         workload={"layout": "contiguous"}),
    Case("charm2x4-zz-causal-bf16-gqa-fused", "charm", 8, knobs={"domains": "2", "query_order": "fused"},
         workload=GQA),
    Case("startrail-c2-zz-causal-bf16", "startrail", 8, knobs={"team_size": "2", "dkv_dtype": "bf16"}),
    Case("startrail-c2-full-fp32-gqa-fwd", "startrail", 8, knobs={"team_size": "2"},
         workload=GQA | {"mask": "full", "dtype": "fp32", "passes": "fwd"}),
    Case("tasp8-zz-causal-bf16-gqa-fwd", "tasp", 8, workload=GQA | {"seq_len": 1120, "passes": "fwd"}),
    Case("tasp8-contig-full-fp16-fwd", "tasp", 8, workload={"seq_len": 1120, "layout": "contiguous", "mask": "full",
                                                            "dtype": "fp16", "passes": "fwd"}),
    Case("loongtrain-u2w2-contig-causal-bf16-gqa", "loongtrain", 8, knobs={"ulysses_degree": "2", "inner_ring": "2"},
         workload=GQA | {"layout": "contiguous"}),
    Case("loongtrain-w4-full-fp32-bwd", "loongtrain", 8, knobs={"inner_ring": "4"},
         workload={"mask": "full", "dtype": "fp32", "passes": "bwd"}),
    Case("charm4x2-full-fp32-fwd", "charm", 8, knobs={"domains": "4"}, workload={"mask": "full", "dtype": "fp32",
                                                                                 "passes": "fwd"}),
    Case("merge8-zz-causal-fp16-wire", "merge", 8, knobs={"partial_dtype": "fp32", "dkv_dtype": "bf16"},
         workload={"dtype": "fp16"}),
    Case("ulysses8-contig-causal-bf16-repl", "ulysses", 8, workload={"heads": 8, "kv_heads": 2,
                                                                     "layout": "contiguous"}),
    Case("usp4x2-zz-causal-fp32-fwd", "usp", 8, knobs={"ulysses_degree": "4"},
         workload={"heads": 8, "kv_heads": 8, "dtype": "fp32", "passes": "fwd"}),
    Case("usp2x4-ringfirst-contig-causal-bf16-hops", "usp", 8,
         knobs={"ulysses_degree": "2", "rank_order": "ring-first", "dkv_hops": "n-1", "dkv_dtype": "bf16"},
         workload={"layout": "contiguous", "kv_heads": 2}),
]


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w1")
    case = Case("c2-w1", "ring", 1, workload={"seq_len": 512, "heads": 8, "kv_heads": 2, "head_dim": 64})
    return run_cases([case], folder), folder


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w2")
    for c in WORLD2:
        if "dump_dir" in c.run:
            c.run = c.run | {"dump_dir": str(folder / c.run["dump_dir"])}
    cases = WORLD2 + [
        Case("c1-lse-gap", "ring", 2, workload={"seq_len": 4096, "heads": 1, "kv_heads": 1, "head_dim": 128,
                                                  "passes": "fwd"},
             run={"inputs_path": str(c1_inputs(folder / "c1.npz"))}),
        Case("c5-padding", "ring", 2, workload={"seq_len": 8, "valid_len": 7, "heads": 1, "kv_heads": 1, "head_dim": 8,
                                                  "dtype": "fp16", "mask": "full", "passes": "fwd"},
             run={"inputs_path": str(c5_inputs(folder / "c5.npz")), "dump_dir": str(folder / "c5")}),
    ]
    return run_cases(cases, folder), folder


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w4")
    return run_cases(WORLD4, folder), folder


@pytest.fixture(scope="module")
def world8(tmp_path_factory):
    folder = tmp_path_factory.mktemp("w8")
    return run_cases(WORLD8, folder, timeout_s=240), folder


def _passed(result: dict) -> None:
    n = result["numerics"]
    bad = {k: (v["max_abs_err"], v["bound"]) for k, v in n["tensors"].items() if not v["passed"]}
    assert n["checked"] and n["passed"], f"numerics failed: {bad}"
    backward = "bwd" in result["passes"]
    assert set(n["tensors"]) == ({"dq", "dk", "dv"} if backward else set()) | (
        {"out", "lse"} if "fwd" in result["passes"] else set())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [c.name for c in WORLD2 if not c.name.startswith("bad")] + ["c1-lse-gap"])
def test_two_ranks_match_float64(world2, name):
    _passed(world2[0][name])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [c.name for c in WORLD4])
def test_four_ranks_match_float64(world4, name):
    _passed(world4[0][name])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", [c.name for c in WORLD8])
def test_eight_ranks_match_float64(world8, name):
    _passed(world8[0][name])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["bad-mask", "bad-kv"])
def test_edited_arithmetic_fails_numerics(world2, name):
    """The verifier accepts these edits; the executor obeys the file, so the numbers come out wrong."""
    n = world2[0][name]["numerics"]
    assert n["checked"] and n["passed"] is False
    assert max(t["max_abs_err"] / t["bound"] for t in n["tensors"].values()) > 3


@pytest.mark.timeout(600)
def test_c2_backward_error_does_not_grow_with_ranks(world1, world2, world4):
    """BUGCASES C2: bf16 causal zigzag, S = 512·W, Hq = 8, Hkv = 2, D = 64, W ∈ {1, 2, 4}."""
    for res in (world1[0]["c2-w1"], world2[0]["c2-w2"], world4[0]["c2-w4"]):
        for name in ("dq", "dk", "dv"):
            t = res["numerics"]["tensors"][name]
            assert t["max_abs_err"] <= t["bound"]


@pytest.mark.timeout(600)
def test_c5_padding_keeps_the_last_real_token(world2):
    """The 7 real tokens equal the unpadded float64 reference; the padding never contributes."""
    folder = world2[1]
    out = np.load(folder / "c5" / "out.npy")[0, :7, 0]                 # [7, D]
    x = np.array([1, 1, 1, 1, 2, 2, 2], dtype=np.float64)[:, None] * np.ones((7, 8))
    v = x * np.arange(1, 9)[None, :]
    s = x @ x.T / np.sqrt(8)
    p = np.exp(s - s.max(1, keepdims=True))
    ref = (p / p.sum(1, keepdims=True)) @ v
    assert np.abs(out - ref).max() <= 2 ** -11 * np.abs(ref).max() * 4
    assert out[6] == pytest.approx(ref[6], rel=1e-3)


@pytest.mark.timeout(600)
def test_normal_mode_overlaps_and_serialize_does_not(world2):
    results, folder = world2
    assert overlaps(results["ring-zz-causal-bf16-mha"], folder / "ring-zz-causal-bf16-mha.json")
    assert not overlaps(results["serialized"], folder / "serialized.json")
    assert results["serialized"]["settings"]["serialize"] is True


@pytest.mark.timeout(600)
def test_measurement_has_every_op_and_live_memory(world2):
    import json

    results, folder = world2
    doc = json.loads((folder / "ring-zz-causal-bf16-mha.json").read_text())
    res = results["ring-zz-causal-bf16-mha"]
    ids = {op["id"] for r in doc["ranks"] for op in r["ops"]}
    assert {op["id"] for r in res["ranks"] for op in r["ops"]} == ids
    assert all(0 <= op["start_s"] <= op["end_s"] for r in res["ranks"] for op in r["ops"])
    assert res["makespan_s"] == pytest.approx(sum(p["makespan_s"] for p in res["passes"].values()), rel=0.5)
    assert res["peak_memory_bytes"] > 0 and res["peak_memory_kind"] == "live-tensors"


@pytest.mark.timeout(600)
def test_c3_gradients_come_back_in_fp16(world2):
    """BUGCASES C3: fp16 inputs give fp16 gradients (not rounded through bf16) that meet the criterion."""
    folder = world2[1]
    for name in ("dq", "dk", "dv", "out"):
        x = np.load(folder / "c3" / f"{name}.npy")
        assert np.array_equal(x, x.astype(np.float16).astype(np.float32))
        bf16_exact = (x.astype(np.float32).view(np.uint32) & 0xFFFF) == 0     # what a bf16 round trip leaves
        assert not bf16_exact.all()


FULL = [Case(f"{a}-{lay}-{p}-{m}-hkv{h}-{d}", algo, 4, knobs=kn,
             workload={"seq_len": 256, "heads": 4, "kv_heads": h, "head_dim": 32, "layout": lay, "passes": p,
                       "mask": m, "dtype": d})
        for a, algo, kn, lay in (("ring", "ring", {}, "contiguous"), ("ring", "ring", {}, "zigzag"),
                                 ("passq", "pass-q", {}, "zigzag"), ("mesh", "mesh", {"tile": "2x2"}, "zigzag"))
        for p in ("fwd", "bwd", "fwd+bwd") for m in ("full", "causal") for h in (4, 1)
        for d in ("bf16", "fp16", "fp32")]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_full_product_on_four_ranks(tmp_path):
    """Every algorithm × pass × mask × heads × dtype (144 runs; ``pytest -m slow``)."""
    results = run_cases(FULL, tmp_path)
    failed = [name for name, r in results.items() if not r["numerics"]["passed"]]
    assert not failed, failed
