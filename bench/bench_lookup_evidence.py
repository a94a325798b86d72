"""How often a lookup's draft is taken, by the length of the context it matched (its evidence).

    python -m bench.bench_lookup_evidence [--report docs/benchmarks/workloads-cpu/edge-real-48-final.json]
                                          [--tokenizer real:smollm2-135m] [--max-tokens 6] [--json PATH]

Replays plain decoding's greedy outputs from a per-task benchmark report (``bench_workloads``'s
``plain`` rows: each task's chat prompt and the text the target wrote) through ``ngram``
(:class:`~goodspeed.lm.decoding.lookup.PromptLookup`) and ``suffix``
(:class:`~goodspeed.lm.decoding.lookup.SuffixDraft`, its node-wide cache filled by the outputs
replayed before, in the report's order). At every position of every output each lookup proposes up
to ``--max-tokens`` tokens after the text so far; a proposal's accepted tokens are its prefix the
output continues with (greedy verification; a tool call's text is its JSON). Per lookup and match length (suffix's above 8
together): proposals, drafted and accepted tokens, accepted per proposal and per drafted token,
overall and per category. The outputs are re-tokenized from their text, and every position
counts (a served request proposes only where its last verification ended), so the figures
describe the lookups' evidence, not a serving run.

Then round by round, as a served request would go with every proposal drafted whole (no goodput
rule): each round proposes after the text so far, takes the accepted prefix and the target's
next token. Per category: the rounds each source needs for the outputs, the rounds it proposed
nothing, and tokens a round; beside ``ngram`` (sizes 1..5) its former sizes 2..5 (``ngram-2``),
beside ``suffix`` (drafts up to the match's length) drafts up to four times it (``suffix-4``),
and an oracle that copies the longest continuation found anywhere in the text so far, whatever
precedes it: the most any lookup of this text could take. And lookup trees, as a verifier of trees
would take them (``ngram-tree-K``, :func:`lookup_tree`): up to K distinct continuations of the
text's matched suffixes, the longest suffix's latest occurrence first, as branches of one tree;
a round takes its longest accepted branch. Each row also counts the tokens drafted (a tree's
nodes), the verification's width.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_workloads import load_tasks
from goodspeed.drafter.prompts import chat_prompt_ids
from goodspeed.lm.decoding.lookup import PromptLookup, SuffixDraft
from goodspeed.lm.models.tokenizers import load_tokenizer

REPORT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "workloads-cpu" / "edge-real-48-final.json"


def written(output: str) -> str:
    """A reply's text: its content, or its tool calls as JSON (their arguments as the model wrote
    them, the call's wrapping aside)."""
    message = json.loads(output)
    if message.get("content"):
        return message["content"]
    return "\n".join(f'{{"name": {json.dumps(c["function"]["name"])}, "arguments": {c["function"]["arguments"]}}}'
                     for c in message.get("tool_calls") or [])  # arguments as written: cut at max_tokens, maybe


def accepted(proposal: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, truth):
        if a != b:
            break
        n += 1
    return n


def longest_copy(text: list[int], truth: list[int], max_tokens: int) -> int:
    """The oracle: the longest prefix of ``truth`` (at most ``max_tokens``) that starts anywhere in ``text``."""
    best, first = 0, truth[:1]
    for start in range(len(text)):
        if text[start : start + 1] == first:
            best = max(best, accepted(text[start : start + max_tokens], truth[:max_tokens]))
    return best


def lookup_tree(text: list[int], branches: int, max_tokens: int, min_n: int = 1, max_n: int = 5) -> list[list[int]]:
    """Up to ``branches`` distinct continuations (at most ``max_tokens`` each) that follow an
    earlier occurrence of a suffix of ``text`` of ``max_n`` down to ``min_n`` tokens: the longest
    suffix first and, for each, its latest occurrence first. The first is ``ngram``'s chain."""
    found: list[list[int]] = []
    for n in range(min(max_n, len(text) - 1), min_n - 1, -1):
        suffix = text[-n:]
        for end in range(len(text) - 2, n - 2, -1):  # an occurrence ending at ``end`` with a successor
            if text[end - n + 1 : end + 1] == suffix:
                branch = text[end + 1 : end + 1 + max_tokens]
                if branch not in found:
                    found.append(branch)
                    if len(found) == branches:
                        return found
    return found


def tree_nodes(branches: list[list[int]]) -> int:
    """The tokens a tree of these branches drafts: their distinct prefixes."""
    return len({tuple(b[:i]) for b in branches for i in range(1, len(b) + 1)})


TREE_BRANCHES = (2, 4, 8)


