"""A text of sized gzip members inflated as it is read finds what the whole text finds, and inflates no more than
the members it searched."""

from __future__ import annotations

import random

import pytest

from meshplan.core.gzip_members import MemberText, gunzip, gzip_member, text_of


def members(text: bytes, size: int) -> bytes:
    return b"".join(gzip_member(text[i:i + size]) for i in range(0, len(text), size))


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_find_across_members_is_the_whole_texts(ahead):
    """Patterns that fall inside a member, across two, at the start and the end, or nowhere; searches bounded by a
    stop before the end or beyond a member: the same position as ``bytes.find`` on the whole text."""
    rng = random.Random(ahead)
    text = b"".join(rng.choice([b'{"rank":', b'abc', b',{"ra', b'nk":', b'xyz' * 50]) for _ in range(40000))
    data = members(text, 10007)
    for pattern in (b',{"rank":', b'{"rank":', b"zzz", text[:5], text[-5:]):
        for start in (0, 5, 9990, 10000, 10006, 10007, 50000, len(text) - 3):
            for stop in (None, start + 50, start + 20015):
                lazy = text_of(data)
                assert isinstance(lazy, MemberText) and len(lazy) == len(text)
                want = text.find(pattern, start, len(text) if stop is None else min(stop, len(text)))
                got = lazy.find(pattern, start, None if stop is None else min(stop, len(text)), ahead=ahead)
                assert got == want, (pattern, start, stop)


def test_members_are_inflated_as_they_are_read():
    """A search inflates the members it passes, ``ensure`` a range's, ``whole`` all: the text is the file's."""
    text = bytes(range(256)) * 400
    data = members(text, 10000)
    lazy = text_of(data)
    assert lazy.find(bytes(range(10, 20)), 0) == 10 and sum(lazy._done) == 1
    lazy.ensure(25000, 25001)
    assert sum(lazy._done) == 2 and bytes(lazy.text[25000:25010]) == text[25000:25010]
    assert bytes(lazy.head()) == text[:10000]
    assert lazy.whole() == text == bytes(gunzip(data))
