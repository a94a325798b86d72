"""``bench.bench_local_steps``: which runs ``--sources`` and ``--max-k`` make, and a bad
``--max-k`` refused before any model loads."""

import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as `python -m bench.NAME` from the root

import bench.bench_local_steps as bench  # noqa: E402


def test_each_source_runs_at_each_longest_draft_named_by_it_when_there_are_several():
    assert bench.runs_of(["ngram", "suffix/by-request"], "6") == {"ngram": ("ngram", 6),
                                                                 "suffix/by-request": ("suffix/by-request", 6)}
    assert bench.runs_of(["ngram", "suffix"], "6, 12") == {"ngram@6": ("ngram", 6), "ngram@12": ("ngram", 12),
                                                           "suffix@6": ("suffix", 6), "suffix@12": ("suffix", 12)}
    assert doctest.testmod(bench).failed == 0


@pytest.mark.parametrize("max_k", ["0", "x", "6,", "-2", "6,0"])
def test_a_bad_longest_draft_is_refused_before_the_target_loads(max_k, capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--target", "no-such-model", "--max-k", max_k])
    assert done.value.code == 2 and "--max-k" in capsys.readouterr().err
