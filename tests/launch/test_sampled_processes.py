"""Real verifier and drafter processes over gRPC at T > 0: the first generated token follows the
demo target's own distribution, both with one root seed shared by every process (the streams
must still be independent: they are derived per role and name) and with no seed at all, and in
async rounds with transit decoding (the verifier decodes while a draft is on the way)."""

import json

import numpy as np
import pytest
import torch

from goodspeed.launch.cluster.local import launch_local
from goodspeed.launch.spec_files import load_spec
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.sampling import process_logits
from goodspeed.lm.decoding.params import SamplingParams
from statkit import fits

PROMPT = "def parse_args(argv):\n    parser = argparse."


@pytest.mark.slow
@pytest.mark.parametrize("root,verifier", [("seed = 0\n", ""), ("", ""), ("", 'rounds = "async"\ntransit_tokens = 4\n')],
                         ids=["shared-root", "no-seed", "async-transit"])
def test_sampled_processes_follow_the_target(tmp_path, root, verifier):
    target = load_causal_lm("demo:target")  # builds the demo models if needed
    prompt_ids = target.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt_ids": prompt_ids}) + "\n" for i in range(150)))
    drafters = "".join(
        f'[[drafters]]\nname = "d{i}"\ndraft = "demo:draft-distilled"\nprompts = "{prompts}"\nmax_new_tokens = 2\n'
        f"temperature = 1.0\n" for i in range(2))
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(root + '[verifier]\ntarget = "demo:target"\nbudget = 8\n' + verifier + drafters)
    summary = launch_local(load_spec(spec_path), tmp_path / "run", log=lambda *a: None, live=False)
    assert all(r["exit_code"] == 0 for r in summary["drafters"].values())
    assert summary["seed"] is not None and (root == "" or summary["seed"] == 0)
    records = [json.loads(line) for name in ("d0", "d1") for line in (tmp_path / "run" / f"{name}.jsonl").read_text().splitlines()]
    firsts = [r["token_ids"][0] for r in records]
    assert len(firsts) == 300
    assert (sum(r["transit_tokens"] for r in records) > 0) == bool(verifier)
    with torch.inference_mode():
        logits = target.model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].double()
    exact = process_logits(logits, SamplingParams(temperature=1.0)).numpy()
    ok, msg = fits(np.bincount(firsts, minlength=exact.size).astype(float), exact)
    assert ok, msg
