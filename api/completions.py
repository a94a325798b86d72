"""The completions and chat completions routes of :class:`~goodspeed.api.server.OpenAIServer`: a request
read into backend requests (its prompts tokenized or its chat rendered through the model's template,
its sampling bound), and the pieces of the reply they are written from."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import itertools
import secrets

import jinja2
import jinja2.meta
import jinja2.sandbox
from aiohttp import web

from goodspeed.api.errors import ApiError, parse_body
from goodspeed.api.protocol import ChatCompletionRequest, CompletionRequest
from goodspeed.api.reasoning import Reasoning, closes_reasoning
from goodspeed.api.reasoning import end_token as reasoning_end
from goodspeed.api.text import INLINE_CHARS, TextStream
from goodspeed.api.tools import ToolCalls
from goodspeed.lm.decoding.params import TokenLogprob
from goodspeed.lm.decoding.seeding import ROOT_SEED_BITS, stream_seed
from goodspeed.lm.decoding.structured import StructureError
from goodspeed.serving.generation import GenerationRequest



DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

# Variables a chat template gets from the server, never from a request's chat_template_kwargs
# (with the tokenizer's special tokens, which transformers passes too).
RENDER_SET = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                        "raise_exception", "strftime_now"})


@functools.lru_cache(maxsize=8)
def template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja chat template reads that it does not set itself."""
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment()
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))

