"""``goodspeed drafter``: one edge draft node generating its prompt file through a verifier."""

from __future__ import annotations

import json
import sys

from tqdm import tqdm

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.credentials import client_tls, read_token
from goodspeed.drafter.prompts import load_prompts
from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.spec import DrafterSpec
from goodspeed.lm.loading import load_causal_lm
from goodspeed.lm.sampling import SamplingParams


def run_drafter(spec: DrafterSpec, verifier: str, out_path: str | None = None, connect_timeout_s: float = 60.0, progress: bool = True) -> int:
    """Generate ``spec``'s prompts through the verifier at ``verifier`` (HOST:PORT)."""
    draft = load_causal_lm(spec.draft, dtype=spec.dtype, device=spec.device)
    prompts = load_prompts(spec.prompt_path(), draft.tokenizer)[: spec.max_prompts]
    eos = draft.tokenizer.eos_token_id
    config = DrafterConfig(
        verifier=verifier, name=spec.name, model_name=spec.draft, fingerprint=draft.fingerprint,
        sampling=SamplingParams(spec.temperature, spec.top_k, spec.top_p), max_new_tokens=spec.max_new_tokens,
        eos_token_ids=(eos,) if eos is not None else (), seed=spec.seed, connect_timeout_s=connect_timeout_s,
        token=read_token(spec.token_file), tls=client_tls(spec.tls_ca, spec.tls_cert, spec.tls_key, spec.tls_server_name),
    )
    client = DrafterClient(config, DraftRunner(draft.model))
    if spec.seed is None:  # say which fresh root was drawn, so the run can be replayed with --seed
        print(f"drafter {spec.name}: root seed {client.root_seed}", file=sys.stderr)
    out = open(out_path, "w", encoding="utf-8") if out_path else sys.stdout
    try:
        client.wait_until_serving()
        client.join()
        for prompt in tqdm(prompts, desc=spec.name, unit="req", disable=not progress, file=sys.stderr):
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
