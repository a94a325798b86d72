"""Helpers for the OpenAI API tests: concurrent requests through the official client, a server's
metrics as a dict, and a server on a scripted backend (tool calling, reasoning) and a tokenizer whose template thinks."""

import threading
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


def complete_concurrently(api, model: str, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """One thread per prompt, all at once; each prompt's greedy completion text."""
    texts = {}

    def work(prompt):
        texts[prompt] = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **GREEDY).choices[0].text

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return texts


def metric_samples(port: int) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client: ``name + str(sorted(labels))`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        body = response.read().decode()
    return {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(body) for s in f.samples}


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "clock"}}


class Scripted:
    """A backend whose every reply is ``reply``, three tokens a delta, then EOS (cut at the
    request's ``max_tokens``); it keeps the requests it was sent (and their prompts)."""

    model_ids = ("scripted",)
    max_model_len = 4096

    def __init__(self, tokenizer, reply: str) -> None:
        self.tokenizer, self.reply, self.prompts, self.requests = tokenizer, reply, [], []

    def ready(self) -> bool:
        return True

    async def open(self, request, identity):
        from goodspeed.serving.generation import Delta

        self.prompts.append(request.prompt_ids)
        self.requests.append(request)
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False)

        async def deltas():
            whole = ids + [self.tokenizer.eos_token_id]
            if len(whole) > request.max_tokens:  # cut at max_tokens, as a backend's
                for k in range(0, request.max_tokens, 3):
                    last = k + 3 >= request.max_tokens
                    yield Delta(whole[k:min(k + 3, request.max_tokens)], finished=last, finish_reason="length" if last else None)
                return
            for k in range(0, len(ids), 3):
                yield Delta(ids[k:k + 3])
            yield Delta([self.tokenizer.eos_token_id], finished=True, finish_reason="eos")

        return deltas()


def serve(backend, **config):
    """An :class:`OpenAIServer` on a loop of its own thread: (OpenAI client, stop)."""
    import asyncio
    import threading

    import openai
    from prometheus_client import CollectorRegistry

    from goodspeed.api.server import OpenAIServer

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = OpenAIServer(backend, CollectorRegistry(), **config)
    port = asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", 0), loop).result(30)

    def stop():
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0), stop


def thinking(markers: bool):
    """The demo's BPE with a chat template that renders tools and, as Qwen3's, opens a <think>
    block for the reply unless enable_thinking is false (then an empty, closed one); ``markers``:
    with <think> and </think> as tokens of their own, as Qwen3's tokenizer has them."""
    from modelkit import chat_pair

    tokenizer = chat_pair()[2]
    tokenizer.chat_template = (
        "{% if tools %}# tools: {{ tools | tojson }}\n{% endif %}" + tokenizer.chat_template
        + "{% if add_generation_prompt %}{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
          "{% else %}<think>\n{% endif %}{% endif %}")
    if markers:
        tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer
