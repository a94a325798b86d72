"""Prompt files: JSON Lines, one object per line with ``prompt`` (text) or ``prompt_ids``, and an
optional ``id``. Text is encoded with the tokenizer's default ``tokenizer(prompt)``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt_ids: list[int]


class PromptFileError(ValueError):
    """A prompt file line that is not a valid prompt object; the message names the line."""


def load_prompts(path: str | Path, tokenizer) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{path}:{number}: not JSON ({exc.msg})") from None
        prompts.append(_prompt(obj, tokenizer, f"{path}:{number}", default_id=str(len(prompts))))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def _prompt(obj, tokenizer, where: str, default_id: str) -> Prompt:
    if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
        raise PromptFileError(f"{where}: need an object with exactly one of 'prompt' or 'prompt_ids'")
    if "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise PromptFileError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
    else:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
        ids = tokenizer(obj["prompt"])["input_ids"]
    return Prompt(str(obj.get("id", default_id)), [int(t) for t in ids])
