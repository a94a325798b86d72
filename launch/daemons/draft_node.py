"""``goodspeed drafter``: one edge draft node, generating its prompt file through a verifier or
(``--serve``) serving applications through the OpenAI API (:mod:`goodspeed.drafter.node`). A node
drafting by lookup alone never imports torch (tests/launch/test_light_node.py)."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.credentials import client_tls, read_token
from goodspeed.drafter.prompts import load_prompts
from goodspeed.launch.spec import DrafterSpec
from goodspeed.lm.decoding.draft_source import DraftSpec
from goodspeed.lm.models.tokenizers import load_tokenizer
from goodspeed.lm.decoding.params import SamplingParams

if TYPE_CHECKING:
    from goodspeed.lm.models.loading import LoadedModel


def run_drafter(spec: DrafterSpec, verifier: str, out_path: str | None = None, connect_timeout_s: float = 60.0, progress: bool = True) -> int:
    """Generate ``spec``'s prompts through the verifier at ``verifier`` (HOST:PORT): one at a time,
    or ``spec.concurrency`` at once through the node's batched drafting."""
    if spec.concurrency > 1 and spec.proactive:
        raise SystemExit(f"goodspeed drafter {spec.name}: proactive drafting runs one request at a time; with "
                         "--concurrency > 1 give --no-proactive (the node drafts its requests together instead)")
    _refuse_unusable(spec)
    prompt_path = spec.prompt_path()  # before the draft loads (seconds for a real one): a missing file is said at once
    draft = load_draft(spec)
    prompts = load_prompts(prompt_path, draft.tokenizer)[: spec.max_prompts]
    out = open(out_path, "w", encoding="utf-8") if out_path else sys.stdout
    try:
        if spec.concurrency > 1 or draft.source.lookup is not None or spec.adapt:
            if spec.concurrency == 1 and spec.proactive:
                _say(spec.name)("proactive drafting is the single-request client's; with --adapt this drafter drafts "
                                "through the node" if spec.adapt else
                                f"proactive drafting is a draft model's alone; {draft.source} drafts through the node")
            asyncio.run(generate_concurrently(spec, verifier, draft.drafter, draft.tokenizer, draft.fingerprint, prompts, out,
                                              connect_timeout_s, progress))
        else:
            _generate_one_at_a_time(spec, verifier, draft.model, prompts, out, connect_timeout_s, progress)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


@dataclass
class LoadedDraft:
    """A drafter's draft source, loaded: what the node drafts with (a model or a source), the
    model if one was loaded, and the tokenizer the node serves with."""

    source: DraftSpec
    drafter: object
    model: LoadedModel | None
    tokenizer: object
    fingerprint: str


def load_draft(spec: DrafterSpec) -> LoadedDraft:
    """Load ``spec.draft`` (:mod:`goodspeed.lm.decoding.draft_source`): its model, if it names one, and the
    tokenizer (the model's, or ``spec.tokenizer`` for a lookup alone; both must agree)."""
    try:
        source = DraftSpec.parse(spec.draft)
    except ValueError as exc:
        raise SystemExit(f"goodspeed drafter {spec.name}: --draft: {exc}") from None
    if source.model is None and spec.tokenizer is None:
        raise SystemExit(f"goodspeed drafter {spec.name}: --draft {spec.draft} loads no model: give --tokenizer MODEL")
    model = None
    if source.model:  # the model runtime (torch) is loaded only for a source with a model
        from goodspeed.lm.models.loading import load_causal_lm

        model = load_causal_lm(source.model, dtype=spec.dtype, device=spec.device)
    tokenizer, fingerprint = (model.tokenizer, model.fingerprint) if model else load_tokenizer(spec.tokenizer)
    if model is not None and spec.tokenizer is not None and load_tokenizer(spec.tokenizer)[1] != fingerprint:
        raise SystemExit(f"goodspeed drafter {spec.name}: --tokenizer {spec.tokenizer} is not the draft model's tokenizer")
    if source.lookup is None:
        drafter = model.model
    else:
        drafter = source.build(model.model if model else None, len(tokenizer), spec.proposal_top_k,
                               cuda_graphs=spec.cuda_graphs, torch_compile=spec.torch_compile)
    return LoadedDraft(source, drafter, model, tokenizer, fingerprint)


