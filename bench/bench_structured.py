"""What a structured output grammar costs the verifier a step.

    python -m bench.bench_structured [--rows 8] [--drafted 3] [--tokenizers demo real]
                                     [--threads 2] [--repeats 30] [--no-mask-slices] [--json]

Times :meth:`goodspeed.verifier.verify_rows.RowVerifier.verify` on random logits ``[rows, drafted
+ 1, V]`` for ``rows`` chains of ``drafted`` tokens, greedy, four ways: no grammar (``plain``), and
every row constrained by a JSON schema (``json``), a regex (``regex``) or a choice of four texts
(``choice``). Each constrained row stands somewhere inside a text the grammar accepts (a different
place per row) with the next ``drafted`` tokens of that text drafted, so every position is reached
and masked: the matcher walks the chain (consume, mask, roll back) and the mask is unpacked over the
vocabulary and applied. ``--tokenizers``: the demo's (V = 2,048; built by ``goodspeed demo``) and
SmolLM2-135M's (V = 49,152; ``goodspeed models get smollm2-135m``). Median of ``--repeats`` calls
after two discarded; each setting's calls interleaved with the plain ones, so a machine that slows
down mid-run moves both.

Per tokenizer it also times a request's matcher on a 40-field schema: a copy of the one compiled
at bind time (what each request gets) against building one afresh, each with its first mask
(median of ``--repeats``).

``--acceptance`` serves instead two chat requests on the real pair (SmolLM2-135M and its distilled
draft; local serving, greedy, 40 tokens at most) under chain and AdaServe, with a JSON schema and
without one, and prints each run's steps, drafted and accepted tokens, and first reply.

``--no-mask-slices``: llguidance's views built without their slices, as an edge node with no draft
model builds them (:func:`goodspeed.lm.decoding.structured.use_mask_slices`): what the memory it
saves costs each mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from goodspeed.lm.decoding.history import TokenHistory
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.decoding.structured import Structure, use_mask_slices
from goodspeed.verifier.types import Draft
from goodspeed.verifier.verify_rows import RowInput, RowVerifier

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "line": {"type": "integer"},
                                           "args": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "line", "args"]}
# Each grammar and texts it accepts (rows stand inside them).
GRAMMARS = {
    "json": (Structure("json", json.dumps(SCHEMA)),
             ['{"name":"decode","line":337,"args":["self","s","_w"]}',  # compact: JSON grammars' default whitespace
              '{"name":"raw_decode","line":343,"args":["self","s","idx"]}']),
    "regex": (Structure("regex", r"def [a-z_]+\((self|s)(, [a-z_]+)*\):"),
              ["def raw_decode(self, s, idx):", "def decode(self, s, _w):"]),
    "choice": (Structure("choice", json.dumps(["JSONDecodeError", "JSONDecoder", "py_scanstring", "scanstring"])),
               ["JSONDecodeError", "py_scanstring"]),
}


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name == "demo":
        from goodspeed.lm.models.demo import demo_dir
        path = demo_dir() / "target"
        if not (path / "tokenizer.json").exists():
            raise SystemExit(f"no demo tokenizer at {path}: build the demo models first (goodspeed demo)")
    else:
        from goodspeed.lm.models.real import RealNotBuiltError, real_model_path
        try:
            path = real_model_path("smollm2-135m")
        except RealNotBuiltError as exc:
            raise SystemExit(str(exc)) from None
    return AutoTokenizer.from_pretrained(path)


def rows_for(tokenizer, kind: str | None, rows: int, drafted: int, rng: np.random.Generator) -> list[RowInput]:
    out = []
    structure, texts = GRAMMARS[kind or "json"]
    sampling = SamplingParams() if kind is None else SamplingParams(structured=structure.bound(tokenizer))
    for r in range(rows):
        ids = tokenizer.encode(texts[r % len(texts)], add_special_tokens=False)
        at = int(rng.integers(1, len(ids) - drafted + 1))  # committed: ids[:at]; drafted: the next ones
        tokens = [ids[at - 1]] + ids[at:at + drafted]
        history = TokenHistory([1, 2, 3], ids[:at], sampling.structured) if kind is not None else None
        out.append(RowInput(f"r{r}", tokens, Draft(0, tokens[1:]), sampling, history))
    return out


ASKS = ["What is the largest city in France? Answer in JSON.", "Give one city in Japan and its population as JSON."]
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}


def acceptance() -> list[dict]:
    """Local serving of :data:`ASKS` on the real pair, with the :data:`CITY` schema and without."""
    from goodspeed.drafter.prompts import chat_prompt_ids
    from goodspeed.lm.models.loading import load_causal_lm
    from goodspeed.verifier.engine import EngineConfig, VerificationEngine
    from goodspeed.verifier.local import LocalConfig, LocalServing

    target, draft = load_causal_lm("real:smollm2-135m"), load_causal_lm("real:smollm2-135m-draft")
    shaped = SamplingParams(structured=Structure("json", json.dumps(CITY), any_whitespace=False).bound(target.tokenizer))
    prompts = [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": a}]) for a in ASKS]
    eos = target.tokenizer.eos_token_id
    out = []
    for policy in ("chain", "adaserve"):
        for name, sampling in (("json schema", shaped), ("free", SamplingParams())):
            engine = VerificationEngine(target.model, EngineConfig(seed=0))
            serving = LocalServing(engine, draft.model, LocalConfig(policy=policy, max_requests=4, budget=12, k=4))
            for p in prompts:
                serving.submit(p, sampling, max_new_tokens=40, eos_token_ids=(eos,))
            while serving.step() is not None:
                pass
            stats = serving.stats()
            first = min(serving.finished, key=lambda r: r.request_id)
            out.append({"policy": policy, "text": name, **{k: stats[k] for k in ("steps", "drafted", "accepted", "emitted")},
                        "first_reply": target.tokenizer.decode(first.generated)})
    return out


WIDE = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{3,9}"} for i in range(40)},
        "required": [f"f{i}" for i in range(40)]}


def matcher_costs(tokenizer, repeats: int) -> dict:
    """ms for a request's matcher with its first mask: copied from the bound template, and built afresh."""
    import llguidance

    from goodspeed.lm.decoding import structured

    bound = Structure("json", json.dumps(WIDE)).bound(tokenizer)
    copies, fresh = [], []
    for _ in range(repeats):
        copies.append(_time(lambda: bound.constraint().masks([[]])))
        fresh.append(_time(lambda: llguidance.LLMatcher(bound.tokenizer, bound.grammar, log_level=0,
                                                        limits=structured.LIMITS).compute_bitmask()))
    return {"copy_ms": 1e3 * statistics.median(copies), "build_ms": 1e3 * statistics.median(fresh)}


def _time(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--drafted", type=int, default=3)
    ap.add_argument("--tokenizers", nargs="+", choices=["demo", "real"], default=["demo", "real"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-mask-slices", action="store_true", help="llguidance's views without their slices (a node with no draft model)")
    ap.add_argument("--acceptance", action="store_true", help="serve two chat requests on the real pair instead (see above)")
    args = ap.parse_args()
    if min(args.rows, args.repeats, args.drafted) < 1:
        ap.error("--rows, --drafted and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    use_mask_slices(not args.no_mask_slices)
    if args.acceptance:
        runs = acceptance()
        if args.json:
            print(json.dumps({"threads": args.threads, "runs": runs}, indent=2))
        for r in [] if args.json else runs:
            print(f"{r['policy']:>8}, {r['text']:>11}: {r['steps']} steps, {r['accepted']} of {r['drafted']} drafted accepted "
                  f"({r['accepted'] / max(r['drafted'], 1):.2f}), {r['emitted']} emitted; {r['first_reply']!r}")
        return 0
    out = []
    for name in args.tokenizers:
        tokenizer = load_tokenizer(name)
        vocab = len(tokenizer)
        started = time.perf_counter()
        GRAMMARS["json"][0].bound(tokenizer)  # the tokenizer's one-time indexing, reported apart
        index_s = time.perf_counter() - started
        logits = torch.randn(args.rows, args.drafted + 1, vocab, generator=torch.Generator().manual_seed(0))
        verifier = RowVerifier(vocab, torch.device("cpu"), torch.float32, torch.Generator().manual_seed(1))
        plain = rows_for(tokenizer, None, args.rows, args.drafted, np.random.default_rng(2))
        for kind in GRAMMARS:
            shaped = rows_for(tokenizer, kind, args.rows, args.drafted, np.random.default_rng(2))
            base, times = [], []
            for i in range(args.repeats + 2):
                b = _time(lambda: verifier.verify(plain, logits, {}))
                t = _time(lambda: verifier.verify(shaped, logits, {}))
                if i >= 2:
                    base.append(b)
                    times.append(t)
            out.append({"tokenizer": name, "vocab": vocab, "grammar": kind, "index_s": index_s,
                        "plain_ms": 1e3 * statistics.median(base), "grammar_ms": 1e3 * statistics.median(times)})
            if not args.json:
                r = out[-1]
                print(f"{name} (V = {vocab}), {kind:>6}: plain {r['plain_ms']:.3f} ms, with the grammar {r['grammar_ms']:.3f} ms "
                      f"a step (+{r['grammar_ms'] - r['plain_ms']:.3f} ms; {args.rows} rows x {args.drafted + 1} positions)")
        costs = matcher_costs(tokenizer, args.repeats)
        out.append({"tokenizer": name, "vocab": vocab, "matcher": "40-field schema", **costs})
        if not args.json:
            print(f"{name}: indexing the tokenizer once took {index_s:.2f} s; a request's matcher with its first mask: "
                  f"copied {costs['copy_ms']:.3f} ms, built afresh {costs['build_ms']:.3f} ms (40-field schema)")
    if args.json:
        print(json.dumps({"threads": args.threads, "mask_slices": not args.no_mask_slices, "rows": args.rows, "drafted": args.drafted, "repeats": args.repeats,
                          "llguidance": __import__("importlib.metadata").metadata.version("llguidance"), "results": out},
                         indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
