"""Incremental detokenization with stop strings, for streaming responses.

Decoding the whole output after every token costs O(n^2); decoding one token at a time is wrong
for byte-level BPE (a character can span tokens, and some tokenizers' decoders merge spaces). So,
like vLLM's incremental detokenizer, each step decodes a short window: the tokens from
``prefix_offset`` and those from ``prefix_offset`` to ``read_offset``; the new text is the
difference. A window that ends in U+FFFD (an incomplete UTF-8 sequence) is held until the next
token completes it.

Stop strings: the text is searched as it grows; at a match the output ends just before the stop
string (OpenAI's behaviour; with ``include_stop``, vLLM's ``include_stop_str_in_output``, just
after it) and no later token is consumed. While streaming, the longest tail that could still begin
a stop string is held back, so a client never sees text that a stop string later removes.

A stop token (EOS, or one of vLLM's ``stop_token_ids``) that ends the generation is consumed but
its text is left out, unless ``include_stop``: as vLLM's detokenizer does.

``stop_reason`` is vLLM's: the stop string that ended the text, or the stop token id that ended
it; None when EOS ended it (vLLM checks EOS first, so an id that is both is EOS) or nothing did.

``min_tokens`` (vLLM's): no stop string is matched that ends within the text of the first
``min_tokens`` tokens (as vLLM's detokenizer: the search starts after that text, less a stop
string's length, so a stop string that runs past it still matches).
"""

from __future__ import annotations

from collections.abc import Sequence

INLINE_CHARS = 8192  # texts up to this long are tokenized or decoded on the event loop (about 1 ms at most)

def held_back(text: str, marker: str, above: int = 0) -> int:
    """How many characters at the end of ``text`` may still begin ``marker`` (the most, if more
    than ``above``; else 0): text a stream holds back until the next piece tells whether the
    marker follows."""
    for k in range(min(len(marker) - 1, len(text)), above, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True, include_stop: bool = False,
                 stop_token_ids: Sequence[int] = (), min_tokens: int = 0, eos_token_id: int | None = None) -> None:
        """``stop_token_ids``: the tokens that end the generation (the request's EOS and stop token
        ids; the backend's output ends at the first of them); ``eos_token_id``: the one of them
        that is EOS (None with ``ignore_eos``), which ends the text with no ``stop_reason``."""
        self.tokenizer, self.stop, self.skip_special, self.include_stop = tokenizer, list(stop), skip_special_tokens, include_stop
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.min_tokens = min_tokens
        self.ids: list[int] = []  # the tokens decoded
        self.consumed_ids: list[int] = []  # the tokens consumed: those decoded, and a stop token left out of the text
        self.text = ""  # everything decoded so far (emitted + held back)
        self.emitted = 0  # characters of ``text`` handed out
        self.stopped = False
        self.eos_token_id = eos_token_id
        self.matched: str | None = None  # the stop string that ended the text
        self.ending_token: int | None = None  # the stop token (EOS, stop_token_ids) that ended it
        self._prefix_offset = self._read_offset = 0
        self._searched = 0  # stop strings are searched from here (minus the longest stop's length)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _delta(self, allow_incomplete: bool = False) -> str:
        """Text the tokens after ``read_offset`` add (vLLM's incremental step)."""
        prefix = self._decode(self.ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not allow_incomplete):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return full[len(prefix) :]

    def _push_one(self, token: int) -> None:
        self.ids.append(int(token))
        self.text += self._delta()

    @property
    def consumed(self) -> int:
        """Tokens consumed (a stop string's match ends consumption)."""
        return len(self.consumed_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Consume tokens (until a stop string matches); returns the text now safe to emit."""
        for token in token_ids:
            if self.stopped:
                break
            self.consumed_ids.append(int(token))
            if int(token) in self.stop_token_ids:
                self.ending_token = int(token)  # the generation's last token
                if not self.include_stop:
                    break  # consumed, not decoded
            self._push_one(token)
            if self.consumed <= self.min_tokens:  # the text may not end yet: searched from past it
                self._searched = len(self.text)
            elif self.stop and self._find_stop():
                break
        return self._take(final=self.stopped)

    def _find_stop(self) -> bool:
        # each stop string from where it could end in the new text (a match within the old was found before)
        hits = [(i, len(s), s) for i, s in ((self.text.find(s, max(0, self._searched - len(s) + 1)), s) for s in self.stop) if i >= 0]
        self._searched = len(self.text)
        if not hits:
            return False
        at, length, which = min(hits, key=lambda hit: hit[0])  # the earliest match (the first listed of those there)
        self.text, self.stopped, self.matched = self.text[: at + length if self.include_stop else at], True, which
        return True

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's ``stop_reason``: the stop string or the stop token id that ended the text; None
        for EOS, or while nothing has ended it."""
        if self.matched is not None:
            return self.matched
        return None if self.ending_token == self.eos_token_id else self.ending_token

    def _held(self) -> int:
        """Characters at the end of ``text`` that may still begin a stop string (none when a
        match keeps the stop string: the text up to it is emitted either way)."""
        if self.include_stop:
            return 0
        held = 0
        for s in self.stop:
            held = max(held, held_back(self.text, s, held))
        return held

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held()
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out

    def finish(self) -> str:
        """The text still held back once generation ended without a stop string (an incomplete
        character at the very end comes out as U+FFFD rather than being lost)."""
        if not self.stopped:
            self.text += self._delta(allow_incomplete=True)
        return self._take(final=True)
