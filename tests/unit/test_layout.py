"""Tensor layout (passes/layout): no two storages live at once share a byte, the arena
holds the peak, and a storage reuses what an earlier one gave back."""

from __future__ import annotations

import random

from autopar.passes.layout import arena


def _check(blocks, offsets, size):
    for a, (fa, la, sa) in enumerate(blocks):
        assert 0 <= offsets[a] and offsets[a] + sa <= size
        for b in range(a):
            fb, lb, sb = blocks[b]
            if sa and sb and fa <= lb and fb <= la:  # live at a common point
                assert offsets[a] + sa <= offsets[b] or offsets[b] + sb <= offsets[a]


def test_random_lifetimes_never_overlap_and_the_arena_holds_the_peak():
    rng = random.Random(0)
    for _ in range(50):
        blocks = []
        for _ in range(rng.randint(1, 60)):
            first = rng.randint(0, 40)
            blocks.append((first, first + rng.randint(0, 10), rng.randint(0, 1000)))
        offsets, size = arena(blocks)
        _check(blocks, offsets, size)
        peak = max(sum(s for f, la, s in blocks if f <= t <= la) for t in range(51))
        assert size >= peak


def test_a_storage_reuses_the_range_an_earlier_one_gave_back():
    # a and b live apart: b takes a's range; c lives beside b, above it
    blocks = [(0, 1, 100), (2, 3, 60), (2, 2, 40)]
    offsets, size = arena(blocks)
    assert size == 100  # the peak: nothing lost to fragmentation
    assert offsets[1] == 0 and offsets[2] == 60


def test_a_chain_of_temporaries_fits_in_two_slots():
    # each temporary is read by the next, then dies: two live at a time
    blocks = [(i, i + 1, 64) for i in range(10)]
    offsets, size = arena(blocks)
    _check(blocks, offsets, size)
    assert size == 128
