"""``bench.bench_local_steps``: which runs ``--sources`` and ``--max-k`` make, and a bad
``--max-k`` refused before any model loads."""

import doctest
import json
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


def test_every_other_repeat_runs_the_sources_in_reverse_order_and_each_is_timed_against_its_repeats_plain_run(monkeypatch,
                                                                                                              tmp_path):
    """A drifting machine weighs on plain decoding as on each source: repeat 0 runs plain first,
    repeat 1 last, and each speedup is over the same repeat's plain run."""
    from types import SimpleNamespace

    order = []

    def run(engine, prompts, source, eos, clock, dtype="auto", max_k=6):
        order.append((source, max_k))
        return {"tok_s": 100.0 if source == "plain" else 150.0, "steps": 1, "drafted": 0, "accepted": 0, "drafting_s": 0.0,
                "round_s": 0.0, "gc_s": 0.0, "gc_collections": [0, 0, 0], "step_costs_ms": None}

    tokenizer = SimpleNamespace(eos_token_id=0)
    monkeypatch.setattr(bench, "load_causal_lm", lambda name, dtype: SimpleNamespace(tokenizer=tokenizer, model=None))
    monkeypatch.setattr(bench, "VerificationEngine", lambda model, config: None)
    monkeypatch.setattr(bench, "chat_prompt_ids", lambda tok, messages: [1, 2, 3])
    monkeypatch.setattr(bench, "run", run)
    out = tmp_path / "steps.json"
    assert bench.main(["--categories", "open-chat", "--sources", "ngram", "--max-k", "6,12", "--repeats", "2",
                       "--json", str(out)]) == 0
    assert order[1:] == [("plain", 0), ("ngram", 6), ("ngram", 12), ("ngram", 12), ("ngram", 6), ("plain", 0)]  # [0]: warm-up
    runs = json.loads(out.read_text())["runs"]
    assert [(r["repeat"], r["source"], r["speedup"]) for r in runs] == [
        (0, "plain", 1.0), (0, "ngram@6", 1.5), (0, "ngram@12", 1.5), (1, "plain", 1.0), (1, "ngram@6", 1.5), (1, "ngram@12", 1.5)]
