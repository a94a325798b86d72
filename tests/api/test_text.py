"""Incremental detokenization and stop strings (goodspeed.api.text)."""

import inspect
import json

import pytest

from goodspeed.api.text import TextStream
from goodspeed.lm.models.demo import train_tokenizer

TEXT = 'def héllo(wörld):\n    return "✓ 日本語 naïve"  # ok\n'


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(inspect.getsource(json.decoder) * 3, vocab_size=300)


def stream_all(tokenizer, ids, stop=(), chunk=1):
    stream, out = TextStream(tokenizer, stop), []
    for i in range(0, len(ids), chunk):
        out.append(stream.push(ids[i : i + chunk]))
        if stream.stopped:
            break
    if not stream.stopped:
        out.append(stream.finish())
    return stream, out


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_streamed_text_equals_the_full_decode_whatever_the_chunking(tokenizer, chunk):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream, pieces = stream_all(tokenizer, ids, chunk=chunk)
    assert "".join(pieces) == TEXT == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # a character split across tokens is held, never emitted half
    assert stream.consumed == len(ids) and not stream.stopped


def test_a_stop_string_ends_the_text_before_it_and_consumes_no_later_token(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream, pieces = stream_all(tokenizer, ids, stop=["日本"])
    assert "".join(pieces) == 'def héllo(wörld):\n    return "✓ '
    assert stream.stopped and stream.consumed < len(ids)
    assert "日本" in tokenizer.decode(ids[: stream.consumed])
    assert "日本" not in tokenizer.decode(ids[: stream.consumed - 1])  # the match came with the last consumed token


def test_text_that_may_begin_a_stop_string_is_held_back_until_it_cannot(tokenizer):
    stream = TextStream(tokenizer, ["return 42"])
    out = stream.push(tokenizer("x = 1\n    return", add_special_tokens=False)["input_ids"])
    assert out == "x = 1\n    "  # "return" could still become the stop string
    out += stream.push(tokenizer(" 4", add_special_tokens=False)["input_ids"])
    assert "return" not in out
    out += stream.push(tokenizer("3", add_special_tokens=False)["input_ids"])  # "return 43": not a stop
    assert out == "x = 1\n    return 43" and not stream.stopped
    assert stream.finish() == ""


def test_special_tokens_are_not_in_the_text(tokenizer):
    ids = tokenizer("pass", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    _, pieces = stream_all(tokenizer, ids)
    assert "".join(pieces) == "pass"


def test_with_include_stop_the_text_ends_after_the_stop_string_and_nothing_is_held_back(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, ["日本"], include_stop=True)
    pieces = [stream.push([t]) for t in ids[:-1]]
    assert "".join(pieces) == 'def héllo(wörld):\n    return "✓ 日本'
    assert stream.stopped and "日本" in tokenizer.decode(stream.consumed_ids)
    held = TextStream(tokenizer, ["return 42"], include_stop=True)
    assert held.push(tokenizer("x = 1\n    return", add_special_tokens=False)["input_ids"]) == "x = 1\n    return"


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_that_ends_the_text_is_consumed_and_its_text_left_out_unless_included(tokenizer, include):
    """vLLM's detokenizer: EOS or a stop token id ends the generation; its text (here a plain
    token's, so it has one) is not in the output unless include_stop_str_in_output."""
    ids = tokenizer("pass\nreturn", add_special_tokens=False)["input_ids"]
    stream = TextStream(tokenizer, include_stop=include, stop_token_ids=[ids[-1]])
    text = stream.push(ids[:2]) + stream.push(ids[2:]) + stream.finish()
    assert stream.consumed_ids == ids and stream.consumed == len(ids)
    assert text == tokenizer.decode(ids if include else ids[:-1])
    special = TextStream(tokenizer, skip_special_tokens=False)
    eos = [tokenizer.eos_token_id]
    assert special.push(ids + eos) + special.finish() == tokenizer.decode(ids + eos)  # skip_special_tokens = False


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_min_tokens_lets_no_stop_string_end_within_its_first_tokens_text(tokenizer, chunk):
    """vLLM's min_tokens: the stop string's first occurrence ends within the first tokens' text, so
    the text runs on to its next one; a stop string that runs past that text still matches."""
    text = "return x\nreturn y\nreturn z\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    decoded = [tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    first = next(k for k in range(len(ids) + 1) if "return" in decoded[k])  # the token that completes the first "return"

    def run(min_tokens, stop):
        stream, out = TextStream(tokenizer, stop, min_tokens=min_tokens), []
        for i in range(0, len(ids), chunk):
            out.append(stream.push(ids[i : i + chunk]))
            if stream.stopped:
                break
        return "".join(out), stream

    assert run(0, ["return"])[0] == ""
    held, stream = run(first, ["return"])  # the first "return" ends within the first min_tokens tokens' text
    assert held == "return x\n" and stream.stopped
    # a stop string begun within the first tokens' text and ended after it still matches (as vLLM's)
    cut = first - 1
    assert "return" not in decoded[cut]
    runs_past, stream = run(cut, ["return"])
    assert runs_past == "" and stream.stopped


@pytest.mark.parametrize("include", [False, True])
def test_stop_reason_names_the_stop_string_or_token_and_is_none_for_eos(tokenizer, include):
    """vLLM's stop_reason: the stop string that matched (the earliest, whichever is listed first),
    the stop token id that ended the text, None for EOS (also when EOS is a stop token id too) and
    for a text nothing ended."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    stream, _ = stream_all(tokenizer, ids, stop=["naïve", "日本"])
    assert stream.stop_reason == "日本"
    eos = tokenizer.eos_token_id
    for ending, stops, expected in [(ids[-1], [eos, ids[-1]], ids[-1]), (eos, [eos, ids[-1]], None), (eos, [eos], None)]:
        stream = TextStream(tokenizer, include_stop=include, stop_token_ids=stops, eos_token_id=eos)
        stream.push(ids[:-1] + [ending])
        assert stream.stop_reason == expected
    ignoring = TextStream(tokenizer, stop_token_ids=[eos], eos_token_id=None)  # ignore_eos with EOS among stop_token_ids
    ignoring.push(ids[:3] + [eos])
    assert ignoring.stop_reason == eos
    running = TextStream(tokenizer, ["zzz"], stop_token_ids=[eos], eos_token_id=eos)
    running.push(ids)
    assert running.stop_reason is None and not running.stopped
