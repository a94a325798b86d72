"""packing.split_rows: the attention groups a packed forward's shared rows are split into."""

import itertools
import random

import pytest

from goodspeed.lm.runtime.packing import EXTRA_QUERIES, split_rows


def _cost(segments, sizes, ends, overhead):
    total = 0.0
    for a, b in segments:
        real = [r for r in range(a, b) if sizes[r]]
        total += overhead + (b - a) * max(ends[r] for r in real) * (max(sizes[r] for r in real) + EXTRA_QUERIES)
    return total


def _brute_force(sizes, ends, overhead):
    """The cheapest cover over every choice of segments: each boundary between rows is a cut or
    not, and each piece drops the rows without tokens at its edges."""
    n, best = len(sizes), None
    for cuts in itertools.product((False, True), repeat=n - 1):
        pieces, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                pieces.append((start, i))
                start = i
        pieces.append((start, n))
        segments = []
        for a, b in pieces:
            real = [r for r in range(a, b) if sizes[r]]
            if real:
                segments.append((real[0], real[-1] + 1))
        cost = _cost(segments, sizes, ends, overhead)
        if best is None or cost < best - 1e-9:
            best = cost
    return best


@pytest.mark.parametrize("seed", range(200))
def test_split_rows_is_the_cheapest_cover_a_brute_force_finds(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    sizes = [rng.choice([0, 0, 1, 1, 1, 2, 3, 7]) for _ in range(n)]
    ends = [rng.randint(1, 900) + s for s in sizes]
    overhead = rng.choice([0.0, 50.0, 1000.0, 4000.0, 1e6])
    segments = split_rows(sizes, ends, overhead)
    covered = [r for a, b in segments for r in range(a, b)]
    assert covered == sorted(set(covered))  # disjoint, in row order
    assert {r for r, s in enumerate(sizes) if s} <= set(covered)
    assert all(sizes[a] and sizes[b - 1] for a, b in segments)  # no segment starts or ends on an empty row
    if not any(sizes):
        assert segments == []
    else:
        assert _cost(segments, sizes, ends, overhead) == pytest.approx(_brute_force(sizes, ends, overhead))


def test_split_rows_without_an_overhead_keeps_one_group_from_the_first_row_with_tokens_to_the_last():
    assert split_rows([0, 1, 0, 7, 1, 0], [5] * 6, None) == [(1, 5)]
    assert split_rows([0, 0], [5, 5], None) == []


def test_a_long_row_among_short_ones_gets_a_group_of_its_own_and_equal_rows_share_one():
    assert split_rows([1, 1, 1, 7, 1, 1, 1, 1], [800] * 8, 4000.0) == [(0, 3), (3, 4), (4, 8)]
    assert split_rows([2] * 8, [800] * 8, 4000.0) == [(0, 8)]
