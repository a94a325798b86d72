"""A file-mode drafter with concurrency > 1 (goodspeed.launch.daemons.draft_node.generate_concurrently):
its prompts go through one edge node, several at a time, as one device; every output equals the
target's greedy decoding, in sync and async rounds."""

import asyncio
import io
import json

import pytest

from goodspeed.drafter.prompts import Prompt
from goodspeed.launch.daemons.draft_node import generate_concurrently, run_drafter
from goodspeed.launch.spec import DrafterSpec
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from grpckit import ServerThread
from modelkit import chat_pair, greedy_reference


@pytest.fixture(scope="module")
def models():
    return chat_pair()


def expected(models, ids, n):
    """The target's greedy continuation, ended at its first EOS as the verifier ends it."""
    out = greedy_reference(models[0], ids, n)
    eos = models[2].eos_token_id
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.mark.parametrize("rounds,transit", [("sync", 0), ("async", 0), ("async", 4)])
def test_prompts_generated_several_at_a_time_equal_the_targets_greedy_decoding(models, rounds, transit, monkeypatch):
    from goodspeed.lm.runtime.batch_draft import BatchDraftModel

    target, draft, tokenizer = models
    rollbacks = []  # after every verdict on a draft the node keeps the draft KV of the committed text and accepted drafts only
    rollback = BatchDraftModel.rollback
    monkeypatch.setattr(BatchDraftModel, "rollback", lambda self, *a: (rollbacks.append(a), rollback(self, *a))[1])
    texts = ["import os", "class A:", "def f(x):", "return None", "while True:", "import os"]  # a repeated prompt id too
    prompts = [Prompt("p" if i == 5 else f"p{i}", tokenizer(t, add_special_tokens=False)["input_ids"]) for i, t in enumerate(texts)]
    spec = DrafterSpec(name="phone", draft="unused", prompts="code", max_new_tokens=12, concurrency=3, seed=1)
    engine = VerificationEngine(target, EngineConfig(budget=8, max_draft_len=6, seed=5, transit_tokens=transit))
    out = io.StringIO()
    with ServerThread(engine, round_deadline_ms=500, target_name="tiny", rounds=rounds) as server:
        asyncio.run(generate_concurrently(spec, server.address, draft, tokenizer, "", prompts, out, progress=False))
        joins = server.events("join")
        round_rows = [d for e in server.events("round") for d in e["drafters"]]
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(p.id for p in prompts)
    for r in records:
        assert r["token_ids"] == expected(models, r["prompt_ids"], 12)
        assert r["rounds"] >= 1 and r["accepted_tokens"] <= r["drafted_tokens"] and r["repairs"] == 0
    assert len(joins) == 3  # one session per request in flight, reused by the six requests
    assert {d["name"] for d in round_rows} == {"phone"}  # one device name in the round log
    # several of the device's requests were verified in one step
    steps = {}
    for e in server.events("round"):
        steps[e["round"]] = sum(d["name"] == "phone" for d in e["drafters"])
    assert max(steps.values()) >= 2
    # With transit decoding, the node's requests whose drafts were away got tokens decoded for them;
    # every verdict on a draft (transit or not) rolled the draft KV back to the committed text and
    # accepted drafts, and no round that drafted nothing called the drafting thread for it.
    assert (sum(r["transit_tokens"] for r in records) > 0) == bool(transit)
    assert len(rollbacks) == sum(d["drafted"] > 0 for d in round_rows) < sum(r["rounds"] for r in records)
    assert sum(d["transit"] for d in round_rows) == sum(r["transit_tokens"] for r in records)


def test_concurrency_needs_proactive_drafting_off(models):
    spec = DrafterSpec(name="phone", draft="unused", prompts="code", concurrency=2, proactive=True)
    with pytest.raises(SystemExit, match="--no-proactive"):
        run_drafter(spec, "127.0.0.1:1")


@pytest.mark.parametrize("argv, said", [
    (["drafter", "--verifier", "127.0.0.1:1", "--draft", "demo:draft-tiny"], "give exactly one of --prompts FILE"),
    (["drafter", "--verifier", "127.0.0.1:1", "--draft", "demo:draft-tiny", "--prompts", "p.jsonl", "--serve", "127.0.0.1:0"],
     "(serve the OpenAI API), not both"),
    (["generate", "--verifier", "127.0.0.1:1"], "give exactly one of a prompt or --prompt-ids\n"),
    (["generate", "--verifier", "127.0.0.1:1", "--prompt-ids", "1,2", "hi"], "give exactly one of a prompt or --prompt-ids, not both"),
    (["drafter", "--verifier", "127.0.0.1:1", "--draft", "demo:draft-tiny", "--serve", "127.0.0.1:99999"],
     "--serve port must lie in 0..65535, got '127.0.0.1:99999'"),
    (["drafter", "--verifier", "nonsense", "--draft", "demo:draft-tiny", "--prompts", "p.jsonl"], "--verifier wants HOST:PORT"),
    (["generate", "--verifier", "nonsense", "hi"], "goodspeed generate: error: --verifier wants HOST:PORT"),
    (["loadgen", "--verifier", "h:0", "--baseline-tpot-ms", "5"], "--verifier port must lie in 1..65535"),
    (["verifier", "--target", "demo:target", "--metrics-port", "99999"], "metrics_port must lie in 0..65535"),
    (["drafter", "--verifier", "h:1", "--draft", "demo:draft-tiny", "--prompts", "p.jsonl", "--temperature", "-1"],
     "temperature must be finite and >= 0, got -1.0"),
    (["generate", "--verifier", "h:1", "--top-p", "0", "hi"], "goodspeed generate: error: top_p must lie in (0, 1]"),
    (["loadgen", "--verifier", "h:1", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["loadgen", "--verifier", "h:1", "--rate", "0"], "argument --rate: must be > 0.0, got 0"),
    (["profile", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["profile", "--cuda-graphs"], "goodspeed profile: --cuda-graphs needs a CUDA device, not cpu"),
    (["drafter", "--verifier", "h:1", "--draft", "demo:no-such-draft", "--prompts", "no-such.jsonl"],
     "prompts 'no-such.jsonl' is neither a shipped set"),  # said before the (missing) draft would load
])
def test_the_cli_says_what_is_wrong_with_its_input(argv, said, capsys):
    """Neither of two exclusive inputs, or both (the message says which), or an address that is
    no HOST:PORT or no port: refused at once, before any model loads or any connection waits."""
    from goodspeed.launch.cli import main

    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    assert rc == 2
    assert said in capsys.readouterr().err


def test_a_draft_source_without_a_model_needs_the_targets_tokenizer(capsys):
    from goodspeed.launch.cli import drafter_settings

    with pytest.raises(SystemExit):
        drafter_settings(["--verifier", "h:1", "--draft", "suffix", "--serve", "127.0.0.1:1"])
    assert "loads no model: give --tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        drafter_settings(["--verifier", "h:1", "--draft", "lookup+x/y", "--serve", "127.0.0.1:1"])
    assert "unknown lookup 'lookup'" in capsys.readouterr().err
    spec, _ = drafter_settings(["--verifier", "h:1", "--draft", "suffix", "--tokenizer", "demo:target", "--serve", "127.0.0.1:1"])
    assert (spec.draft, spec.tokenizer) == ("suffix", "demo:target")