def bad_word_ids(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of ``bad_words``: each word (leading whitespace stripped) as it stands,
    and after a space where that starts with another token and holds as many (so the word is
    banned at the start of the text and inside it). 400 for a word that is no token at all."""
    out = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ApiError(400, f"bad word {word[:32]!r} holds no token", param="bad_words")
        out.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return tuple(out)

class Reply:
    """One chat choice's text read as OpenAI's message parts: its reasoning (``thinking``, a
    reasoning parser's reader), its content and its tool calls (``tools``), in that order."""

    def __init__(self, thinking: Reasoning | None, tools: ToolCalls | None) -> None:
        self.thinking, self.tools = thinking, tools

    def push(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        """``(reasoning, content, tool_calls deltas)`` that ``text`` lets out; ``final``: the
        reply's last piece, after which what the readers hold comes out."""
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.push(text)
            if final:
                more, rest = self.thinking.finish()
                reasoning, text = reasoning + more, text + rest
        calls: list[dict] = []
        if self.tools is not None:
            text, calls = self.tools.push(text)
            if final:
                rest, last = self.tools.finish()
                text, calls = text + rest, calls + last
        return reasoning, text, calls

    def finish_reason(self, reason: str) -> str:
        return reason if self.tools is None else self.tools.finish_reason(reason)


class Completions:
    """``POST /v1/completions`` and ``POST /v1/chat/completions`` (a mixin of :class:`~goodspeed.api.server.OpenAIServer`)."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        identity = self._identify(request)
        body = parse_body(CompletionRequest, await self._json(request))
        self._check_model(body.model)
        cut = body.truncate_prompt_tokens is not None
        whole = [list(p) if isinstance(p, list) else await self._tokenize(p, body.add_special_tokens, must_fit=not cut)
                 for p in body.prompts]
        prompts = [body.truncated(ids, self.backend.max_model_len) for ids in whole]
        # max_tokens = 0 (with echo): the prompt alone, served as a one-token request (its first
        # verdict, its last, brings the prompt's scores); its token is not returned
        limit = DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else max(body.max_tokens, 1)
        rid, gens = self._generations("cmpl", body, prompts, limit, await self._bind(body, body.structure()))
        echoes = None
        if body.echo:  # each choice's text starts with its prompt's: as sent, or a token-id prompt's decode
            decode = functools.partial(self.backend.tokenizer.decode, skip_special_tokens=False)
            # a truncated prompt (truncate_prompt_tokens) echoes what was kept of it
            echoes = [p if isinstance(p, str) and len(kept) == len(ids) else decode(kept)
                      for p, kept, ids in zip(body.prompts, prompts, whole) for _ in range(body.n)]
        if body.stream:
            return await self._stream(request, identity, rid, gens, body, chat=False, echoes=echoes)
        return await self._complete(identity, rid, gens, body, chat=False, echoes=echoes)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        identity = self._identify(request)
        body = parse_body(ChatCompletionRequest, await self._json(request))
        self._check_model(body.model)
        rid, gens, replies = await self._chat_generations("chatcmpl", body)
        echoes = [body.echoed] * len(gens) if body.echoed else None  # vLLM's echo
        if body.stream:
            return await self._stream(request, identity, rid, gens, body, chat=True, echoes=echoes, replies=replies)
        return await self._complete(identity, rid, gens, body, chat=True, echoes=echoes, replies=replies)

    async def _chat_generations(self, kind: str, body: ChatCompletionRequest, read: bool = False):
        """A chat request's id, backend requests (one per choice) and each choice's reader of its
        reasoning and tool calls (None where neither the request nor the server asks for one, unless
        ``read``: the Responses API reads every reply into items)."""
        self._check_tools(body)
        rendered = await self._render_chat(body)
        prompt_ids = body.truncated(await self._tokenize(rendered, body.add_special_tokens,
                                                         must_fit=body.truncate_prompt_tokens is None), self.backend.max_model_len)
        limit = body.token_limit or max(1, self.backend.max_model_len - len(prompt_ids))
        structure = body.structure()
        if structure is not None and self.reasoning_parser is not None and not closes_reasoning(rendered):
            # a reasoning model's grammar waits for its reasoning to end (api.reasoning)
            after = reasoning_end(self.backend.tokenizer)
            if after is None:
                raise ApiError(400, "this prompt leaves the model's reasoning open and the tokenizer has no </think> token "
                                    "to start the grammar at: the reasoning would be held to it too; give a prompt that "
                                    'closes it (Qwen3: chat_template_kwargs {"enable_thinking": false})',
                               param=body.structure_field())
            structure = dataclasses.replace(structure, after=after)
        rid, gens = self._generations(kind, body, [prompt_ids], limit, await self._bind(body, structure))
        replies = None
        if read or body.tool_mode != "none" or self.reasoning_parser is not None:
            replies = [Reply(None if self.reasoning_parser is None else Reasoning(self.reasoning_parser, rendered),
                              None if body.tool_mode == "none" else ToolCalls(body.tool_mode, self.tool_parser,
                                                                               body.parallel_tool_calls, body.tools)) for _ in gens]
        return rid, gens, replies

    async def _render_chat(self, body) -> str:
        """A chat request's ``messages`` rendered by the tokenizer's chat template (on a worker
        thread when long), with its ``add_generation_prompt``, ``continue_final_message`` and
        ``chat_template_kwargs``; 400 for a model without a template, and for a keyword the
        template does not read or that the server sets itself."""
        tokenizer = self.backend.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if template is None:
            raise ApiError(400, f"model {self.backend.model_ids[0]!r} has no chat template: use /v1/completions",
                           param="messages")
        extra = body.chat_template_kwargs or {}
        if extra:
            readable = (template_variables(template) - RENDER_SET - set(tokenizer.special_tokens_map)
                        - set(inspect.signature(tokenizer.apply_chat_template).parameters))  # tokenize=, return_dict=, ...
            for key in extra:
                if key not in readable:
                    raise ApiError(400, f"chat_template_kwargs.{key}: this model's chat template does not read it (it reads "
                                        f"{', '.join(sorted(readable)) or 'none'})", param="chat_template_kwargs")
        turns = [m.turn() for m in body.messages]
        tools = {"tools": [t.model_dump(exclude_none=True) for t in body.tools]} if body.tools else {}
        render = functools.partial(tokenizer.apply_chat_template, turns, tokenize=False,
                                   add_generation_prompt=body.add_generation_prompt,
                                   continue_final_message=body.continue_final_message, **tools, **extra)
        try:
            return await asyncio.to_thread(render) if sum(len(t["content"]) for t in turns) > INLINE_CHARS else render()
        except (ValueError, jinja2.TemplateError) as exc:  # e.g. the template's own raise_exception
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None

    def _check_tools(self, body: ChatCompletionRequest) -> None:
        """400 for a reply whose tool calls could not be read (``tool_choice`` "auto" without
        ``tool_parser``) or that could not call them (a chat template that does not render ``tools``)."""
        if body.tool_mode != "auto":
            return
        if self.tool_parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs a server started with --tool-call-parser; '
                                'name a function in tool_choice or give "required" to have the reply be a call',
                           param="tool_choice")
        template = getattr(self.backend.tokenizer, "chat_template", None)
        if template is not None and "tools" not in template_variables(template):
            raise ApiError(400, f"model {self.backend.model_ids[0]!r}'s chat template does not render tools, so the model "
                                'could not know them: name a function in tool_choice or give "required"', param="tools")

    async def _bind(self, body, structure):
        """``structure`` (the request's constraint, :meth:`structure`, or None) compiled against the
        tokenizer (off the event loop: a vocabulary is indexed once, ~1 s, and a large grammar
        compiles slowly); 400 naming ``body``'s field if it does not compile."""
        if structure is None:
            return None
        try:
            return await asyncio.to_thread(structure.bound, self.backend.tokenizer)
        except StructureError as exc:
            raise ApiError(400, str(exc), param=body.structure_field()) from None

    def _generations(self, kind: str, body, prompts: list[list[int]], max_tokens: int,
                     structured=None) -> tuple[str, list[GenerationRequest]]:
        """The response's id and one backend request per choice: ``body.n`` for each prompt, choice
        ``i * n + j`` the ``j``-th of prompt ``i`` (OpenAI's order). A choice's request id is the
        response's, suffixed with the choice's index when there are several. Choice ``j > 0`` of a seeded request draws from
        the seed's stream ``("choice", j)``, so its samples are its own and as reproducible."""
        limit, n = self.backend.max_model_len, body.n
        for i, prompt_ids in enumerate(prompts):
            if len(prompt_ids) >= limit or len(prompt_ids) + max_tokens > limit:
                which = f"prompt {i} holds" if len(prompts) > 1 else "the prompt holds"
                raise ApiError(400, f"this model's context is {limit} tokens; {which} {len(prompt_ids)} and "
                                    f"{max_tokens} more were asked for", param="prompt" if kind == "cmpl" else "messages",
                               code="context_length_exceeded")
        asked = body.max_tokens if body.max_tokens is not None else max_tokens
        if body.min_tokens > asked:  # vLLM's rule
            raise ApiError(400, f"min_tokens ({body.min_tokens}) must be at most max_tokens ({asked})", param="min_tokens")
        eos = self.backend.tokenizer.eos_token_id
        # vLLM's stop_token_ids end the text like EOS (counted as a token; its text left out: api.text)
        stops = tuple(dict.fromkeys(([] if body.ignore_eos or eos is None else [int(eos)]) + list(body.stop_token_ids or ())))
        try:
            sampling = body.sampling(structured, bad_word_ids(self.backend.tokenizer, body.bad_words or ())).ending_with(stops)
        except ValueError as exc:  # a bad word past MAX_BAD_WORD_TOKENS tokens
            raise ApiError(400, str(exc), param="bad_words") from None
        if sampling.nothing_allowed:
            raise ApiError(400, "min_tokens or bad_words hold back every one of allowed_token_ids: no token could be sampled",
                           param="allowed_token_ids")
        base, many = f"{kind}-{secrets.token_hex(12)}", len(prompts) * n > 1
        return base, [GenerationRequest(
            request_id=f"{base}-{i * n + j}" if many else base, prompt_ids=prompt_ids, max_tokens=max_tokens,
            sampling=sampling, eos_token_ids=stops,
            seed=body.seed if body.seed is None or j == 0 else stream_seed(body.seed, "choice", str(j)) % (1 << ROOT_SEED_BITS),
            tpot_slo_ms=body.tpot_slo_ms, logprobs=body.requested_logprobs,
            prompt_logprobs=body.requested_prompt_logprobs) for i, prompt_ids in enumerate(prompts) for j in range(n)]

    def _logprobs(self, logprobs: list, chat: bool, offset: int, as_ids: bool = False) -> dict:
        """A choice's (or a chunk's) ``logprobs`` object: chat's ``{"content": [{token, logprob,
        bytes, top_logprobs}]}``, or completions' ``{tokens, token_logprobs, top_logprobs,
        text_offset}`` (each token's text from ``offset``; ``top_logprobs`` maps text to
        log-probability and includes the chosen token, as vLLM's). A token's text is its own decode,
        or with ``as_ids`` (vLLM's ``return_tokens_as_token_ids``) ``"token_id:<id>"``.
        An echoed prompt's first token follows nothing: its ``logprob`` is None, and so is its entry
        in ``token_logprobs`` and ``top_logprobs`` (OpenAI's and vLLM's shape)."""
        text_of = functools.partial(self.backend.tokenizer.decode, skip_special_tokens=False)

        def decode(ids: list[int]) -> str:
            return f"token_id:{ids[0]}" if as_ids else text_of(ids)

        if chat:
            def entry(token_id: int, logprob: float) -> dict:
                text = decode([token_id])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs]}
        tokens = [decode([lp.token_id]) for lp in logprobs]
        offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else []
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [None if lp.logprob is None else {**{decode([t]): v for t, v in lp.top}, text: lp.logprob}
                                 for text, lp in zip(tokens, logprobs)],
                "text_offset": offsets}

    @staticmethod
    def _echoed(gen: GenerationRequest, scores: list | None, top: int | None) -> list:
        """The log-probabilities an echoed prompt's tokens open a choice's with: none for its first
        token (it follows nothing), then ``scores`` (the backend's, one per later prompt token) with
        the ``top`` most probable tokens each (the scores may hold more, for ``prompt_logprobs``);
        ``[]`` where the prompt is not scored (``scores`` or ``top`` None: no echo, or no ``logprobs``)."""
        if scores is None or top is None:
            return []
        return [TokenLogprob(gen.prompt_ids[0], None, None)] + [dataclasses.replace(lp, top=lp.top[:top]) for lp in scores]

    def _prompt_logprobs(self, scores: list, top: int) -> list:
        """vLLM's ``prompt_logprobs``: null for the prompt's first token (it follows nothing), then
        for each later one a map from token id to ``{logprob, rank, decoded_token}`` holding the
        prompt's token and the ``top`` most probable tokens at its position (ranked 1 to ``top``),
        in that order, as vLLM's (a prompt token among the top ones is one entry)."""
        decode = functools.partial(self.backend.tokenizer.decode, skip_special_tokens=False)
        names: dict[int, str] = {}  # a long prompt's entries repeat tokens: each is decoded once

        def entry(token_id: int, logprob: float, rank: int) -> dict:
            if token_id not in names:
                names[token_id] = decode([token_id])
            return {"logprob": logprob, "rank": rank, "decoded_token": names[token_id]}

        out: list = [None]
        for lp in scores:
            if lp.rank is None:
                raise ApiError(502, "the verifier sent prompt log-probabilities without their ranks (is it older than this node?)")
            out.append({lp.token_id: entry(lp.token_id, lp.logprob, lp.rank),
                        **{t: entry(t, v, r) for r, (t, v) in enumerate(lp.top[:top], start=1)}})
        return out

    def _text_stream(self, body, gen: GenerationRequest) -> TextStream:
        eos = self.backend.tokenizer.eos_token_id
        return TextStream(self.backend.tokenizer, body.stop_strings, skip_special_tokens=body.skip_special_tokens,
                          include_stop=body.include_stop_str_in_output, stop_token_ids=gen.eos_token_ids,
                          min_tokens=body.min_tokens, eos_token_id=None if body.ignore_eos or eos is None else int(eos))

    def _envelope(self, rid: str, chat: bool, created: int) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
                "model": self.backend.model_ids[0]}

    @staticmethod
    def _usage(gens: list[GenerationRequest], n: int, texts: list[TextStream]) -> dict:
        """Each prompt's tokens once (whatever ``n``), every choice's completion tokens."""
        prompt = sum(len(g.prompt_ids) for g in gens[::n])
        completion = sum(t.consumed for t in texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
