"""The JSON text's compiled loops (plan/json/_text.c). The reader's number scan (plan/json/number_scan.py), numpy's
and the compiled one, against a reference written with ``re``: the same skeleton, values, digit counts and leading
zeros, or the same refusal. The writer's stores (plan/json/text_rows.py: tests/plan/test_text_rows.py compares both
ways with f-strings) refuse an offset outside their buffer. And the loops are built where a C compiler is."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.algorithms import get
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json import compiled
from meshplan.plan.json.io import to_json_bytes
from meshplan.plan.json.number_scan import _ALLOWED_TABLE, _WORDISH_TABLE, ALLOWED, MAX_DIGITS, PAD, scan_numbers

BUILT = compiled.built()
WAYS = [False, pytest.param(True, marks=pytest.mark.skipif(not BUILT, reason="the compiled scan is not built"))]
_STRING_BEFORE = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_\"")


def reference(text: bytes):
    """(skeleton, values, digit counts, leading zeros) by ``re``, or None (a byte outside ALLOWED, a number of
    more than 19 digits)."""
    if any(c not in ALLOWED for c in text):
        return None
    out, values, lengths, zeros, pos = [], [], [], [], 0
    for m in re.finditer(rb"[0-9]+", text):
        digits = m.group()
        out.append(text[pos:m.start()])
        if m.start() and text[m.start() - 1] in _STRING_BEFORE:
            out.append(digits)                                  # a string's digits
        elif len(digits) > MAX_DIGITS:
            return None
        else:
            out.append(b"#")
            values.append(int(digits))
            lengths.append(len(digits))
            zeros.append(digits[:1] == b"0")
        pos = m.end()
    out.append(text[pos:])
    return b"".join(out), values, lengths, zeros


def assert_scans_as_reference(text: bytes, compiled: bool):
    got, want = scan_numbers(text, compiled=compiled), reference(text)
    if want is None:
        assert got is None
        return
    skeleton, numbers = got
    assert skeleton == want[0]
    assert numbers.value.dtype == np.uint64 and numbers.value.tolist() == want[1]
    assert numbers.length.tolist() == want[2] and numbers.zero.tolist() == want[3]


def build(name, knobs=None, **kw):
    w = resolve(**({"seq_len": "8K"} | kw))
    t = Topology.load("h100x8", gpus=4)
    alg = get(name)
    return alg.schedule(alg.plan(w, t, 4, alg.normalize(knobs or {})), t)


@pytest.mark.parametrize("compiled", WAYS)
@pytest.mark.parametrize("name,knobs,kw", [("ring", None, {}), ("usp", {"ulysses_degree": "2"}, {}),
                                           ("mesh", {"tile": "2x2"}, {"mask": "docs:3000,5192"}),
                                           ("pass-q", None, {"mask": "window:700", "valid_len": 8000})])
def test_a_written_schedule_s_tensors_and_ranks_scan_as_the_reference(name, knobs, kw, compiled):
    raw = to_json_bytes(build(name, knobs, **kw))
    parts = raw[raw.find(b',"tensors":[') + 1:]              # the frame's free text holds bytes outside ALLOWED
    assert reference(PAD + parts) is not None
    assert_scans_as_reference(PAD + parts, compiled)


_PIECES = [b"0", b"7", b"00", b"09", b"12345678", b"9" * 19, b"1" * 20, b"9" * 25, b"a", b"e", b"_", b'"', b".",
           b"+", b"-", b",", b":", b"[", b"]", b"{", b"}", b"},{", b" ", b"\xff", b"\\", b'"bf16"', b"kv2"]


@pytest.mark.parametrize("compiled", WAYS)
@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=40))
def test_fuzz_every_scan_reads_as_the_reference(pieces, compiled):
    """Digits after a letter, ``_`` or a quote (a string's, however long), numbers of up to 19 digits and past it,
    leading zeros, bytes outside what meshplan writes."""
    assert_scans_as_reference(PAD + b"".join(pieces) + b"}", compiled)


@pytest.mark.skipif(not BUILT, reason="the compiled scan is not built")
def test_the_compiled_scan_refuses_outputs_without_room():
    scan = compiled.text.scan
    text = PAD + b"1,2,3}"
    room = (len(text) + 1) // 2
    tables = (_ALLOWED_TABLE, _WORDISH_TABLE)
    with pytest.raises(ValueError, match="room"):
        scan(text, *tables, np.empty(room - 1, np.uint64), np.empty(room, np.uint8), np.empty(room, np.uint8))
    with pytest.raises(ValueError, match="256"):
        scan(text, b"", tables[1], np.empty(room, np.uint64), np.empty(room, np.uint8), np.empty(room, np.uint8))


@pytest.mark.skipif(not BUILT, reason="the compiled loops are not built")
def test_the_compiled_stores_refuse_what_is_out_of_range_and_write_nothing():
    out = bytearray(b"." * 10)
    i64 = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    compiled.text.put_literal(out, i64(0, 7), b"abc")
    compiled.text.put_ints(out, i64(3, 5), i64(2, 1), i64(7, 9))
    assert out == bytearray(b"abc079.abc")
    for bad in (i64(8), i64(-1)):
        with pytest.raises(ValueError, match="out of the buffer"):
            compiled.text.put_literal(out, i64(0, *bad), b"abc")
    for pos, size, value in ((9, 2, 12), (-1, 1, 1), (0, 0, 1), (0, 20, 1), (0, 1, -1)):
        with pytest.raises(ValueError, match="out of range"):
            compiled.text.put_ints(out, i64(0, pos), i64(1, size), i64(5, value))
    with pytest.raises(ValueError, match="differ in length"):
        compiled.text.put_ints(out, i64(0), i64(1, 1), i64(5))
    with pytest.raises(ValueError, match="int64"):
        compiled.text.put_literal(out, b"abc", b"x")
    assert out == bytearray(b"abc079.abc")                    # nothing written by a refused call


@pytest.mark.skipif(not BUILT, reason="the compiled loops are not built")
def test_the_compiled_stores_stay_in_the_buffer_when_their_offsets_overlap_it():
    """Offsets read from a view of the output itself, changed by an earlier store after every offset was checked:
    each is loaded once and checked again where it is used, so the call stops with ValueError inside the buffer. An
    offset array at any alignment is read whole; a literal that is a view of the output is copied as it was."""
    buf = np.zeros(64, np.uint8)
    pos = buf.view(np.int64)
    pos[:2] = [8, 16]                              # the first store (at 8) overwrites pos[1] with a huge offset
    with pytest.raises(ValueError, match="out of the buffer"):
        compiled.text.put_literal(buf, pos[:2], (1 << 44).to_bytes(8, "little"))
    buf[:] = 0
    pos[:2] = [8, 16]
    with pytest.raises(ValueError, match="out of range"):      # digits written into pos[1]
        compiled.text.put_ints(buf, pos[:2], np.array([8, 8], np.int64), np.array([12345678, 1], np.int64))
    odd = np.zeros(17, np.uint8)[1:].view(np.int64)             # misaligned
    odd[:] = [3, 0]
    out = bytearray(b"." * 8)
    compiled.text.put_literal(out, odd, b"ab")
    assert out == bytearray(b"ab.ab...")
    compiled.text.put_literal(out, np.array([2], np.int64), memoryview(out)[:5])     # overlapping: as it was
    assert out == bytearray(b"abab.ab.")


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: installs leave it out")
def test_the_compiled_loops_are_built_where_a_c_compiler_is():
    """setup.py builds them as optional (an install without a compiler goes on without it), so a C file that does
    not compile would fall back to numpy silently: this says so. Reinstall (``pip install -e .``) after editing it."""
    assert BUILT
