"""vLLM's tokenizer routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``."""

from __future__ import annotations

import asyncio
import functools
from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from goodspeed.api.errors import ApiError, parse_body
from goodspeed.api.protocol import ChatMessage, refuse_render_conflict
from goodspeed.api.text import INLINE_CHARS
from goodspeed.api.tools import MAX_TOOLS, Tool


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with a prompt: its token ids as a completion would take them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``POST /tokenize`` with messages: the chat template's rendering, tokenized."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # rendered as chat completions render them
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False

    def refuse_unsupported(self) -> None:
        refuse_render_conflict(self)


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class TokenizerRoutes:
    """Tokenizing as the completions do (a mixin of :class:`~goodspeed.api.server.OpenAIServer`)."""

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: a prompt's token ids (``prompt``, as completions tokenize it)
        or a chat's (``messages``, rendered as chat completions render them), with their count and
        the context length; ``return_token_strs`` adds each token's string."""
        self._identify(request)
        raw = await self._json(request)
        chat = isinstance(raw, dict) and "messages" in raw
        body = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, raw)
        if body.model is not None:
            self._check_model(body.model)
        text = await self._render_chat(body) if chat else body.prompt
        ids = await self._tokenize(text, body.add_special_tokens)
        strs = self.backend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return web.json_response({"count": len(ids), "max_model_len": self.backend.max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /detokenize``: token ids to text (special tokens kept, as vLLM's)."""
        self._identify(request)
        body = parse_body(DetokenizeRequest, await self._json(request))
        if body.model is not None:
            self._check_model(body.model)
        vocab = len(self.backend.tokenizer)
        if body.tokens and max(body.tokens) >= vocab:
            raise ApiError(400, f"token ids must lie in [0, {vocab}) (the tokenizer's vocabulary)", param="tokens")
        decode = functools.partial(self.backend.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return web.json_response({"prompt": await asyncio.to_thread(decode) if len(body.tokens) > INLINE_CHARS else decode()})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's ``GET /tokenizer_info``: the tokenizer's class, special tokens, chat template
        and the context length, what a client needs to tokenize as this server does (e.g.
        lm-evaluation-harness's remote tokenizer, which looks for this and ``/tokenize``)."""
        self._identify(request)
        tokenizer = self.backend.tokenizer
        return web.json_response({
            "tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": self.backend.max_model_len,
            "vocab_size": len(tokenizer)})
