"""Structured output's constraint: compiled against a tokenizer (bad grammars refused), and the
masks along a row's paths equal a fresh matcher's at each path (chains and trees, with paths the
grammar refuses), leaving the request's matcher where its committed text left it."""

import inspect
import json

import numpy as np
import pytest
import torch

from goodspeed.lm.models.demo import train_tokenizer
from goodspeed.lm.decoding.adjust import adjust_logits
from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.structured import MAX_SPEC_CHARS, Structure, StructureError
from statkit import allowed, grammar_allows

V = 300


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(inspect.getsource(json.decoder) * 3, vocab_size=V)


@pytest.mark.parametrize("kind, spec, message", [
    ("regex", "[[[", "does not compile"),
    ("json", "{not json", "does not parse"),
    ("json", "[1, 2]", "JSON schema"),
    ("choice", "[]", "non-empty list"),
    ("choice", '["a", 3]', "non-empty list"),
    ("grammar", "start: undefined_rule", "does not compile"),
])
def test_a_bad_constraint_is_refused_when_bound(tokenizer, kind, spec, message):
    with pytest.raises(StructureError, match=message):
        Structure(kind, spec).bound(tokenizer)


def test_malformed_structures_are_refused_at_once():
    for kind, spec in (("yaml", "a: 1"), ("regex", ""), ("json_object", "{}"), ("regex", "a" * (MAX_SPEC_CHARS + 1))):
        with pytest.raises(StructureError):
            Structure(kind, spec)
    with pytest.raises(StructureError, match="not bound"):
        Structure("regex", "a+").constraint()
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured=Structure("regex", "a+"))


def test_equality_is_the_kind_and_text(tokenizer):
    bound = Structure("regex", "[a-z]+").bound(tokenizer)
    assert bound == Structure("regex", "[a-z]+") and bound.is_bound and not Structure("regex", "[a-z]+").is_bound
    assert Structure("json_object") != Structure("json_object", any_whitespace=True)


def walk(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


@pytest.mark.parametrize("kind, spec, text", [
    ("regex", r"[a-z_]{1,8}\((self|s), [0-9]{1,3}\)", "scan(self, 12)"),
    ("json", json.dumps({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]}), '{"k":"end"}'),
    ("grammar", 'start: "def " NAME "(" NAME ")"\nNAME: /[a-z]+/', "def decode(s)"),
    ("choice", json.dumps(["decoder", "scanner", "end"]), "scanner"),
])
def test_masks_along_chain_and_tree_paths_equal_a_fresh_matchers(tokenizer, kind, spec, text):
    structure = Structure(kind, spec).bound(tokenizer)
    ids = walk(tokenizer, text)
    committed, drafted = ids[:1], ids[1:]
    constraint = structure.constraint(committed)
    before = constraint.masks([[]])[0]
    refused = int(torch.nonzero(~grammar_allows(structure, committed + drafted[:1], V))[0])
    # a chain's prefixes, then tree paths: a branch off the chain, a path the grammar refuses
    # (and one below it), and the chain again after them
    paths = [drafted[:k] for k in range(len(drafted) + 1)]
    paths += [drafted[:1] + [refused], drafted[:1] + [refused, drafted[1]], drafted[:2], []]
    bits, reachable = constraint.masks(paths)
    assert reachable.tolist() == [True] * (len(drafted) + 1) + [False, False, True, True]
    got = allowed(bits, V)
    for j, path in enumerate(paths):
        if reachable[j]:
            assert torch.equal(got[j], grammar_allows(structure, committed + path, V)), (j, path)
        else:
            assert got[j].all()
    assert np.array_equal(constraint.masks([[]])[0], before)  # the matcher is where the committed text left it


