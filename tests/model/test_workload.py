"""Units and workloads: suffixes, presets, precedence, one-line errors."""

from __future__ import annotations

import pytest

from meshplan.core.errors import UserError
from meshplan.core.units import parse_bytes, parse_count
from meshplan.model.workload import Mask, resolve


def test_suffixes():
    assert parse_count("1M", "x") == 1_048_576 and parse_count("128K", "x") == 131_072
    assert parse_count(4096, "x") == 4096
    assert parse_bytes("80GiB", "x") == 80 * 2**30 and parse_bytes("64GB", "x") == 64_000_000_000
    for bad in ("1.5.2", "-3", "0", "12Q"):
        with pytest.raises(UserError):
            parse_count(bad, "--seq-len")


def test_defaults_and_presets():
    w = resolve()
    assert (w.model, w.seq_len, w.batch, w.dtype, w.mask.kind, w.layout, w.passes) == \
        ("llama3-8b", 2**20, 1, "bf16", "causal", "zigzag", "fwd+bwd")
    assert (w.n_heads, w.n_kv_heads, w.head_dim, w.gqa_group) == (32, 8, 128, 4)
    assert (resolve(model="llama3-70b").n_heads, resolve(model="llama3-70b").n_kv_heads) == (64, 8)
    c = resolve(model="charm-h100")
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.mask.kind) == (12, 12, 192, "full")


def test_explicit_flags_override_the_preset():
    w = resolve(model="charm-h100", heads=24, mask="causal")
    assert w.n_heads == 24 and w.n_kv_heads == 12 and w.mask.kind == "causal"


def test_masks_round_trip():
    for text in ("full", "causal", "window:4096", "docs:100,200,300"):
        assert Mask.parse(text).spec() == text
    assert Mask.parse("window:4K").window == 4096


@pytest.mark.parametrize("kw,flag", [
    ({"kv_heads": 5}, "--kv-heads"), ({"dtype": "fp8"}, "--dtype"), ({"layout": "spiral"}, "--layout"),
    ({"passes": "sideways"}, "--pass"), ({"valid_len": "2M"}, "--valid-len"), ({"model": "nope"}, "--model"),
    ({"mask": "docs:10,20", "seq_len": 100}, "--mask"), ({"batch": 0}, "--batch"),
])
def test_errors_name_the_flag(kw, flag):
    with pytest.raises(UserError) as err:
        resolve(**kw)
    assert str(err.value).startswith(flag) and "\n" not in str(err.value)
