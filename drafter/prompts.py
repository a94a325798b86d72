"""Prompt files: JSON Lines, one object per line with exactly one of ``prompt`` (text),
``prompt_ids`` or ``messages`` (a chat: ``[{"role": "user", "content": "..."}, ...]``), and an
optional ``id``. Text is encoded with the tokenizer's default ``tokenizer(prompt)``; a chat is
rendered with the tokenizer's own chat template, ending with the assistant's turn to speak."""

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


ROLES = ("system", "user", "assistant")


def chat_prompt_ids(tokenizer, messages, where: str = "messages") -> list[int]:
    """``messages`` rendered with the tokenizer's chat template, ready for the assistant's answer."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES and isinstance(m["content"], str) for m in messages
    ):
        raise PromptFileError(f"{where}: 'messages' must be a non-empty list of {{'role': one of {', '.join(ROLES)}, "
                              "'content': text}")
    if getattr(tokenizer, "chat_template", None) is None:
        raise PromptFileError(f"{where}: this model's tokenizer has no chat template; give 'prompt' text instead")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt(obj, tokenizer, where: str, default_id: str) -> Prompt:
    if not isinstance(obj, dict) or sum(k in obj for k in ("prompt", "prompt_ids", "messages")) != 1:
        raise PromptFileError(f"{where}: need an object with exactly one of 'prompt', 'prompt_ids' or 'messages'")
    if "messages" in obj:
        ids = chat_prompt_ids(tokenizer, obj["messages"], where)
    elif "prompt_ids" in obj:
        ids = obj["prompt_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise PromptFileError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
    else:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string")
        ids = tokenizer(obj["prompt"])["input_ids"]
    return Prompt(str(obj.get("id", default_id)), [int(t) for t in ids])
