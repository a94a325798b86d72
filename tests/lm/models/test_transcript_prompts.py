"""The large recipe's extra requests (goodspeed.lm.models.transcript_prompts): many, varied,
deterministic, of every kind the per-task benchmark measures, and none of them a benchmark task or
a shipped prompt, so a draft trained on their answers is measured on requests it has not seen."""

import json
from pathlib import Path

import pytest

from goodspeed.lm.models import distill
from goodspeed.lm.models.corpus import load_corpus, stdlib_files
from goodspeed.lm.models.transcript_prompts import large_chat_requests

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def requests():
    corpus = load_corpus(distill.LARGE_RECIPE.corpus_bytes)
    modules = sorted({p.stem for p in stdlib_files() if not p.stem.startswith("_")})
    return large_chat_requests(0, corpus.train_text, modules, distill._TASKS), (corpus.train_text, modules)


def test_they_are_many_varied_and_deterministic(requests):
    out, (text, modules) = requests
    assert len(out) == len(set(out)) > 1200
    assert large_chat_requests(0, text, modules, distill._TASKS) == out
    assert large_chat_requests(1, text, modules, distill._TASKS) != out
    kinds = {"Explain what this Python function does": 0, "Summarize this passage": 0, "Explain the main functions of the Python module": 0,
             "Give me three interesting facts about": 0, "Show a short Python example that": 0}
    for r in out:
        for k in kinds:
            kinds[k] += r.startswith(k)
    assert all(n >= 20 for n in kinds.values()), kinds


def test_none_is_a_benchmark_task_or_a_shipped_prompt(requests):
    out = set(requests[0]) | set(distill.chat_requests(0)) - distill._ALSO_A_BENCHMARK_TASK
    shipped = set()
    for path in [ROOT / "bench" / "workloads" / "tasks.jsonl", *(ROOT / "launch" / "prompts").glob("*.jsonl")]:
        for line in path.read_text().splitlines():
            shipped |= {m["content"] for m in json.loads(line).get("messages", []) if m["role"] == "user"}
    assert len(shipped) > 60
    assert not out & shipped
    assert distill._ALSO_A_BENCHMARK_TASK <= shipped  # what the large recipe leaves out of the default requests is one
