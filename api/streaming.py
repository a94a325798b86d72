"""How a reply goes out: every choice's backend stream opened (or none), read into text pieces with
their log-probabilities, and sent whole or as server-sent events; a failure after the headers went
out is said in the stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web

from goodspeed.api.completions import Reply
from goodspeed.api.errors import ApiError
from goodspeed.api.text import TextStream
from goodspeed.api.tools import merge
from goodspeed.serving.aio import keep_until_done
from goodspeed.serving.generation import Delta, GenerationRequest, RequestError, StopStringMatched



def _raise_failure(delta: Delta) -> None:
    """A last delta that ended in failure, as the client's error."""
    if delta.error is not None:
        raise ApiError.of(delta.error)
    if delta.finish_reason not in ("eos", "length"):
        raise ApiError(500, f"generation failed: {delta.finish_reason}")


def _finish_reason(stream: TextStream, reason: str | None) -> str:
    return "stop" if stream.stopped or reason == "eos" else "length"


class Streaming:
    """The replies of :class:`~goodspeed.api.server.OpenAIServer`, whole or streamed (a mixin)."""

    async def _open_all(self, gens: list[GenerationRequest], identity: str) -> list:
        """Every choice's backend stream, or none. The choices are admitted concurrently (on an edge
        node a choice may wait for a session, which an earlier choice of the same request frees);
        a refusal (queue full, ...) raises its 4xx after cancelling the others' admissions and
        closing the streams already opened, which cancels their requests."""
        if len(gens) == 1:
            return [await self._open(gens[0], identity)]
        tasks = [asyncio.ensure_future(self._open(gen, identity)) for gen in gens]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            return [task.result() for task in tasks]
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._close_all([t.result() for t in tasks if not t.cancelled() and t.exception() is None])
            raise

    async def _open(self, gen: GenerationRequest, identity: str):
        try:
            return await self.backend.open(gen, identity)
        except RequestError as exc:
            raise ApiError.of(exc) from None

    @staticmethod
    async def _close_all(streams: list) -> None:
        for deltas in streams:
            await deltas.aclose()

    @staticmethod
    async def _pieces(deltas, text: TextStream, logprobs: list | None, prompt: list | None = None, prompt_only: bool = False):
        """Yield ``(new text, finish_reason or None, log-probabilities, token ids)`` from an opened
        backend stream until the end: the ids of the tokens consumed since the last yield (a stop
        string ends consumption; text held back still has its tokens here), and with ``logprobs``
        (a list this fills with every token's :class:`TokenLogprob`) theirs, else None. ``prompt``: a list
        this fills with the prompt tokens' log-probabilities (after the first), which the first
        delta brings. ``prompt_only`` (completions' ``max_tokens = 0``): end with ``length`` when the
        (one-token) request has finished, none of its tokens consumed. The backend stream is always
        closed, which cancels the request if it did not finish: after a stop string, by throwing
        :class:`StopStringMatched` into it once the last piece has gone out."""
        sent, scored, cut = 0, False, False

        def new() -> tuple[list | None, list[int]]:
            nonlocal sent
            out = None if logprobs is None else logprobs[sent : text.consumed]
            ids, sent = text.consumed_ids[sent:], text.consumed
            return out, ids

        try:
            async for delta in deltas:
                if prompt is not None and not scored and delta.token_ids:  # the first verdict's (a failure has none)
                    if delta.prompt_logprobs is None:
                        raise ApiError(502, "the verifier sent no prompt log-probabilities though the request asked for "
                                            "them (is it older than this node?)")
                    prompt.extend(delta.prompt_logprobs)
                    scored = True
                if prompt_only:  # the one token the request generates is not the answer: wait for its end
                    if delta.finished:
                        _raise_failure(delta)
                        if prompt is not None and not scored:
                            raise ApiError(502, "the verifier sent no prompt log-probabilities though the request asked for them")
                        yield "", "length", None if logprobs is None else [], []
                        return
                    continue
                if logprobs is not None and delta.token_ids:
                    if delta.logprobs is None or len(delta.logprobs) != len(delta.token_ids):
                        raise ApiError(502, "the verifier sent tokens without the log-probabilities asked for "
                                            "(is it older than this node?)")
                    logprobs.extend(delta.logprobs)
                # inline: a step's few tokens decode in a window of a few tokens (microseconds)
                piece = text.push(delta.token_ids) if delta.token_ids else ""
                if text.stopped:
                    cut = not delta.finished
                    yield piece, "stop", *new()
                    return
                if delta.finished:
                    _raise_failure(delta)
                    yield piece + text.finish(), _finish_reason(text, delta.finish_reason), *new()
                    return
                if piece:
                    yield piece, None, *new()
        finally:
            if cut:  # after the last piece went out: tell the backend why its request ends early
                with contextlib.suppress(StopStringMatched, StopAsyncIteration):
                    await deltas.athrow(StopStringMatched())
            await deltas.aclose()

    async def _choices(self, streams: list, texts: list[TextStream], logprobs: list[list] | None,
                       prompts: list[list] | None = None, prompt_only: bool = False):
        """Yield ``(choice index, new text, finish_reason or None, log-probabilities or None, token ids)`` from
        every choice's stream as its pieces come (:meth:`_pieces`; ``logprobs[i]``: choice ``i``'s
        list to fill, or None when not asked for; ``prompts[i]`` likewise for its prompt's
        log-probabilities, filled before its first piece; ``prompt_only`` as :meth:`_pieces`). A
        choice that fails raises here; closing this generator (the callers do, in a ``finally``)
        stops every choice's task, and each task's :meth:`_pieces` closes its stream."""
        if len(streams) == 1:
            async with contextlib.aclosing(self._pieces(streams[0], texts[0], logprobs and logprobs[0],
                                                        prompts and prompts[0], prompt_only)) as runs:
                async for piece, reason, lps, ids in runs:
                    yield 0, piece, reason, lps, ids
            return
        queue: asyncio.Queue = asyncio.Queue()
        end = object()

        async def pump(i: int) -> None:
            try:
                async with contextlib.aclosing(self._pieces(streams[i], texts[i], logprobs and logprobs[i],
                                                            prompts and prompts[i], prompt_only)) as runs:
                    async for piece, reason, lps, ids in runs:
                        queue.put_nowait((i, piece, reason, lps, ids))
                queue.put_nowait((i, end, None, None, None))
            except Exception as exc:  # said by the consumer; a cancelled pump has nothing to say
                queue.put_nowait((i, exc, None, None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            running = len(tasks)
            while running:
                i, piece, reason, lps, ids = await queue.get()
                if piece is end:
                    running -= 1
                elif isinstance(piece, Exception):
                    raise piece
                else:
                    yield i, piece, reason, lps, ids
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(self, identity: str, rid: str, gens: list[GenerationRequest], body, chat: bool,
                        echoes: list[str] | None = None, replies: list[Reply] | None = None) -> web.Response:
        """The whole response at once; ``echoes[i]``: the text choice ``i`` starts with (completions'
        ``echo``: its prompt, whose tokens' log-probabilities come first where asked for; chat's:
        the last message's); ``replies[i]``: the reader of chat choice ``i``'s reasoning and tool
        calls, where the request or the server asks for either."""
        texts = [self._text_stream(body, gen) for gen in gens]
        pieces: list[list[str]] = [[] for _ in gens]
        reasons: list[str | None] = [None] * len(gens)
        received = None if gens[0].logprobs is None else [[] for _ in gens]
        scored = None if gens[0].prompt_logprobs is None else [[] for _ in gens]
        kept: list[list] = [[] for _ in gens]
        kept_ids: list[list[int]] = [[] for _ in gens]
        streams = await self._open_all(gens, identity)  # a refusal (queue full, ...) raises its 4xx here
        # max_tokens = 0 is completions' scoring call (chat's max_tokens is >= 1)
        runs = self._choices(streams, texts, received, scored, prompt_only=body.max_tokens == 0)
        running = len(gens)  # choices not ended yet
        try:
            async for i, piece, reason, lps, ids in runs:
                pieces[i].append(piece)
                reasons[i] = reason
                kept[i] += lps or []
                kept_ids[i] += ids
                running -= reason is not None
                if not running:  # every choice has ended: the rest is the backends' cleanup
                    break
        finally:
            await self._close(runs, streams, detach=not running)
        messages = [{"role": "assistant", "content": (echoes[i] if echoes else "") + "".join(p)} for i, p in enumerate(pieces)]
        if replies is not None:  # the reply read by the code a stream's is
            for i, (message, reply) in enumerate(zip(messages, replies)):
                reasoning, content, calls = reply.push("".join(pieces[i]), final=True)
                text = (echoes[i] if echoes else "") + content
                message["content"] = text if text or not (calls or reasoning) else None
                if reasoning and body.include_reasoning:
                    message["reasoning_content"] = message["reasoning"] = reasoning
                if calls:
                    message["tool_calls"] = merge(calls)
                reasons[i] = reply.finish_reason(reasons[i])
        contents = [m["content"] for m in messages]
        echoed = None if chat or echoes is None or scored is None else body.logprobs  # completions' echo with logprobs
        logprobs = [None if received is None else self._logprobs(self._echoed(gens[i], scored and scored[i], echoed) + kept[i],
                                                                 chat, 0, body.return_tokens_as_token_ids)
                    for i in range(len(gens))]
        choices = [{"index": i, "message": messages[i], "logprobs": lp, "finish_reason": r, "stop_reason": t.stop_reason}
                   if chat else {"index": i, "text": c, "logprobs": lp, "finish_reason": r, "stop_reason": t.stop_reason}
                   for i, (c, r, lp, t) in enumerate(zip(contents, reasons, logprobs, texts))]
        extra = {}
        if body.prompt_logprobs is not None:  # vLLM's: a completion choice's own, chat's once (one prompt)
            if chat:
                extra["prompt_logprobs"] = self._prompt_logprobs(scored[0], body.prompt_logprobs)
            else:
                for i, choice in enumerate(choices):
                    choice["prompt_logprobs"] = self._prompt_logprobs(scored[i], body.prompt_logprobs)
        if body.return_token_ids:  # vLLM's: chat's prompt once (one prompt), a completion choice's its own
            for i, choice in enumerate(choices):
                choice.update({} if chat else {"prompt_token_ids": gens[i].prompt_ids}, token_ids=kept_ids[i])
            if chat:
                extra["prompt_token_ids"] = gens[0].prompt_ids
        return web.json_response({
            "id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.backend.model_ids[0], "choices": choices,
            "usage": self._usage(gens, body.n, texts), **extra})

    async def _stream(self, request: web.Request, identity: str, rid: str, gens: list[GenerationRequest], body,
                      chat: bool, echoes: list[str] | None = None, replies: list[Reply] | None = None) -> web.StreamResponse:
        """Admit every choice (a refusal is still a plain 4xx), send the headers at once (so the
        first token's chunk is all that is left on its path), then one event per new text of a
        choice, which the event's ``index`` names. With ``echoes`` (completions' ``echo``), a
        choice's first event is its prompt text (and its tokens' log-probabilities, where asked for);
        chat's echo follows each choice's role event. With ``replies`` (chat's readers, as
        :meth:`_complete`), a choice's text goes through its reader: the reasoning and content it
        lets out, and ``tool_calls`` deltas as its calls complete."""
        texts = [self._text_stream(body, gen) for gen in gens]
        received = None if gens[0].logprobs is None else [[] for _ in gens]
        scored = None if gens[0].prompt_logprobs is None else [[] for _ in gens]
        offsets = [0] * len(gens)  # completions' text_offset: characters of each choice's tokens so far
        streams = await self._open_all(gens, identity)
        runs = self._choices(streams, texts, received, scored, prompt_only=body.max_tokens == 0)
        envelope = self._envelope(rid, chat, int(time.time()))
        usage = {"usage": None} if body.include_usage else {}

        def chunk(i: int, piece: str, reason: str | None, lps: list | None = None, role: bool = False,
                  ids: list[int] = (), prompt: bool = False, calls: list[dict] = (), reasoning: str = "") -> dict:
            """Choice ``i``'s event; with ``return_token_ids`` its ``token_ids`` (``ids``) and, in the
            first event (``prompt``), the prompt's: chat's in the envelope, a completion choice's its own."""
            logprobs = None
            if lps is not None:
                logprobs = self._logprobs(lps, chat, offsets[i], body.return_tokens_as_token_ids)
                offsets[i] += sum(len(t) for t in logprobs.get("tokens", ()))
            tokens = {"token_ids": list(ids)} if body.return_token_ids else {}
            if reason is not None:  # vLLM's: with the finish_reason, the stop string or token that ended the text
                tokens["stop_reason"] = texts[i].stop_reason
            head = {"prompt_token_ids": gens[i].prompt_ids} if body.return_token_ids and prompt else {}
            counts = {"usage": self._usage(gens, body.n, texts)} if body.continuous_usage else usage  # the tokens so far
            if chat:
                delta = {"role": "assistant", "content": piece} if role else ({"content": piece} if piece else {})
                if reasoning and body.include_reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = reasoning
                if calls:
                    delta["tool_calls"] = list(calls)
                return {**envelope, **head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                                                         **tokens}], **counts}
            return {**envelope, "choices": [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": reason,
                                             **head, **tokens}], **counts}

        running = len(gens)  # choices not ended yet
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)

            async def send(payload: dict) -> None:
                await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

            try:
                opened = [chat] * len(gens)  # a choice's first event (its prompt's ids, where asked for) was sent
                if chat:
                    for i in range(len(gens)):
                        await send(chunk(i, "", None, role=True, prompt=i == 0))
                        if echoes is not None:  # vLLM's chat echo: the last message's text, after the role
                            await send(chunk(i, echoes[i], None))
                async for i, piece, reason, lps, ids in runs:
                    if echoes is not None and not opened[i]:  # the prompt's log-probabilities came with its first delta
                        opened[i] = True
                        await send(chunk(i, echoes[i], None, None if received is None else self._echoed(gens[i], scored and scored[i], body.logprobs),
                                         prompt=True))
                    reasoning, calls = "", []
                    if replies is not None:
                        reasoning, piece, calls = replies[i].push(piece, final=reason is not None)
                        reason = reason and replies[i].finish_reason(reason)
                        if not (reasoning or piece or calls or reason or lps or body.return_token_ids):
                            continue  # held back by the reader: nothing to say yet
                    await send(chunk(i, piece, reason, lps, ids=ids, prompt=not opened[i], calls=calls, reasoning=reasoning))
                    opened[i] = True
                    running -= reason is not None
                    if not running:  # every choice has ended: the rest is the backends' cleanup
                        break
            except ApiError as exc:  # a choice failed after the headers went out: say so in the stream
                await send(exc.body())
            if body.include_usage:
                await send({**envelope, "choices": [], "usage": self._usage(gens, body.n, texts)})
            await response.write(b"data: [DONE]\n\n")
        finally:
            await self._close(runs, streams, detach=not running)
        await response.write_eof()
        return response

    async def _close(self, runs, streams: list, detach: bool) -> None:
        """Close a response's choices and its backend streams (also when cancelled before the first
        piece). Once every choice has ended (``detach``), the response goes out without waiting
        for this: a request a stop string cut short is cancelled on its verifier (an edge node: a
        round trip), which its client need not wait for; :meth:`stop` waits for it."""

        async def close() -> None:
            await runs.aclose()
            await self._close_all(streams)

        if detach:
            keep_until_done(close(), self._cleanups)
        else:
            await close()
