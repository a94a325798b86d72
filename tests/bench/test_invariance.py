"""``bench.bench_invariance``: its configs parsed, bad arguments refused before any model loads."""

import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # as `python -m bench.NAME` from the root

import bench.bench_invariance as bench  # noqa: E402


def test_configs_name_a_source_and_a_batch():
    assert bench.parse_configs("plain@8, ngram@1,suffix@8") == [("plain@8", "plain", 8), ("ngram@1", "ngram", 1),
                                                                ("suffix@8", "suffix", 8)]
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1 and bench.first_difference([1, 2], [1, 2, 3]) == 2
    assert doctest.testmod(bench).failed == 0


@pytest.mark.parametrize("argv", [["--configs", "model@8"], ["--configs", "ngram@0"], ["--configs", "ngram"],
                                  ["--modes", "fast"], ["--categories", "poetry"]])
def test_bad_arguments_are_refused_before_the_target_loads(argv, capsys):
    with pytest.raises(SystemExit) as done:
        bench.main(["--target", "no-such-model", *argv])
    assert done.value.code == 2 and "error" in capsys.readouterr().err
