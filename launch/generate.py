"""``goodspeed generate``: one request to a verifier's local serving, streamed to the terminal."""

from __future__ import annotations

import json
import sys

import grpc

from goodspeed.drafter.credentials import ClientTLS, bearer_metadata, open_channel
from goodspeed.drafter.serde import logprobs_from_pb
from goodspeed.serving.sampling_wire import sampling_to_pb
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2_grpc as pb_grpc


def generate_request(prompt: str | None = None, prompt_ids: list[int] | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, tpot_slo_ms: float | None = None, ignore_eos: bool = False,
                     request_id: str = "", sampling: SamplingParams | None = None, logprobs: int | None = None,
                     prompt_logprobs: int | None = None) -> pb.GenerateRequest:
    """The message as given: ``temperature``, ``top_k`` and ``top_p`` go as they are (the verifier
    checks them); ``sampling``, when given, replaces them (and carries min-p, the penalties and a
    logit bias). ``logprobs`` / ``prompt_logprobs``: the generated / prompt tokens' log-probabilities
    under the target, each with that many most probable tokens (None: not asked for)."""
    settings = (sampling_to_pb(sampling) if sampling is not None
                else pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    message = pb.GenerateRequest(
        prompt=prompt or "", prompt_ids=prompt_ids or [], max_new_tokens=max_new_tokens, sampling=settings,
        tpot_slo_ms=tpot_slo_ms or 0.0, ignore_eos=ignore_eos, request_id=request_id,
    )
    if logprobs is not None:
        message.logprobs = logprobs
    if prompt_logprobs is not None:
        message.prompt_logprobs = prompt_logprobs
    return message


def _logprob_dicts(logprobs) -> list[dict]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank, "top": [list(t) for t in lp.top]}
            for lp in logprobs_from_pb(logprobs)]


def collect(chunks, on_text=None, request: pb.GenerateRequest | None = None) -> dict:
    """Fold a Generate stream into one result (``on_text`` sees each text delta as it arrives).
    With the ``request`` that asked for log-probabilities, the result has ``logprobs`` (one per
    generated token) and ``prompt_logprobs`` (one per prompt token after the first), each entry
    ``token_id``, ``logprob``, ``rank`` (vLLM's: a prompt token's; null for a generated one, and
    from a verifier older than the field) and ``top`` as ``[id, logprob]`` pairs; a verifier that
    does not send them (one older than these fields) raises :class:`MissingLogprobsError`. A request whose sampling sets a field the verifier's first
    chunk does not say it applies (past ``sampling_fields``) raises :class:`OlderVerifierError`
    before any text."""
    out = {"request_id": "", "prompt_ids": [], "token_ids": [], "text": "", "token_times_s": [], "finish_reason": None,
           "tpot_s": None, "num_drafted": 0, "num_accepted": 0}
    needed = sampling_fields_used(request.sampling) if request is not None else 0
    first = True
    wants_logprobs = request is not None and request.HasField("logprobs")
    wants_prompt = request is not None and request.HasField("prompt_logprobs")
    if wants_logprobs:
        out["logprobs"] = []
    if wants_prompt:
        out["prompt_logprobs"] = None
    for chunk in chunks:
        if first and needed > ORIGINAL_SAMPLING_FIELDS and chunk.sampling_fields < needed:  # before any text is shown
            field = pb.SamplingParams.DESCRIPTOR.fields_by_number[needed].name
            raise OlderVerifierError(f"the verifier does not say it applies SamplingParams.{field} (it applies fields up to "
                                     f"{chunk.sampling_fields}; 0: it is older than GenerateChunk.sampling_fields): upgrade "
                                     "it or leave that setting out")
        first = False
        out["request_id"] = chunk.request_id or out["request_id"]
        if chunk.prompt_ids:
            out["prompt_ids"] = list(chunk.prompt_ids)
        if wants_logprobs and len(chunk.logprobs) != len(chunk.token_ids):
            raise MissingLogprobsError("the verifier sent tokens without their log-probabilities (is it older than "
                                       "GenerateRequest.logprobs?)")
        elif wants_logprobs:
            out["logprobs"] += _logprob_dicts(chunk.logprobs)
        if wants_prompt and out["prompt_logprobs"] is None and chunk.token_ids:
            if len(chunk.prompt_logprobs) != max(len(out["prompt_ids"]) - 1, 0):
                raise MissingLogprobsError("the verifier did not score the prompt (is it older than "
                                           "GenerateRequest.prompt_logprobs?)")
            out["prompt_logprobs"] = _logprob_dicts(chunk.prompt_logprobs)
        out["token_ids"] += list(chunk.token_ids)
        out["token_times_s"] += list(chunk.token_times_s)
        out["text"] += chunk.text
        if on_text is not None and chunk.text:
            on_text(chunk.text)
        if chunk.finished:
            out.update(finish_reason=chunk.finish_reason, tpot_s=chunk.tpot_s, num_drafted=chunk.num_drafted, num_accepted=chunk.num_accepted)
    return out


# temperature, top_k, top_p: every verifier applies them
ORIGINAL_SAMPLING_FIELDS = 3


def sampling_fields_used(sampling: pb.SamplingParams) -> int:
    """The highest SamplingParams field number that ``sampling`` sets (0: none)."""
    return max((field.number for field, _ in sampling.ListFields()), default=0)


class OlderVerifierError(RuntimeError):
    """The verifier is older than something the request needs: it says it does not apply a
    setting, or its stream lacks a field the request asked for."""


class MissingLogprobsError(OlderVerifierError):
    """A Generate stream lacks the log-probabilities its request asked for."""


CONNECT_TIMEOUT_S = 30.0  # how long to wait for a verifier to answer at all
SAY_WAITING_AFTER_S = 1.0  # then say what it is waiting for, so a wrong address is not a silent stall


def run_generate(address: str, request: pb.GenerateRequest, as_json: bool, timeout_s: float | None = None,
                 token: str | None = None, tls: ClientTLS | None = None) -> int:
    metadata = bearer_metadata(token)
    with open_channel(address, tls) as channel:
        stub = pb_grpc.VerifierStub(channel)
        ready = grpc.channel_ready_future(channel)
        try:
            try:
                ready.result(timeout=SAY_WAITING_AFTER_S)
            except grpc.FutureTimeoutError:
                print(f"goodspeed generate: waiting for a verifier at {address} (up to {CONNECT_TIMEOUT_S:.0f} s)", file=sys.stderr)
                ready.result(timeout=CONNECT_TIMEOUT_S - SAY_WAITING_AFTER_S)
        except grpc.FutureTimeoutError:
            print(f"goodspeed generate: no verifier answers at {address}", file=sys.stderr)
            return 2
        try:
            if as_json:
                result = collect(stub.Generate(request, timeout=timeout_s, metadata=metadata), request=request)
                print(json.dumps(result))
            else:
                result = collect(stub.Generate(request, timeout=timeout_s, metadata=metadata), on_text=lambda t: print(t, end="", flush=True),
                                 request=request)
                print()
                rate = f", {1 / result['tpot_s']:.1f} tok/s" if result["tpot_s"] else ""
                print(f"[{len(result['token_ids'])} tokens, {result['finish_reason']}{rate}, "
                      f"accepted {result['num_accepted']}/{result['num_drafted']} drafted]", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"goodspeed generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except OlderVerifierError as exc:
            print(f"goodspeed generate: {exc}", file=sys.stderr)
            return 1
    return 0 if result["finish_reason"] in ("length", "eos") else 1
