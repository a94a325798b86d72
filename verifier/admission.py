"""What a request and a draft must be before the engine takes them: each refusal is the
:mod:`goodspeed.verifier.errors` exception its client sees, raised before any state changes."""

from __future__ import annotations

from collections.abc import Sequence

from goodspeed.lm.decoding.params import MAX_TOP_LOGPROBS, SamplingParams
from goodspeed.lm.decoding.structured import Structure, StructureError
from goodspeed.verifier import errors
from goodspeed.verifier.drafts import draft_depth, validate_draft
from goodspeed.verifier.sessions import Session
from goodspeed.verifier.types import Draft


def check_structure(structure: Structure, output: list[int], eos_token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise unless the grammar is bound to a tokenizer that fits the target's vocabulary, ends the
    text with one of ``eos_token_ids`` and accepts ``output`` (a resumed request's)."""
    if not structure.is_bound:
        raise errors.MalformedDraftError("a structured output constraint must be compiled against the target's tokenizer")
    if structure.tokenizer.vocab_size > vocab_size:
        raise errors.MalformedDraftError(f"the constraint's tokenizer has {structure.tokenizer.vocab_size} tokens, "
                                         f"past the target's vocabulary of {vocab_size}")
    if structure.after is not None and structure.after >= vocab_size:
        raise errors.MalformedDraftError(f"the constraint's after token {structure.after} is past the target's "
                                         f"vocabulary of {vocab_size}")
    if not set(structure.tokenizer.eos_tokens) & {int(t) for t in eos_token_ids}:
        raise errors.MalformedDraftError(
            f"structured output ends the text with EOS ({structure.tokenizer.eos_token}), which is not one of the "
            "request's ending tokens (ignore_eos cannot be combined with it)")
    if not output:
        return
    try:
        failure = structure.constraint(output).failure
    except StructureError as exc:
        raise errors.MalformedDraftError(f"the resumed output does not match the constraint: {exc}") from None
    if failure is not None:
        raise errors.MalformedDraftError(failure)


def check_request(prompt: list[int], max_new_tokens: int, logprobs: int | None, sampling: SamplingParams | None,
                  generated: int, prompt_logprobs: int | None, eos_token_ids: Sequence[int], vocab_size: int,
                  max_seq_len: int) -> None:
    """Raise the error a request with this prompt, length, ``logprobs``, sampling settings,
    resumed output, ``prompt_logprobs`` and ending tokens would get (nothing changes). A
    structured output's grammar must be bound to the target's tokenizer, end the text with one
    of ``eos_token_ids`` (its EOS, which it allows alone once the text is complete) and accept
    the resumed output."""
    if not prompt:
        raise errors.MalformedDraftError("the prompt must hold at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise errors.InvalidTokenError(f"prompt token ids must lie in [0, {vocab_size})")
    if max_new_tokens < 1:
        raise errors.MalformedDraftError("max_new_tokens must be >= 1")
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise errors.MalformedDraftError(f"logprobs must lie in 0..{MAX_TOP_LOGPROBS}, got {logprobs}")
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise errors.MalformedDraftError(f"prompt_logprobs must lie in 0..{MAX_TOP_LOGPROBS}, got {prompt_logprobs}")
    if sampling is not None and sampling.logit_bias and sampling.logit_bias[-1][0] >= vocab_size:
        raise errors.InvalidTokenError(f"logit_bias token ids must lie in [0, {vocab_size})")
    if sampling is not None and sampling.min_tokens and sampling.eos_token_ids and sampling.eos_token_ids[-1] >= vocab_size:
        raise errors.InvalidTokenError(f"with min_tokens, eos token ids must lie in [0, {vocab_size})")
    if sampling is not None and sampling.allowed_token_ids and sampling.allowed_token_ids[-1] >= vocab_size:
        raise errors.InvalidTokenError(f"allowed_token_ids must lie in [0, {vocab_size})")
    if sampling is not None and sampling.bad_words and max(max(w) for w in sampling.bad_words) >= vocab_size:
        raise errors.InvalidTokenError(f"bad_words token ids must lie in [0, {vocab_size})")
    if sampling is not None and sampling.nothing_allowed:
        raise errors.MalformedDraftError("min_tokens or bad_words hold back every one of allowed_token_ids: "
                                         "no token could be sampled")
    if not 0 <= generated <= len(prompt):
        raise errors.MalformedDraftError(f"generated must lie in 0..{len(prompt)} (the prompt's length), got {generated}")
    if sampling is not None and sampling.structured is not None:
        check_structure(sampling.structured, prompt[len(prompt) - generated:], eos_token_ids, vocab_size)
    if len(prompt) >= max_seq_len:
        raise errors.PromptTooLongError(f"prompt of {len(prompt)} tokens does not fit the context of {max_seq_len}")
    if len(prompt) + max_new_tokens > max_seq_len:
        raise errors.LengthLimitError(
            f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the context limit {max_seq_len}"
        )


def check_draft(session: Session, draft: Draft, vocab_size: int) -> None:
    """Raise unless ``draft`` fits the session's round: well formed (:func:`validate_draft`), no
    longer than its allotment, and no deeper than its request has room for."""
    validate_draft(draft, vocab_size, session.source.allotted(session.session_id), needs_probs=not session.request.sampling.greedy)
    depth = draft_depth(draft)
    remaining = session.request.remaining + len(session.decoded)  # as of its last verdict, which it drafted from
    if depth > remaining - 1:
        raise errors.DraftTooLongError(
            f"draft depth {depth} reaches past the request's end ({remaining} tokens left, "
            "the last of which the verifier adds)"
        )
