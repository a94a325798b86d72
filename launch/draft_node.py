"""``goodspeed drafter``: one edge draft node generating its prompt file through a verifier."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.prompts import load_prompts
from goodspeed.drafter.runner import DraftRunner
from goodspeed.lm.loading import load_causal_lm
from goodspeed.lm.sampling import SamplingParams


@dataclass(frozen=True)
class DrafterOptions:
    verifier: str
    draft: str
    prompts: str
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    out: str | None = None
    name: str = "drafter"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    connect_timeout_s: float = 60.0
    progress: bool = True


def run_drafter(opts: DrafterOptions) -> int:
    draft = load_causal_lm(opts.draft, dtype=opts.dtype, device=opts.device)
    prompts = load_prompts(opts.prompts, draft.tokenizer)
    eos = draft.tokenizer.eos_token_id
    config = DrafterConfig(
        verifier=opts.verifier, name=opts.name, model_name=opts.draft, fingerprint=draft.fingerprint,
        sampling=SamplingParams(opts.temperature, opts.top_k, opts.top_p), max_new_tokens=opts.max_new_tokens,
        eos_token_ids=(eos,) if eos is not None else (), seed=opts.seed, connect_timeout_s=opts.connect_timeout_s,
    )
    client = DrafterClient(config, DraftRunner(draft.model))
    out = open(opts.out, "w", encoding="utf-8") if opts.out else sys.stdout
    try:
        client.wait_until_serving()
        client.join()
        for prompt in tqdm(prompts, desc=opts.name, unit="req", disable=not opts.progress, file=sys.stderr):
            result = client.generate(prompt.id, prompt.prompt_ids)
            record = {
                "id": result.id, "prompt_ids": result.prompt_ids, "token_ids": result.token_ids,
                "text": draft.tokenizer.decode(result.token_ids), "rounds": result.rounds,
                "drafted_tokens": result.drafted_tokens, "accepted_tokens": result.accepted_tokens,
                "wall_s": round(result.wall_s, 6), "repairs": result.repairs,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
    finally:
        client.close()
        if out is not sys.stdout:
            out.close()
    return 0
