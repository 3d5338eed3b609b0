"""Document-length histograms: both file forms, bad files refused with one line, packs drawn exactly full and from
the histogram's distribution."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.core.errors import UserError
from meshplan.model.doc_lengths import draw_packs, read_doc_lengths


def _write(tmp_path, text: str):
    p = tmp_path / "lengths.csv"
    p.write_text(text)
    return p


def test_range_form(tmp_path):
    got = read_doc_lengths(_write(tmp_path, 'range,number,share\n"[1, 512]",300,x\n"[513, 2048]",100,y\n'))
    assert got.lo.tolist() == [1, 513] and got.hi.tolist() == [512, 2048] and got.count.tolist() == [300, 100]
    assert got.mean_tokens == pytest.approx((300 * 256.5 + 100 * 1280.5) / 400)


def test_length_form(tmp_path):
    got = read_doc_lengths(_write(tmp_path, "length,count\n100,3\n1000,1\n"))
    assert got.lo.tolist() == got.hi.tolist() == [100, 1000]
    assert got.mean_tokens == pytest.approx(1300 / 4)


@pytest.mark.parametrize("text,says", [
    ("a,b\n1,2\n", "no 'range' and 'number'"),
    ('range,number\n"[5, 2]",1\n', "line 2"),
    ('range,number\n"1-512",1\n', "is not"),
    ("length,count\n0,1\n", "line 2: length"),
    ("length,count\n10,-1\n", "count"),
    ("length,count\n10,many\n", "count"),
    ("length,count\n10,0\n", "no documents"),
    ("", "no 'range'"),
])
def test_bad_files_refused_in_one_line(tmp_path, text, says):
    with pytest.raises(UserError) as err:
        read_doc_lengths(_write(tmp_path, text))
    assert says in str(err.value) and str(err.value).startswith("--doc-lengths:") and "\n" not in str(err.value)


def test_missing_file_refused(tmp_path):
    with pytest.raises(UserError, match="cannot read"):
        read_doc_lengths(tmp_path / "nope.csv")


def test_packs_are_exactly_full_and_deterministic(tmp_path):
    dist = read_doc_lengths(_write(tmp_path, 'range,number\n"[1, 100]",5\n"[1000, 5000]",1\n'))
    packs = draw_packs(dist, 16384, 6, seed=3)
    assert len(packs) == 6
    for p in packs:
        assert p.sum() == 16384 and (p >= 1).all() and (p[:-1] <= 5000).all()
    again = draw_packs(dist, 16384, 6, seed=3)
    assert all((a == b).all() for a, b in zip(packs, again))


def test_pack_lengths_follow_the_histogram(tmp_path):
    # two single-length bins, 3:1: among whole documents (not the cut last one) a share of 3/4 has 10 tokens.
    # With n ~ 2,000 documents the share's sd is sqrt(p (1 - p) / n) ~ 0.01: 4 sd is 0.04.
    dist = read_doc_lengths(_write(tmp_path, "length,count\n10,3\n100,1\n"))
    whole = np.concatenate([p[:-1] for p in draw_packs(dist, 65536, 1, seed=0)])
    assert whole.size > 1500
    assert abs((whole == 10).mean() - 0.75) < 4 * np.sqrt(0.75 * 0.25 / whole.size)


@pytest.mark.parametrize("seq_len,batches,field", [(0, 1, "--seq-len"), (100, 0, "--batches")])
def test_bad_pack_sizes(tmp_path, seq_len, batches, field):
    dist = read_doc_lengths(_write(tmp_path, "length,count\n10,1\n"))
    with pytest.raises(UserError, match=field):
        draw_packs(dist, seq_len, batches)
