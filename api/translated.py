"""OpenAI's Responses API and Anthropic's Messages API as routes of :class:`~goodspeed.api.server.OpenAIServer`:
each request read as the chat completion it stands for, its reply written in its own protocol's
objects and events (:mod:`goodspeed.api.responses`, :mod:`goodspeed.api.messages`)."""

from __future__ import annotations


from aiohttp import web

from goodspeed.api import messages as anthropic_messages
from goodspeed.api import responses as openai_responses
from goodspeed.api.completions import Reply
from goodspeed.api.messages import MessagesRequest, MessageWriter, message_id
from goodspeed.api.messages import error_body as anthropic_error
from goodspeed.api.errors import ApiError, parse_body, renamed
from goodspeed.api.response_store import page_of_items
from goodspeed.api.responses import ResponsesRequest, ResponseWriter, as_messages
from goodspeed.api.text import TextStream
from goodspeed.serving.generation import GenerationRequest




class ResponsesAndMessages:
    """``/v1/responses`` (with stored responses) and ``/v1/messages`` (a mixin)."""

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's ``POST /v1/responses`` (:mod:`goodspeed.api.responses`): the chat completion
        the request stands for, its reply as output items, whole or as the Responses events."""
        identity = self._identify(request)
        body = parse_body(ResponsesRequest, await self._json(request))
        self._check_model(body.model)
        history: list[dict] = []
        if body.previous_response_id is not None:
            previous, conversation = self.stored.get(identity, body.previous_response_id, param="previous_response_id")
            history = conversation + as_messages(previous["output"])
        chat = body.to_chat(history)
        try:
            rid, gens, replies = await self._chat_generations("resp", chat, read=True)
        except ApiError as exc:
            raise renamed(exc, openai_responses.FIELD_NAMES) from None
        text = self._text_stream(chat, gens[0])
        writer = ResponseWriter(rid, self.backend.model_ids[0], body, len(gens[0].prompt_ids), text)
        response, ended = await self._translated(request, identity, gens, text, replies[0], writer, body.stream)
        if body.store and ended:  # what a later turn continues (instructions are not carried)
            self.stored.put(identity, writer.whole(), history + body.messages(), body.input_items())
        return response

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's ``POST /v1/messages`` (:mod:`goodspeed.api.messages`): the chat completion
        the request stands for, its reply as content blocks, whole or as Anthropic's events;
        refusals in Anthropic's error object."""
        try:
            identity = self._identify(request, anthropic=True)
            body = parse_body(MessagesRequest, await self._json(request))
            self._check_model(body.model)
            chat = body.to_chat()
            try:
                _, gens, replies = await self._chat_generations("msg", chat, read=True)
            except ApiError as exc:
                raise renamed(exc, anthropic_messages.FIELD_NAMES) from None
            text = self._text_stream(chat, gens[0])
            writer = MessageWriter(message_id(), self.backend.model_ids[0], len(gens[0].prompt_ids), text)
            return (await self._translated(request, identity, gens, text, replies[0], writer, body.stream))[0]
        except ApiError as exc:
            return web.json_response(anthropic_error(exc), status=exc.status)

    async def count_message_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt tokens a message request's
        conversation and tools make, rendered as :meth:`messages` renders them."""
        try:
            self._identify(request, anthropic=True)
            raw = await self._json(request)
            if isinstance(raw, dict):
                raw = {"max_tokens": 1, **raw}  # count_tokens takes no max_tokens
            body = parse_body(MessagesRequest, raw)
            self._check_model(body.model)
            chat = body.to_chat()
            ids = await self._tokenize(await self._render_chat(chat), chat.add_special_tokens)
            return web.json_response({"input_tokens": len(ids)})
        except ApiError as exc:
            return web.json_response(anthropic_error(exc), status=exc.status)

    async def _translated(self, request: web.Request, identity: str, gens: list[GenerationRequest], text: TextStream,
                          reply: Reply, writer, stream: bool) -> tuple[web.StreamResponse, bool]:
        """One chat choice's reply through ``writer`` (the Responses or the Messages API's: its
        ``opening``, ``push``, ``finish`` and ``failed`` events, framed by its ``frame``, and its
        ``whole`` body): streamed as those events, or whole. Returns the response and whether the
        reply ended (not failed)."""
        streams = await self._open_all(gens, identity)  # a refusal (queue full, ...) raises its 4xx here
        runs = self._choices(streams, [text], None)
        response, running, failed = None, True, False

        async def send(events: list[dict]) -> None:
            for event in events:
                await response.write(writer.frame(event))

        try:
            if stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await response.prepare(request)
                await send(writer.opening())
            try:
                async for _, piece, reason, _, _ in runs:
                    events = writer.push(*reply.push(piece, final=reason is not None))
                    if reason is not None:
                        events += writer.finish(reply.finish_reason(reason))
                        running = False
                    if stream:
                        await send(events)
                    if not running:
                        break
                if running:
                    raise ApiError(502, "the generation ended without a finish reason")
            except ApiError as exc:  # a failure after the headers went out: said in the stream
                if not stream:
                    raise
                failed = True
                await send(writer.failed(exc))
        finally:
            await self._close(runs, streams, detach=not running)
        if not stream:
            return web.json_response(writer.whole()), True
        await response.write_eof()
        return response, not failed

    async def get_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/responses/{id}``: a stored response, to its owner (else 404)."""
        identity = self._identify(request)
        whole, _ = self.stored.get(identity, request.match_info["response_id"])
        return web.json_response(whole)

    async def response_input_items(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/responses/{id}/input_items``: a page of a stored response's own input
        items (:func:`goodspeed.api.response_store.page_of_items`), to its owner (else 404)."""
        identity = self._identify(request)
        items = self.stored.input_items(identity, request.match_info["response_id"])
        return web.json_response(page_of_items(items, request.query))

    async def delete_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``DELETE /v1/responses/{id}``: forget a stored response (its owner's; else 404)."""
        identity = self._identify(request)
        response_id = request.match_info["response_id"]
        self.stored.delete(identity, response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})
