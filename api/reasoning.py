"""Reasoning models' thinking, apart from their answer: vLLM's ``--reasoning-parser`` on chat
completions.

Qwen3 and DeepSeek-R1 write their reasoning between ``<think>`` and ``</think>`` before the
answer. With a parser (``goodspeed verifier --reasoning-parser``, ``goodspeed drafter --serve ...
--reasoning-parser``) the reply's reasoning comes back apart from its ``content``: as
``reasoning_content`` (DeepSeek's API, SGLang's and Qwen-Agent's name) and as ``reasoning``
(vLLM's current name), in a response's message and in a stream's deltas; ``include_reasoning:
false`` (vLLM's) leaves it out. Tool calls (:mod:`goodspeed.api.tools`) are read from the content
only.

Where the reasoning starts is read off the prompt and the reply, not guessed from a model name:

* the rendered prompt leaves a ``<think>`` block open (DeepSeek-R1's template, Qwen3-2507's
  thinking models and Qwen3.5 put ``<think>`` in the generation prompt): the reply opens in its
  reasoning;
* otherwise the reply reasons only if it opens with ``<think>`` itself (Qwen3's first release);
  a prompt that closes the block (Qwen3 with ``enable_thinking: false`` renders
  ``<think>\\n\\n</think>``) then gets plain content;
* ``deepseek_r1`` also reads a reply as reasoning from its start when its template put no
  ``<think>`` in the prompt (R1's first template, whose replies sometimes leave it out).

The reasoning ends at ``</think>``; a reply that never closes it (cut at ``max_tokens``) is all
reasoning, as vLLM's parsers read it. The text after ``</think>`` is the content as the model
wrote it (Qwen3's blank line included, as vLLM's). Streamed, a ``</think>`` split across tokens is
held back until it is told apart, and the reasoning otherwise goes out as it is generated.

A grammar (structured output, a forced tool call) on a prompt that does not close the reasoning
holds the reply from its first ``</think>`` token on, as vLLM's: the reasoning is free and the
content matches the grammar (:class:`~goodspeed.lm.decoding.structured.Structure`'s ``after``; exact under
speculation as any grammar). A tokenizer without ``</think>`` as one token cannot mark that point:
such a request is refused (400) rather than answered with its reasoning held to the grammar.
"""

from __future__ import annotations

from goodspeed.api.text import held_back

PARSERS = ("qwen3", "deepseek_r1")  # the servers' --reasoning-parser
PARSER_HELP = ("tell a chat reply's reasoning (<think> ... </think>) from its content, returned as reasoning_content: "
               "qwen3 or deepseek_r1; unset: all content")
START, END = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` block open for the reply."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


def closes_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt holds a ``<think>`` block it closes last (thinking disabled)."""
    return prompt_text.rfind(END) > prompt_text.rfind(START) >= 0


def end_token(tokenizer) -> int | None:
    """The id of ``</think>`` where the tokenizer holds it as one token (Qwen3's, DeepSeek-R1's),
    else None."""
    ids = tokenizer.encode(END, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


class Reasoning:
    """One choice's reader: its reply's text in, ``(reasoning, content)`` pieces out."""

    def __init__(self, parser: str, prompt_text: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
        if opens_reasoning(prompt_text) or (parser == "deepseek_r1" and START not in prompt_text):
            self.state = "open"  # the reply is reasoning from its start (a <think> it repeats is dropped)
        else:
            self.state = "start"  # reasoning only if the reply opens with <think>
        self.buffer = ""

    def push(self, text: str) -> tuple[str, str]:
        """The reasoning and the content ``text`` lets out (text that may be a marker is held)."""
        self.buffer += text
        reasoning = ""
        if self.state in ("start", "open"):
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.state, self.buffer = "reasoning", head[len(START):]
            elif not head or START.startswith(head):
                return "", ""  # undecided yet
            else:
                self.state = "reasoning" if self.state == "open" else "content"
        if self.state == "reasoning":
            k = self.buffer.find(END)
            if k < 0:
                keep = held_back(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer, self.state = self.buffer[:k], self.buffer[k + len(END):], "content"
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What the end of the reply releases: held text, as what it was part of."""
        out, self.buffer = self.buffer, ""
        return (out, "") if self.state in ("reasoning", "open") else ("", out)