def test_a_grammar_after_a_token_frees_the_text_before_it(tokenizer):
    """``after`` (a reasoning model's ``</think>``): positions whose text holds no ``after`` token
    are free, the grammar holds what follows the first one, on a chain, on a tree branch, across
    the committed text, and for a resumed output."""
    gate = walk(tokenizer, "#")[0]
    structure = Structure("regex", r"[a-z]{1,4}", after=gate).bound(tokenizer)
    assert structure != Structure("regex", r"[a-z]{1,4}")  # after is part of what a request asked for
    think, answer = walk(tokenizer, "anything (at all)"), walk(tokenizer, "ab")
    constraint = structure.constraint(think)  # no gate yet: nothing consumed, nothing refused
    drafted = think[:2] + [gate] + answer
    paths = [drafted[:k] for k in range(len(drafted) + 1)] + [[gate], [gate, gate]]
    bits, reachable = constraint.masks(paths)
    got = allowed(bits, V)
    for j, path in enumerate(paths):
        if reachable[j]:
            assert torch.equal(got[j], grammar_allows(structure, think + path, V)), (j, path)
    assert got[0].all() and got[2].all() and not got[3].all()  # free until the gate, held after it
    assert reachable.tolist() == [True] * len(paths[:-1]) + [False]  # a second gate is not [a-z]
    constraint.extend(think[:1] + [gate] + answer[:1])  # the gate committed: the grammar holds what follows
    committed = think + think[:1] + [gate] + answer[:1]
    assert torch.equal(allowed(constraint.masks([[]])[0], V)[0], grammar_allows(structure, committed, V))
    with pytest.raises(StructureError, match="does not match"):
        structure.constraint([gate] + walk(tokenizer, "(")).masks([[]])
    with pytest.raises(StructureError):
        Structure("regex", "a", after=-1)


def test_eos_ends_a_complete_text_and_nothing_follows(tokenizer):
    structure = Structure("choice", json.dumps(["end"])).bound(tokenizer)
    ids, eos = walk(tokenizer, "end"), tokenizer.eos_token_id
    constraint = structure.constraint()
    bits, reachable = constraint.masks([ids, ids + [eos], ids + [eos, ids[0]]])
    assert torch.nonzero(allowed(bits, V)[0]).flatten().tolist() == [eos]  # complete: EOS alone
    assert reachable.tolist() == [True, False, False]
    with pytest.raises(StructureError, match="does not match"):
        structure.constraint(walk(tokenizer, "en") + [eos])  # not complete: EOS refused
    constraint.extend(ids + [eos])
    assert constraint.matcher.is_stopped()  # the grammar takes no more tokens
    with pytest.raises(StructureError):
        constraint.extend(walk(tokenizer, "e"))


def test_adjust_logits_masks_each_position_and_a_smaller_vocabulary(tokenizer):
    """Target rows get -inf outside each position's mask; a draft's smaller vocabulary keeps the
    ids it has, and a position none of whose allowed ids it has is left unmasked."""
    structure = Structure("regex", r"ab[x-z]c").bound(tokenizer)
    history = TokenHistory([5, 6], [], structure)
    paths = [[], walk(tokenizer, "a"), walk(tokenizer, "ab")]
    logits = torch.zeros(1, 3, V)
    adjust_logits(logits, [0], [SamplingParams(structured=structure)], [history], [paths])
    for j, path in enumerate(paths):
        assert torch.equal(torch.isfinite(logits[0, j]), grammar_allows(structure, path, V))
    small = torch.zeros(1, 3, walk(tokenizer, "a")[0] + 1)  # "a", but none of x, y, z, which byte-level BPE numbers above it
    adjust_logits(small, [0], [SamplingParams(structured=structure)], [history], [paths])
    assert torch.isfinite(small[0, 2]).all() and not torch.isfinite(small[0, 0]).all()


