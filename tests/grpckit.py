"""Run a real verifier server on 127.0.0.1:0 in a background event-loop thread (tests only)."""

import asyncio
import io
import json
import threading

from goodspeed.drafter.client import DrafterClient, DrafterConfig
from goodspeed.drafter.runner import DraftRunner
from goodspeed.proto.goodspeed.v1 import goodspeed_pb2 as pb
from goodspeed.verifier.observability import JsonLog
from goodspeed.verifier.daemon import make_server
from goodspeed.verifier.server import ServerConfig, VerifierService


class ServerThread:
    def __init__(self, engine, local=None, tokenizer=None, **config) -> None:
        self.log_stream = io.StringIO()
        from goodspeed.launch.daemons.serve import make_http_front

        self.server = make_server(engine, ServerConfig(**config), log=JsonLog(self.log_stream), local=local, tokenizer=tokenizer,
                                  http_front=make_http_front)
        self.loop = asyncio.new_event_loop()
        self.port = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        self.port = self.run(self.server.start())
        return self

    def __exit__(self, *exc) -> None:
        self.run(self.server.stop(0.2))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_for(self, condition, tries: int = 500) -> bool:
        """Poll ``condition()`` between turns of the server's loop, a bounded number of times;
        whether it came true."""
        for _ in range(tries):
            if condition():
                return True
            self.run(asyncio.sleep(0.01))
        return condition()

    def events(self, kind: str | None = None) -> list[dict]:
        lines = [json.loads(line) for line in self.log_stream.getvalue().splitlines() if line.startswith("{")]
        return [e for e in lines if kind is None or e["event"] == kind]


def older_verifier(monkeypatch, reply_field: str) -> None:
    """Make every verifier in the test answer StartRequest as one older than ``reply_field``
    (a feature it then leaves out of ``StartRequestReply.features``, and the flag of that name,
    where there is one, unset) would."""
    start = VerifierService.StartRequest

    async def old_start(self, request, context):
        reply = await start(self, request, context)
        if reply_field in pb.StartRequestReply.DESCRIPTOR.fields_by_name:
            reply.ClearField(reply_field)
        kept = [f for f in reply.features if f != reply_field]
        del reply.features[:]
        reply.features.extend(kept)
        return reply

    monkeypatch.setattr(VerifierService, "StartRequest", old_start)


def run_clients(address, drafts, prompts, max_new, sampling=None, runner=DraftRunner):
    """One DrafterClient thread per draft (default seeds: fresh OS entropy), each generating its
    prompts with ``runner(draft)``; returns each client's outputs."""
    outputs = {}

    def work(i, draft):
        config = DrafterConfig(address, f"d{i}", max_new_tokens=max_new, **({} if sampling is None else {"sampling": sampling}))
        client = DrafterClient(config, runner(draft))
        client.wait_until_serving()
        client.join()
        outputs[i] = [client.generate(str(k), p).token_ids for k, p in enumerate(prompts[i])]
        client.close()

    threads = [threading.Thread(target=work, args=(i, d)) for i, d in enumerate(drafts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return outputs


class NodeThread:
    """An edge node (goodspeed.drafter.node) with its OpenAI API on 127.0.0.1:0, in a background
    event-loop thread, drafting with ``draft`` against the verifier at ``address``."""

    def __init__(self, address, draft, tokenizer, name="edge", api_key=None, http=None, **config) -> None:
        from goodspeed.drafter.node import EdgeNode, NodeConfig

        self.node = EdgeNode(NodeConfig(address, name, **config), draft, tokenizer)
        self.api_key, self.http_options = api_key, dict(http or {})  # http: more OpenAIServer keywords
        self.loop = asyncio.new_event_loop()
        self.port = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "NodeThread":
        from goodspeed.api.errors import ApiError
        from goodspeed.api.server import OpenAIServer

        def authorize(header):
            if self.api_key is not None and header != f"Bearer {self.api_key}":
                raise ApiError(401, "invalid API key")
            return "app"

        self._thread.start()
        self.run(self.node.start())
        self.http = OpenAIServer(self.node, self.node.registry, authorize=authorize, **self.http_options)
        self.port = self.run(self.http.start("127.0.0.1", 0))
        return self

    def __exit__(self, *exc) -> None:
        self.run(self.http.stop())
        self.run(self.node.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
