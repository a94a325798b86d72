"""Helpers for the OpenAI API tests: concurrent requests through the official client, and a
server's metrics as a dict."""

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