def test_a_constraint_past_its_limits_fails_to_eos_alone(tokenizer, monkeypatch):
    """Past llguidance's per-step limits (a tiny lexer budget here) the constraint records why,
    its masks allow EOS alone at every position, and committed tokens no longer raise."""
    from goodspeed.lm.decoding import structured

    monkeypatch.setattr(structured, "LIMITS", structured.llguidance.LLParserLimits(step_lexer_fuel=100, verbose_errors=False))
    bound = Structure("json_object").bound(tokenizer)  # its first mask fits the budget
    constraint = bound.constraint()
    ids = walk(tokenizer, '{"a": 1}')
    bits, reachable = constraint.masks([ids[:k] for k in range(len(ids))])
    assert constraint.failure is not None and "exceeded its limits" in constraint.failure
    assert reachable.all() and all(torch.nonzero(row).flatten().tolist() == [tokenizer.eos_token_id] for row in allowed(bits, V))
    constraint.extend([tokenizer.eos_token_id])


def test_a_drafters_copy_of_the_text_drops_a_grammar_the_verifiers_text_left_instead_of_failing(tokenizer):
    """The verifier decides the text: where its matcher ran past its limits and ended the text
    with EOS, a drafter's copy refusing it must not fail the request (drafts go unmasked)."""
    structure = Structure("regex", "[a-z]+").bound(tokenizer)
    refused = walk(tokenizer, "12")
    with pytest.raises(StructureError):
        TokenHistory([1], structure=structure).extend(refused)
    history = TokenHistory([1], structure=structure)
    history.extend(refused, strict=False)
    assert history.constraint is None and history.output == refused


@pytest.mark.parametrize("kind, spec, text", [
    ("json", json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
                         "required": ["name", "n"], "additionalProperties": False}), '{"name":"ab","n":12}'),
    ("choice", json.dumps(["scanner", "scanned"]), "scanned"),
])
def test_forced_tokens_are_those_a_fresh_matcher_allows_alone(tokenizer, kind, spec, text):
    """At every prefix of a valid text: the forced run is, token by token, the one token a fresh
    matcher allows (EOS aside), and the constraint is left where it was."""
    structure = Structure(kind, spec).bound(tokenizer)
    eos = set(structure.tokenizer.eos_tokens)
    tokens = walk(tokenizer, text)
    seen = 0
    for cut in range(len(tokens) + 1):
        constraint = structure.constraint(tokens[:cut])
        got = constraint.forced(6)
        want, output = [], list(tokens[:cut])
        while len(want) < 6:
            only = torch.nonzero(grammar_allows(structure, output, len(tokenizer))).flatten().tolist()
            if len(only) != 1 or only[0] in eos:
                break
            want.append(only[0])
            output.append(only[0])
        assert got == want, (cut, got, want)
        seen += len(got)
        assert constraint.forced(6) == got  # the matcher was left as it was
    assert seen > 0


def test_json_nested_past_the_limit_is_refused_by_name_never_a_recursion_error(tokenizer):
    """``loads_bounded`` reads JSON up to MAX_JSON_DEPTH levels and refuses deeper (the parser's
    own recursion included) with a ValueError naming the limit; a schema nested deeper does not
    compile, with the same words."""
    from goodspeed.lm.decoding.structured import MAX_JSON_DEPTH, JsonTooDeep, json_depth, loads_bounded

    assert [json_depth(v) for v in (1, "x", [], {}, [[1]], {"a": [{}]})] == [0, 0, 1, 1, 2, 3]
    at_limit = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert json_depth(loads_bounded(at_limit)) == MAX_JSON_DEPTH
    for depth in (MAX_JSON_DEPTH + 1, 50_000):  # past the limit; past the parser's recursion
        with pytest.raises(JsonTooDeep, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
            loads_bounded("[" * depth + "]" * depth)
    schema = '{"type": "object", "properties": {"a": ' * 500 + '{"type": "string"}' + "}}" * 500
    with pytest.raises(StructureError, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        Structure("json", schema).bound(tokenizer)


def assert_views_agree(hf_tokenizer, schema: dict, text: str) -> None:
    """llguidance's view over the tokenizer itself (``shared_view``) and its own copy
    (``llguidance.hf.from_tokenizer``): the same bytes and special flag for every token, and, along
    ``text`` under ``schema``, the same mask and the same forced tokens at every prefix."""
    import llguidance.hf

    from goodspeed.lm.decoding.structured import shared_view

    mine, theirs = shared_view(hf_tokenizer), llguidance.hf.from_tokenizer(hf_tokenizer)
    assert mine is not None and mine.vocab_size == theirs.vocab_size and mine.eos_tokens == theirs.eos_tokens
    for i in range(theirs.vocab_size):
        assert (mine.decode_bytes([i]), mine.is_special_token(i)) == (theirs.decode_bytes([i]), theirs.is_special_token(i)), i
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    a, b = llguidance.LLMatcher(mine, grammar), llguidance.LLMatcher(theirs, grammar)
    tokens = hf_tokenizer.encode(text, add_special_tokens=False)
    for token in tokens:
        assert a.compute_bitmask() == b.compute_bitmask() and a.compute_ff_tokens() == b.compute_ff_tokens()
        assert a.consume_token(token) and b.consume_token(token)
    assert a.is_accepting() and b.is_accepting()


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"enum": ["décor", "ünï"]}}},
          "required": ["name", "tags"], "additionalProperties": False}