def _generate_one_at_a_time(spec: DrafterSpec, verifier: str, draft: LoadedModel, prompts, out, connect_timeout_s: float,
                            progress: bool) -> None:
    """The prompts through a :class:`DrafterClient`, one request after another (proactive
    drafting included), one JSONL record per request."""
    from goodspeed.drafter.runner import WARM_UP_NOTICE, DraftRunner

    eos = draft.tokenizer.eos_token_id
    config = DrafterConfig(
        **spec.routed("client"), verifier=verifier, fingerprint=draft.fingerprint,
        sampling=SamplingParams(spec.temperature, spec.top_k, spec.top_p),
        eos_token_ids=(eos,) if eos is not None else (), connect_timeout_s=connect_timeout_s,
        token=read_token(spec.token_file), tls=client_tls(spec.tls_ca, spec.tls_cert, spec.tls_key, spec.tls_server_name),
        on_wait=_say(spec.name),
    )
    client = DrafterClient(config, DraftRunner(draft.model, spec.proposal_top_k, cuda_graphs=spec.cuda_graphs,
                                                         torch_compile=spec.torch_compile))
    if spec.seed is None:  # say which fresh root was drawn, so the run can be replayed with --seed
        print(f"drafter {spec.name}: root seed {client.root_seed}", file=sys.stderr)
    if spec.cuda_graphs or spec.torch_compile:  # compiling can take a minute before the first request
        _say(spec.name)(WARM_UP_NOTICE)
        client.runner.warm_up()
    try:
        client.wait_until_serving()
        client.join()
        for prompt in tqdm(prompts, desc=spec.name, unit="req", disable=not progress, file=sys.stderr):
            result = client.generate(prompt.id, prompt.prompt_ids)
            record = {
                "id": result.id, "prompt_ids": result.prompt_ids, "token_ids": result.token_ids,
                "text": draft.tokenizer.decode(result.token_ids), "rounds": result.rounds,
                "drafted_tokens": result.drafted_tokens, "accepted_tokens": result.accepted_tokens,
                "transit_tokens": result.transit_tokens, "wall_s": round(result.wall_s, 6), "repairs": result.repairs,
                "predrafted_rounds": result.predrafted_rounds, "proactive_hits": result.proactive_hits,
                "predrafted_tokens": result.predrafted_tokens, "predraft_used_tokens": result.predraft_used_tokens,
                "hidden_s": round(result.hidden_s, 6),
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
    finally:
        client.close()


def node_config(spec: DrafterSpec, verifier: str, fingerprint: str, max_concurrency: int, max_waiting: int,
                connect_timeout_s: float):
    """The :class:`~goodspeed.drafter.node.NodeConfig` of ``spec``'s device: one for the prompt
    file's concurrent requests and for ``--serve``."""
    from goodspeed.drafter.node import NodeConfig

    return NodeConfig(
        **spec.routed("node"), verifier=verifier, fingerprint=fingerprint, max_concurrency=max_concurrency,
        max_waiting=max_waiting, connect_timeout_s=connect_timeout_s, token=read_token(spec.token_file),
        tls=client_tls(spec.tls_ca, spec.tls_cert, spec.tls_key, spec.tls_server_name), on_wait=_say(spec.name))


def _refuse_unusable(spec: DrafterSpec) -> None:
    """Exit with the first setting that cannot apply to this drafter, before anything loads."""
    if (problem := spec.setting_problem()) is not None:
        name, why = problem
        raise SystemExit(f"goodspeed drafter {spec.name}: --{name.replace('_', '-')} {why}")


def _say(name: str):
    """What a drafter process tells its operator on stderr, under its name."""
    return lambda message: print(f"drafter {name}: {message}", file=sys.stderr, flush=True)


async def generate_concurrently(spec: DrafterSpec, verifier: str, draft_model, tokenizer, fingerprint: str, prompts, out,
                                connect_timeout_s: float = 60.0, progress: bool = True) -> None:
    """Generate ``prompts`` through an :class:`~goodspeed.drafter.node.EdgeNode`, ``spec.concurrency``
    requests at a time (in file order; a request starts when one ends), one JSONL record per
    finished request, in the order they finish. A request the node fails raises: a file-mode
    drafter stops, as the one-at-a-time client does."""
    from goodspeed.serving.generation import GenerationRequest
    from goodspeed.drafter.node import EdgeNode
    from goodspeed.drafter.session import RequestStats

    eos = tokenizer.eos_token_id
    sampling = SamplingParams(spec.temperature, spec.top_k, spec.top_p)
    node = EdgeNode(node_config(spec, verifier, fingerprint, spec.concurrency, 0, connect_timeout_s), draft_model, tokenizer)
    await node.start()
    if spec.seed is None:
        print(f"drafter {spec.name}: root seed {node.root_seed}", file=sys.stderr)
    queue = list(enumerate(prompts))[::-1]
    bar = tqdm(total=len(prompts), desc=spec.name, unit="req", disable=not progress, file=sys.stderr)

    async def worker() -> None:
        while queue:
            index, prompt = queue.pop()
            stats, started, tokens, reason = RequestStats(), time.perf_counter(), [], None
            # Cycled prompt files repeat ids; the node keys its draft KV by request id.
            request = GenerationRequest(f"{index}/{prompt.id}", list(prompt.prompt_ids), spec.max_new_tokens, sampling,
                                        (eos,) if eos is not None else ())
            async for delta in await node.open(request, stats=stats):
                if delta.error is not None:
                    raise RuntimeError(f"drafter {spec.name}: request {prompt.id}: {delta.error.message}")
                tokens.extend(delta.token_ids)
                reason = delta.finish_reason
            record = {"id": prompt.id, "prompt_ids": prompt.prompt_ids, "token_ids": tokens, "text": tokenizer.decode(tokens),
                      "finish_reason": reason, "rounds": stats.rounds, "drafted_tokens": stats.drafted_tokens,
                      "accepted_tokens": stats.accepted_tokens, "transit_tokens": stats.transit_tokens,
                      "wall_s": round(time.perf_counter() - started, 6),
                      "repairs": stats.repairs}
            out.write(json.dumps(record) + "\n")
            out.flush()
            bar.update(1)

    try:
        await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
    finally:
        bar.close()
        await node.stop()


def _api_key_check(path: str | None, host: str):
    """``authorize`` for the node's HTTP API: the key in ``path`` as a bearer token, or nobody
    checked — allowed on loopback only (other machines could then spend this node's verifier)."""
    from goodspeed.api.errors import ApiError
    from goodspeed.verifier.tls import is_loopback

    key = read_token(path)
    if key is None:
        if not is_loopback(host):
            raise SystemExit(f"goodspeed drafter: --serve on {host} is reachable from other machines: give --api-key-file")
        return None

    def authorize(header: str | None) -> str:
        if header is None or not hmac.compare_digest(header.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return "application"

    return authorize


def serve_node(spec: DrafterSpec, verifier: str, listen: str, max_concurrency: int = 4, max_waiting: int = 64,
               api_key_file: str | None = None, connect_timeout_s: float = 60.0, tool_parser: str | None = None,
               reasoning_parser: str | None = None) -> int:
    """Serve ``/v1/chat/completions`` and friends on ``listen`` (HOST:PORT) until SIGTERM/SIGINT;
    ``tool_parser``: the API's reader of tool calls the model chooses (:mod:`goodspeed.api.tools`);
    ``reasoning_parser``: its reader of a chat reply's reasoning (:mod:`goodspeed.api.reasoning`)."""
    from goodspeed.launch.spec import split_host_port

    try:
        host, port = split_host_port(listen)
    except ValueError as exc:
        raise SystemExit(f"goodspeed drafter: --serve {exc}") from None
    _refuse_unusable(spec)
    authorize = _api_key_check(api_key_file, host)
    return asyncio.run(_serve_node(spec, verifier, host, port, max_concurrency, max_waiting, authorize, connect_timeout_s,
                                   tool_parser, reasoning_parser))


async def _serve_node(spec, verifier, host, port, max_concurrency, max_waiting, authorize, connect_timeout_s,
                      tool_parser=None, reasoning_parser=None) -> int:
    from goodspeed.api.server import OpenAIServer
    from goodspeed.drafter.node import EdgeNode
    from goodspeed.launch.daemons.heap import freeze_startup_heap

    def log(event: str, **fields) -> None:
        print(json.dumps({"ts": round(time.time(), 6), "event": event, **fields}), file=sys.stderr, flush=True)

    draft = load_draft(spec)
    if draft.model is None:  # a node without a draft model is one short of memory: grammar masks without slices
        from goodspeed.lm.decoding.structured import use_mask_slices

        use_mask_slices(False)
    config = node_config(spec, verifier, draft.fingerprint, max_concurrency, max_waiting, connect_timeout_s)
    node = EdgeNode(config, draft.drafter, draft.tokenizer)
    await node.start()
    server = OpenAIServer(node, node.registry, authorize=authorize, tool_parser=tool_parser, reasoning_parser=reasoning_parser)
    try:
        bound = await server.start(host, port)
    except OSError as exc:  # the port is taken or not allowed: leave the verifier, say why
        from goodspeed.verifier.errors import ListenError

        await server.stop()
        await node.stop()
        raise ListenError(f"cannot serve the OpenAI API on {host}:{port}: {exc.strerror or exc}") from None
    log("serving", http=f"{host}:{bound}", verifier=verifier, model=node.model_ids[0], device=spec.name,
        max_concurrency=max_concurrency, seed=node.root_seed)
    log("heap_frozen", **freeze_startup_heap())  # full collections no longer walk the draft, tokenizer and servers
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log("stopping")
    await server.stop()
    await node.stop()
    return 0