def replay_rounds(rows, tasks, tokenizer, max_tokens: int) -> list[dict]:
    """Rounds each source needs to write the outputs, every proposal drafted whole (module docstring)."""
    vocab = len(tokenizer)
    lookups = {"ngram": PromptLookup(vocab), "ngram-2": PromptLookup(vocab, min_n=2), "suffix": SuffixDraft(vocab),
               "suffix-4": SuffixDraft(vocab, max_spec_factor=4.0)}  # suffix's cache fills as the rows go

    def chain(lookup):
        def draft(text, truth):
            proposal = lookup.propose("r", text, max_tokens)
            return accepted(proposal, truth), len(proposal)
        return draft

    def tree(branches):
        def draft(text, truth):
            found = lookup_tree(text, branches, max_tokens)
            return max((accepted(b, truth) for b in found), default=0), tree_nodes(found)
        return draft

    def oracle(text, truth):
        took = longest_copy(text, truth, max_tokens)
        return took, took  # it drafts only what it copies

    # each source: (text so far, the output's rest) -> (tokens accepted, tokens drafted)
    sources = {**{name: chain(lookup) for name, lookup in lookups.items()}, "oracle": oracle,
               **{f"ngram-tree-{k}": tree(k) for k in TREE_BRANCHES}}
    cells: dict = defaultdict(lambda: [0, 0, 0, 0])  # (source, category) -> rounds, empty rounds, tokens, drafted
    for row in rows:
        task = tasks[row["id"].split("#")[0]]
        prompt = chat_prompt_ids(tokenizer, task["messages"])
        output = tokenizer(written(row["output"]), add_special_tokens=False)["input_ids"]
        for name, draft in sources.items():
            if name in lookups:
                lookups[name].add("r")
            i = 0
            while i < len(output):
                took, drafted = draft(prompt + output[:i], output[i:])
                for category in (task["category"], "all"):
                    cell = cells[(name, category)]
                    cell[0] += 1
                    cell[1] += drafted == 0
                    cell[3] += drafted
                i += took + 1
            if name in lookups:
                lookups[name].remove("r", prompt + output)
            for category in (task["category"], "all"):
                cells[(name, category)][2] += len(output)
    return [{"source": s, "category": c, "rounds": r, "empty": e, "tokens": t, "tokens_per_round": round(t / r, 3),
             "drafted_per_round": round(d / r, 2)} for (s, c), (r, e, t, d) in sorted(cells.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a lookup's acceptance by its match length")
    parser.add_argument("--report", type=Path, default=REPORT)
    parser.add_argument("--tokenizer", default="real:smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    tokenizer, _ = load_tokenizer(args.tokenizer)
    tasks = {t["id"]: t for t in load_tasks()}
    report = json.loads(args.report.read_text())
    rows = [r for mode in ("edge", "local") if mode in report for r in report[mode]["rows"] if r["config"] == "plain"]
    if not rows:
        parser.error(f"{args.report}: no plain rows")
    vocab = len(tokenizer)
    sources = {"ngram": PromptLookup(vocab), "suffix": SuffixDraft(vocab)}
    cells: dict = defaultdict(lambda: [0, 0, 0])  # (source, category, match) -> proposals, drafted, accepted
    for n, row in enumerate(rows):
        task = tasks[row["id"].split("#")[0]]
        prompt = chat_prompt_ids(tokenizer, task["messages"])
        output = tokenizer(written(row["output"]), add_special_tokens=False)["input_ids"]
        for name, source in sources.items():
            key = f"r{n}"
            source.add(key)
            for i in range(len(output)):
                tokens, match = source.proposal(key, prompt + output[:i], args.max_tokens)
                if tokens:
                    for category in (task["category"], "all"):
                        cell = cells[(name, category, min(match, 8))]
                        cell[0] += 1
                        cell[1] += len(tokens)
                        cell[2] += accepted(tokens, output[i:])
            source.remove(key, prompt + output)
    rounds = replay_rounds(rows, tasks, tokenizer, args.max_tokens)
    for line in rounds:
        if line["category"] == "all":
            print(f"{line['source']:13s} {line['rounds']:5d} rounds for {line['tokens']} tokens "
                  f"({line['tokens_per_round']:.2f} a round, {line['drafted_per_round']:.1f} drafted), {line['empty']} proposing nothing")
    table = [{"source": s, "category": c, "match": m, "proposals": p, "drafted": d, "accepted": a,
              "accepted_per_proposal": round(a / p, 3), "acceptance": round(a / d, 3)}
             for (s, c, m), (p, d, a) in sorted(cells.items())]
    for line in table:
        if line["category"] == "all":
            print(f"{line['source']:6s} match {line['match']}: {line['proposals']:5d} proposals, accepted "
                  f"{line['accepted_per_proposal']:.2f} a proposal, {line['acceptance']:.2f} a drafted token")
    if args.json:
        out = {"command": " ".join(["python -m bench.bench_lookup_evidence", *(argv if argv is not None else sys.argv[1:])]),
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "report": str(args.report),
               "outputs": len(rows), "max_tokens": args.max_tokens, "cells": table, "rounds": rounds}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
