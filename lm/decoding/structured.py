"""Structured output: a grammar every generated text must match, exact under speculation.

vLLM's structured outputs (``structured_outputs`` / ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, OpenAI's ``response_format``) constrain sampling: at each
position, a token the grammar cannot continue with gets a logit of -inf, so the target's
distribution there is its own renormalized over the tokens that keep the text inside the grammar
(vLLM's definition; the grammar then ends the text with EOS once it is complete). The grammar is
compiled to a token-level matcher by llguidance (Microsoft's, the engine behind vLLM's "guidance"
backend), which computes each position's allowed tokens as a bitmask over the vocabulary.

Speculation: a drafted row's position ``j`` reads the text up to it, the committed output plus the
drafted tokens before it (:func:`~goodspeed.lm.decoding.adjust.adjust_logits`' ``paths``), so the mask at
``j`` is the matcher's after consuming those tokens. :meth:`Constraint.masks` walks the row's
paths (a chain's prefixes, a tree's root-to-node paths) consuming and rolling back, and leaves the
matcher where the committed text left it. A position whose path the grammar refuses cannot be
reached under the target (the refused token had probability 0 there), so its logits are left as
they are: verification rejects the refused token before it reads them. The target's adjusted
distribution at every reachable position is the one plain constrained decoding samples from, and
rejection sampling stays exact against it; the draft applies the same masks, so it never drafts a
token the grammar refuses (one that would always be rejected).

A reasoning model's reply (:mod:`goodspeed.api.reasoning`) may hold its grammar back until its
reasoning ends, as vLLM does: a structure with ``after`` set holds the text that follows the first
``after`` token (``</think>``) of the output, and every token before it is free (no mask). The mask
is still a function of the position's text alone, so speculation stays exact the same way.

A :class:`Structure` is what a request asks for (a kind and its text); :meth:`Structure.bound`
compiles it against a tokenizer (a bad grammar is refused there, before the request is queued), and
each request's :class:`~goodspeed.lm.decoding.history.TokenHistory` holds a :class:`Constraint`, its own
matcher, extended with each committed token.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import llguidance
import numpy as np

from goodspeed.lm.runtime.heap import trim_heap

# The kinds of constraint (vLLM's ``StructuredOutputsParams`` fields); ``json_object`` is any
# JSON object (OpenAI's ``response_format: {"type": "json_object"}``).
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# The most characters a grammar's text may hold (a JSON schema, a regex, a Lark or GBNF grammar, the
# choices as JSON); llguidance bounds the compiled grammar's size and each step's work besides.
MAX_SPEC_CHARS = 256 * 1024
# The deepest nesting a JSON value read from a client may have: a JSON schema's, and (goodspeed.api)
# a request body's, which carries schemas. Deeper is refused by name, never a RecursionError.
MAX_JSON_DEPTH = 100


class JsonTooDeep(ValueError):
    """JSON nested deeper than :data:`MAX_JSON_DEPTH`."""


def json_depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests arrays and objects: 0 for a scalar, 1 for ``[]``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def loads_bounded(text: str | bytes, what: str = "the JSON"):
    """``json.loads(text)``, refusing nesting deeper than :data:`MAX_JSON_DEPTH` with a
    :class:`JsonTooDeep` that names the limit (a ``ValueError``, as ``json.JSONDecodeError`` is)."""
    try:
        value = json.loads(text)
    except RecursionError:
        value = None
    else:
        if json_depth(value) <= MAX_JSON_DEPTH:
            return value
    raise JsonTooDeep(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels (arrays and objects)")


class StructureError(ValueError):
    """A grammar that cannot be compiled, or a committed text the grammar refuses."""


@dataclass(frozen=True)
class Structure:
    """A request's constraint: ``kind`` (one of :data:`KINDS`) and ``spec``, its text (a JSON
    schema as JSON, a regex, the choices as a JSON list of strings, a Lark or GBNF grammar; empty
    for ``json_object``); ``any_whitespace`` False: JSON without whitespace between its tokens;
    ``after``: a token id the grammar waits for (it holds the output after the first such token,
    none before: a reasoning model's ``</think>``), None: from the first token. Unbound until
    :meth:`bound` compiles it against a tokenizer; only a bound one makes matchers. Equality is
    the kind, text, whitespace and ``after``."""

    kind: str
    spec: str = ""
    # JSON kinds: any whitespace between tokens; False (the default, as OpenAI's structured outputs
    # write JSON): none, which forces more tokens (drafted for free) and keeps a weak model from
    # filling max_tokens with newlines the grammar allows
    any_whitespace: bool = False
    grammar: str | None = field(default=None, compare=False, repr=False)  # llguidance's, once bound
    tokenizer: object = field(default=None, compare=False, repr=False)  # llguidance.LLTokenizer, once bound
    # A fresh matcher, its first mask computed: each request's is a copy (bench_structured, a
    # 40-field schema at V = 49,152: a copy with its first mask 0.13 ms, against 2.6 ms to build one)
    template: object = field(default=None, compare=False, repr=False)
    after: int | None = None

    def __post_init__(self) -> None:
        if self.after is not None and not (isinstance(self.after, int) and self.after >= 0):
            raise StructureError(f"after must be a token id (an int >= 0), got {self.after!r}")
        if self.kind not in KINDS:
            raise StructureError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise StructureError(f"a {self.kind} constraint may hold at most {MAX_SPEC_CHARS} characters, got {len(self.spec)}")
        if self.kind == "json_object" and self.spec:
            raise StructureError("json_object takes no text")
        if self.kind != "json_object" and not self.spec:
            raise StructureError(f"the {self.kind} constraint is empty")

    @property
    def is_bound(self) -> bool:
        return self.tokenizer is not None

    def bound(self, hf_tokenizer) -> Structure:
        """This constraint compiled against ``hf_tokenizer`` (a fast Hugging Face tokenizer);
        :class:`StructureError` with llguidance's message if it does not compile. Takes about a
        second the first time a tokenizer is seen (its vocabulary is indexed once and cached)."""
        grammar = _llguidance_grammar(self.kind, self.spec, self.any_whitespace)
        tokenizer = llguidance_tokenizer(hf_tokenizer)
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)
        if problem:
            raise StructureError(f"the {self.kind} constraint does not compile: {_first_line(problem)}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
        template.compute_bitmask()
        if template.is_error():
            raise StructureError(f"the {self.kind} constraint does not compile: {_first_line(template.get_error())}")
        return Structure(self.kind, self.spec, self.any_whitespace, grammar, tokenizer, template, self.after)

    def constraint(self, output: Sequence[int] = ()) -> Constraint:
        """A fresh matcher for one request, having consumed ``output`` (its generated tokens so far)."""
        if not self.is_bound:
            raise StructureError("this structured output constraint is not bound to a tokenizer (Structure.bound)")
        return Constraint(self, output)


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else message
    return line[:500]


def _llguidance_grammar(kind: str, spec: str, any_whitespace: bool = False) -> str:
    options = None if any_whitespace else {"whitespace_flexible": False}
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        if kind == "json":
            schema = loads_bounded(spec, "the JSON schema")
            if not isinstance(schema, (dict, bool)):
                raise StructureError("a json constraint is a JSON schema: an object (or true / false)")
            return llguidance.LLMatcher.grammar_from_json_schema(schema if isinstance(schema, dict) else
                                                                 ({} if schema else {"not": {}}), overrides=options)
        if kind == "choice":
            choices = loads_bounded(spec, "the choices")
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                raise StructureError("a choice constraint is a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF (llama.cpp's) converted to Lark
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        if isinstance(exc, StructureError):
            raise
        raise StructureError(f"the {kind} constraint does not parse: {_first_line(str(exc))}") from None


# llguidance's default limits (by its own speed estimates, at most about 15 ms of lexer work and
# 2.5 ms of parser work a mask), without the parser's state in error messages: a client's grammar is
# refused with a line it can read.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)

# One llguidance tokenizer per Hugging Face tokenizer object (indexing a vocabulary takes ~1 s).
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()
# Whether llguidance's views are built with its slices: token tries over classes of tokens (those a
# JSON string may hold, ...) that make a mask over a large vocabulary about twice as fast, for ~12 MB
# on SmolLM2's 49,152 tokens (docs/MEASUREMENTS.md *Memory of a node with no draft model*). A
# process short of memory turns them off before its first grammar (:func:`use_mask_slices`).
_SLICES = {"on": True}


def use_mask_slices(on: bool) -> None:
    """Build llguidance's views from now on with its slices (the default) or without: an edge node
    drafting by lookup alone, on a device where memory is the constraint, goes without."""
    _SLICES["on"] = on


def llguidance_tokenizer(hf_tokenizer):
    """llguidance's view of ``hf_tokenizer``, built once per tokenizer object.

    A byte-level BPE tokenizer (GPT-2's, Llama 3's, Qwen's, SmolLM2's) is handed to llguidance as
    its tokens' bytes and a callback into the tokenizer itself (:func:`shared_view`), so the
    process holds one Rust tokenizer; any other goes through ``llguidance.hf.from_tokenizer``,
    which gives llguidance its own copy (about 22 MB more on SmolLM2's: docs/MEASUREMENTS.md
    *Memory of a node with no draft model*)."""
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(hf_tokenizer)
        if cached is None:
            cached = shared_view(hf_tokenizer)
            if cached is None:
                import llguidance.hf  # imports transformers: only where a tokenizer is at hand

                try:
                    cached = llguidance.hf.from_tokenizer(hf_tokenizer, slices=None if _SLICES["on"] else [])
                except ValueError as exc:
                    raise StructureError(f"structured output needs a fast tokenizer: {exc}") from None
            _TOKENIZERS[hf_tokenizer] = cached
            trim_heap()  # what building it freed (goodspeed.lm.runtime.heap)
        return cached


def shared_view(hf_tokenizer):
    """llguidance's tokenizer over ``hf_tokenizer``'s own Rust tokenizer, or None where that is
    not a byte-level BPE (its tokens' bytes are then not read off here).

    llguidance needs each token's bytes (its token trie, from which masks are computed) and a way
    to tokenize text (the forced bytes it turns into tokens). The bytes are read as the tokenizer's
    ByteLevel decoder reads them, added tokens included: each character of a token's string maps
    back to one byte (GPT-2's byte-to-unicode table), and a token with a character outside that
    table (an added token's text with a space, say) is its UTF-8; special tokens are named as
    such. Tokenizing calls the tokenizer with no special tokens added, on valid UTF-8 (llguidance
    tokenizes any invalid tail greedily itself), as ``from_tokenizer``'s copy does.
    ``tests/lm/decoding/test_structured.py`` checks both views agree token by token and mask by
    mask on a tokenizer built as the demo's are (with added and special tokens) and on SmolLM2's."""
    import tokenizers

    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if not (isinstance(backend, tokenizers.Tokenizer) and isinstance(backend.model, tokenizers.models.BPE)
            and isinstance(backend.decoder, tokenizers.decoders.ByteLevel)):
        return None
    added = backend.get_added_tokens_decoder()
    to_byte = _unicode_to_byte()
    tokens = []
    for i in range(backend.get_vocab_size(with_added_tokens=True)):
        text = backend.id_to_token(i)
        if text is None:
            return None  # a hole in the ids: left to llguidance's own reading
        chars = [to_byte.get(c) for c in text]
        tokens.append(text.encode() if None in chars else bytes(chars))

    class View:
        eos_token_id = hf_tokenizer.eos_token_id
        bos_token_id = hf_tokenizer.bos_token_id
        special_token_ids = sorted(i for i, t in added.items() if t.special)

        def __init__(self) -> None:
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            if not isinstance(text, str):  # llguidance then hands over text, never bytes
                raise TypeError("text only")
            return backend.encode(text, add_special_tokens=False).ids

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(View()), slices=None if _SLICES["on"] else [])


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte-level table read backwards: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(shifted)}}


class Constraint:
    """One request's matcher: where its committed text stands in the grammar.

    :meth:`extend` consumes committed tokens (each must be allowed: the target's adjusted
    distribution gives the others probability 0, so a refused one is a bug or a forged resume and
    raises :class:`StructureError`). :meth:`masks` gives the allowed tokens at each position of a
    speculative row and leaves the matcher as it found it.

    A grammar may pass its check and still exceed llguidance's per-step limits later (a client's
    grammar crafted to: :data:`LIMITS`). The matcher then cannot go on; the constraint records the
    ``failure``, its masks allow EOS alone from then on, so the step ends the request at once, and
    the engine gives the request ``error: ...`` as its finish reason (nothing else in the step is
    affected)."""

    def __init__(self, structure: Structure, output: Sequence[int] = ()) -> None:
        self.structure = structure
        self.matcher = structure.template.deep_copy()
        self.eos = frozenset(structure.tokenizer.eos_tokens)
        self.vocab_size = structure.tokenizer.vocab_size
        self.words = (self.vocab_size + 31) // 32  # int32 words of a mask
        self.failure: str | None = None
        self.after = structure.after
        self.open = self.after is None  # the grammar holds the text from here on
        self.extend(output)

    def copy(self) -> "Constraint":
        """An independent copy at the same place in the grammar (the matcher deep-copied)."""
        other = object.__new__(Constraint)
        other.__dict__.update(self.__dict__)
        other.matcher = self.matcher.deep_copy()
        return other

    def _held(self, path: list[int]) -> list[int] | None:
        """The part of ``path`` (tokens past the committed text) the grammar holds: all of it once
        open, else what follows its first ``after`` token; None where there is none yet."""
        if self.open:
            return path
        return path[path.index(self.after) + 1:] if self.after in path else None

    def extend(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if not self.open:
            if self.after not in tokens:
                return
            tokens, self.open = tokens[tokens.index(self.after) + 1:], True
        if not tokens or self.failure is not None:  # failed: the text ends with the EOS its masks force
            return
        done = self.matcher.try_consume_tokens(tokens)
        if done == len(tokens) - 1 and tokens[-1] in self.eos and self.matcher.is_accepting():
            done += self.matcher.consume_token(tokens[-1])  # EOS ends a complete text (try_consume_tokens takes no EOS)
        if self._failed():
            return
        if done < len(tokens):
            self.matcher.rollback(done)
            raise StructureError(f"token {tokens[done]} (the {done + 1}-th of {len(tokens)} committed) does not match the "
                                 f"{self.structure.kind} constraint")

    def forced(self, max_tokens: int) -> list[int]:
        """The tokens the grammar forces after the committed text, up to ``max_tokens``: at each
        position the one token its mask allows (EOS excluded, which ends the text). The target's
        masked distribution puts all its mass on such a token, so drafted as a point mass it is
        always accepted. The matcher is left as it was found."""
        if not self.open or self._failed() or max_tokens <= 0:
            return []
        out: list[int] = []
        row = np.empty(self.words, dtype=np.int32)
        while len(out) < max_tokens:
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            bits = np.unpackbits(row.view(np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: self.vocab_size])
            if len(allowed) != 1 or int(allowed[0]) in self.eos or self.matcher.try_consume_tokens([int(allowed[0])]) != 1:
                break
            out.append(int(allowed[0]))
        if out:
            self.matcher.rollback(len(out))
        return out

    def _failed(self) -> bool:
        if self.failure is None and self.matcher.is_error():
            self.failure = f"the {self.structure.kind} constraint exceeded its limits: {_first_line(self.matcher.get_error())}"
        return self.failure is not None

    def masks(self, paths: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """``(bits, reachable)``: ``bits[j]`` the packed allowed-token mask (int32 words, bit ``t % 32``
        of word ``t // 32`` for token ``t``; llguidance's layout) after the committed text and
        ``paths[j]``; ``reachable[j]`` False where the grammar refuses ``paths[j]``, or where it
        holds EOS, which ends the text (its bits are then all set: nothing masked), and where the
        grammar has not started (no ``after`` token yet: all set too). Consumes and rolls back
        along the paths in their order, so a chain's prefixes cost one token each. A failed
        constraint's masks allow EOS alone, at every position."""
        bits = np.full((len(paths), self.words), -1, dtype=np.int32)
        reachable = np.ones(len(paths), dtype=bool)
        stack: list[int] = []  # tokens consumed past the committed text
        for j, path in enumerate(paths):
            if self._failed():
                break
            path = self._held([int(t) for t in path])
            if path is None:  # before the grammar starts: any token
                continue
            common = 0
            limit = min(len(stack), len(path))
            while common < limit and stack[common] == path[common]:
                common += 1
            if common < len(stack):
                self.matcher.rollback(len(stack) - common)
                del stack[common:]
            rest = path[common:]
            done = self.matcher.try_consume_tokens(rest) if rest else 0
            stack += rest[:done]
            if done < len(rest):
                reachable[j] = False
                continue
            row = bits[j]
            self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._failed():
            bits[:] = 0
            for t in self.eos:
                bits[:, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
            reachable[:] = True
        elif stack:
            self.matcher.rollback(len(stack))
        return bits, reachable