def test_llguidance_reads_a_byte_level_tokenizer_without_its_own_copy(tokenizer, monkeypatch):
    """A byte-level BPE tokenizer (with added tokens, one of them read through the byte table and
    one not, a special one, and non-ASCII text) is read by llguidance through the tokenizer
    itself, never through a copy, and that view agrees with llguidance's own."""
    import copy

    import llguidance.hf

    from goodspeed.lm.decoding.structured import llguidance_tokenizer

    extended = copy.deepcopy(tokenizer)
    extended.add_tokens(["héllo", "wörld ☃"])
    extended.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert_views_agree(extended, SCHEMA, '{"name":"hello wörld ☃","tags":["décor","ünï"]}')
    monkeypatch.setattr(llguidance.hf, "from_tokenizer", None)  # the copy is never made
    view = llguidance_tokenizer(extended)
    assert view is llguidance_tokenizer(extended)  # built once per tokenizer
    added = extended.convert_tokens_to_ids(["héllo", "wörld ☃", "<|tool|>"])
    assert [view.decode_bytes([i]) for i in added] == [b"h\xe9llo", "wörld ☃".encode(), b"<|tool|>"]  # as the tokenizer decodes them
    assert view.is_special_token(added[2]) and not view.is_special_token(added[1])


def test_masks_without_llguidances_slices_are_the_same(tokenizer, monkeypatch):
    """Slices only make masks faster: a view built without them (an edge node with no draft
    model) masks every position as llguidance's own copy with them does."""
    from goodspeed.lm.decoding import structured

    monkeypatch.setitem(structured._SLICES, "on", False)
    assert_views_agree(tokenizer, SCHEMA, '{"name":"a \\"b\\" c","tags":["ünï"]}')


def test_a_tokenizer_that_is_not_byte_level_gets_llguidances_own_copy(tokenizer):
    """Another decoder (Llama 2's SentencePiece-style sequence with byte fallback): its tokens'
    bytes are not read off by hand; llguidance's own reading is used, and structured output works
    with it."""
    import copy

    from tokenizers import decoders

    from goodspeed.lm.decoding.structured import llguidance_tokenizer, shared_view

    other = copy.deepcopy(tokenizer)
    other.backend_tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    assert shared_view(other) is None
    assert llguidance_tokenizer(other).vocab_size == len(other)
    Structure("json", json.dumps(SCHEMA)).bound(other)


@pytest.mark.real
def test_llguidance_reads_the_real_tokenizer_as_its_own_copy_does():
    from goodspeed.lm.models import real
    from goodspeed.lm.models.tokenizers import load_tokenizer

    if not real.is_built("smollm2-135m"):
        pytest.skip("needs the real model: goodspeed models get smollm2-135m")
    tokenizer, _ = load_tokenizer("real:smollm2-135m")
    assert_views_agree(tokenizer, SCHEMA, '{"name": "héllo wörld ☃ {x}", "tags": ["décor", "ünï", "décor"]}')
