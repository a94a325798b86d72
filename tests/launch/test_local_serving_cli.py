"""The daemon with --local-draft as a real process: text in, the target's greedy tokens out, via
``goodspeed generate``; and local-serving misconfiguration refused with a clear message."""

import json
import re
import subprocess
import time

import pytest
import torch
from transformers import AutoTokenizer

from goodspeed.launch import cli
from goodspeed.launch.cluster.local import verifier_command
from goodspeed.launch.spec import VerifierSpec
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.structured import Structure
from modelkit import adjusted_greedy_reference, greedy_reference, perturbed, save_models, tiny_llama

VOCAB = 300
REGEX = r"[a-z]{1,4}\(x\)"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target = tiny_llama(0, vocab=VOCAB)
    paths = save_models(tmp_path_factory.mktemp("models"), {"target": target, "draft": perturbed(target, 0.1, 1)}, VOCAB)
    return paths


def start(spec: VerifierSpec, log_path):
    log = open(log_path, "w")
    proc = subprocess.Popen(verifier_command(spec, log_path.parent), stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for line in open(log_path):
            if line.startswith("{") and json.loads(line)["event"] == "serving":
                return proc, f"127.0.0.1:{json.loads(line)['port']}"
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"verifier did not start:\n{open(log_path).read()[-3000:]}")


def test_text_prompt_through_the_daemon(model_dirs, tmp_path, capsys):
    spec = VerifierSpec(target=str(model_dirs["target"]), local_draft=str(model_dirs["draft"]), local_policy="adaserve", local_budget=12)
    proc, address = start(spec, tmp_path / "verifier.log")
    try:
        code = cli.main(["generate", "--verifier", address, "--max-new-tokens", "9", "--json", "--ignore-eos", "def f(x):"])
        out = json.loads(capsys.readouterr().out)
        penalised_code = cli.main(["generate", "--verifier", address, "--max-new-tokens", "12", "--json", "--ignore-eos",
                                   "--repetition-penalty", "1.5", "--presence-penalty", "1.0", "def f(x):"])
        penalised = json.loads(capsys.readouterr().out)
        shaped_code = cli.main(["generate", "--verifier", address, "--max-new-tokens", "12", "--json", "--regex", REGEX,
                                "def f(x):"])
        shaped = json.loads(capsys.readouterr().out)
    finally:
        proc.terminate()
        proc.wait(30)
    assert code == 0 and penalised_code == 0 and shaped_code == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["target"])
    assert out["prompt_ids"] == tokenizer("def f(x):", add_special_tokens=False)["input_ids"]
    target32 = tiny_llama(0, vocab=VOCAB, dtype=torch.float32)
    assert out["token_ids"] == greedy_reference(target32, out["prompt_ids"], 9)
    assert out["text"] == tokenizer.decode(out["token_ids"])
    # the penalties reach the verifier: its output is the target's own adjusted greedy decoding
    sampling = SamplingParams(repetition_penalty=1.5, presence_penalty=1.0)
    assert (penalised["token_ids"] == adjusted_greedy_reference(target32, out["prompt_ids"], sampling, 12)
            != greedy_reference(target32, out["prompt_ids"], 12))
    # so does a grammar: the target's constrained greedy decoding, ending at EOS
    sampling = SamplingParams(structured=Structure("regex", REGEX).bound(tokenizer))
    want = adjusted_greedy_reference(target32, out["prompt_ids"], sampling, 12, eos=tokenizer.eos_token_id)
    assert shaped["token_ids"] == want and want[-1] == tokenizer.eos_token_id
    assert re.fullmatch(REGEX, shaped["text"].removesuffix(tokenizer.eos_token))


def test_generate_refuses_bad_sampling_before_it_calls(capsys):
    assert cli.main(["generate", "--verifier", "127.0.0.1:9", "--presence-penalty", "3", "hi"]) == 2
    assert "presence_penalty" in capsys.readouterr().err
    assert cli.main(["generate", "--verifier", "127.0.0.1:9", "--regex", "a+", "--ignore-eos", "hi"]) == 2
    assert "--ignore-eos cannot be combined with structured output" in capsys.readouterr().err
    assert cli.main(["generate", "--verifier", "127.0.0.1:9", "--json-schema", "@/nonexistent/schema.json", "hi"]) == 2
    assert "schema.json" in capsys.readouterr().err


def test_turbospec_without_a_profile_is_refused(model_dirs, tmp_path):
    spec = VerifierSpec(target=str(model_dirs["target"]), local_draft=str(model_dirs["draft"]), local_policy="turbospec")
    result = subprocess.run(verifier_command(spec, tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "goodspeed profile" in result.stderr and "Traceback" not in result.stderr


def test_generate_says_it_is_waiting_then_that_no_verifier_answers(monkeypatch, capsys):
    """A wrong address is not a silent stall: after a moment it says what it waits for, then gives
    up with exit status 2 (the waits shortened here)."""
    import socket

    from goodspeed.launch import generate

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(generate, "SAY_WAITING_AFTER_S", 0.1)
    monkeypatch.setattr(generate, "CONNECT_TIMEOUT_S", 0.6)
    rc = generate.run_generate(f"127.0.0.1:{port}", generate.generate_request(prompt="hi"), as_json=True)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.index(f"waiting for a verifier at 127.0.0.1:{port}") < err.index(f"no verifier answers at 127.0.0.1:{port}")


def test_a_node_whose_api_port_is_taken_leaves_and_says_so(model_dirs, capsys):
    """`goodspeed drafter --serve` on a port in use: a one-line error naming it (status 2), after
    the node has left the verifier, not a traceback."""
    import socket

    from goodspeed.lm.models.loading import load_causal_lm
    from goodspeed.verifier.engine import EngineConfig, VerificationEngine
    from grpckit import ServerThread

    engine = VerificationEngine(load_causal_lm(str(model_dirs["target"])).model, EngineConfig())
    with socket.socket() as taken, ServerThread(engine) as server:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = cli.main(["drafter", "--verifier", server.address, "--draft", str(model_dirs["draft"]), "--serve", f"127.0.0.1:{port}"])
        left = [e for e in server.events() if e.get("reason") == "left"]
    assert rc == 2
    assert f"cannot serve the OpenAI API on 127.0.0.1:{port}" in capsys.readouterr().err
    assert left  # its session was given back
