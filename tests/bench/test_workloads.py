"""The per-task benchmark's arithmetic (bench.bench_workloads.summarize) on hand-made rows, and its
task file: every category the issue names, each task a valid chat request."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def repo_root_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))


def row(config, category, tid, wall_s, tokens, output, drafts=0, drafted=0, accepted=0):
    return {"config": config, "category": category, "id": tid, "wall_s": wall_s, "tokens": tokens, "output": output,
            "spec_decode_num_drafts_total": drafts, "spec_decode_num_draft_tokens_total": drafted,
            "spec_decode_num_accepted_tokens_total": accepted}


def test_speedups_acceptance_and_equality_per_category():
    from bench.bench_workloads import summarize

    call = lambda cid: json.dumps({"content": None, "tool_calls": [{"id": cid, "function": {"name": "f", "arguments": "{}"}}]})
    text = json.dumps({"content": "x", "tool_calls": None})
    rows = [row("plain", "a", "1", 2.0, 20, text), row("src", "a", "1", 1.0, 20, text, 4, 16, 8),
            row("plain", "b", "2", 1.0, 10, call("c1")), row("src", "b", "2", 2.0, 10, call("c2"), 2, 4, 1)]
    out = summarize(rows, ["plain", "src"])
    a, b = out["by_category"]["a"]["src"], out["by_category"]["b"]["src"]
    assert (a["speedup"], a["acceptance"], a["accepted_per_draft"], a["equal_to_plain"]) == (2.0, 0.5, 2.0, 1)
    assert (b["speedup"], b["acceptance"], b["equal_to_plain"]) == (0.5, 0.25, 1)  # a call's id is not its text
    assert out["geomean_speedup"]["src"] == pytest.approx(1.0)
    assert out["by_category"]["all"]["src"]["speedup"] == pytest.approx((30 / 3.0) / (30 / 3.0))


def test_a_steady_batch_counts_its_window_and_a_closed_batch_its_wall_time():
    """Local serving: a closed batch's time is its wall time, shared among its requests by their
    tokens, the tail included; under steady load a batch counts only its window (the tokens the
    server generated from the first reply to the last sending), whatever its requests' lengths."""
    from bench.bench_workloads import summarize

    text = json.dumps({"content": "x", "tool_calls": None})

    def batch(config, b, wall, tokens, window=None):
        return [{**row(config, "a", f"{b}.{i}", 0.0, n, text), "batch": b, "batch_wall_s": wall, **(window or {})}
                for i, n in enumerate(tokens)]

    closed = batch("plain", 0, 4.0, [40, 40]) + batch("src", 0, 4.0, [40, 10])  # src's outputs are shorter: a tail-free loss
    out = summarize(closed, ["plain", "src"], batched=True)["by_category"]["a"]
    assert (out["plain"]["tok_s"], out["src"]["tok_s"], out["src"]["speedup"]) == (20.0, 12.5, 0.625)
    steady = (batch("plain", 0, 9.0, [40, 40, 40], {"window_tokens": 60, "window_s": 3.0})
              + batch("src", 0, 9.0, [40, 10, 40], {"window_tokens": 66, "window_s": 3.0}))
    out = summarize(steady, ["plain", "src"], batched=True)["by_category"]["a"]
    assert (out["plain"]["tok_s"], out["src"]["tok_s"], out["src"]["speedup"]) == (20.0, 22.0, 1.1)


def test_each_local_request_is_timed_against_plain_decodings_of_the_same_request():
    """Local serving: per category and config, the slowest request's TPOT over plain decoding's of
    the same request, and how many ran more than 3% slower (the never-slower floor), from each
    reply's own wall time: a batch whose total is faster can still hold a slower request. A
    request whose output differs in length from plain decoding's is left out (its 5x here would
    be its shorter text's, not its pace)."""
    from bench.bench_workloads import summarize

    text = json.dumps({"content": "x", "tool_calls": None})
    rows = [{**row(config, "a", str(i), wall, 10, text), "batch": 0, "batch_wall_s": 4.0}
            for config, walls in (("plain", (1.0, 1.0, 1.0)), ("src", (0.5, 1.02, 1.2))) for i, wall in enumerate(walls)]
    rows += [{**row(config, "a", "3", 1.0, tokens, text), "batch": 0, "batch_wall_s": 4.0}  # a shorter output: not compared
             for config, tokens in (("plain", 10), ("src", 2))]
    out = summarize(rows, ["plain", "src"], batched=True)["by_category"]["a"]["src"]
    assert (out["tpot_over_plain_max"], out["slower_than_097"]) == (1.2, 1)


def test_a_steady_run_needs_two_waves():
    from bench.bench_workloads import run_steady

    with pytest.raises(ValueError, match="two waves"):
        run_steady(0, [{}] * 15, 8, 8)


def test_the_task_file_covers_each_category_with_chat_requests():
    from bench.bench_workloads import load_tasks

    tasks = load_tasks()
    categories = {t["category"] for t in tasks}
    assert categories == {"code-completion", "code-editing", "summary-extraction", "context-qa", "multi-turn-chat",
                          "json-extraction", "tool-calls", "open-chat"}
    assert len({t["id"] for t in tasks}) == len(tasks)
    for t in tasks:
        assert t["messages"] and t["messages"][-1]["role"] == "user"
        assert ("tools" in t) == (t["category"] == "tool-calls") and ("response_format" in t) == (t["category"] == "json-extraction")


def test_the_evidence_replay_reads_a_replys_text_and_counts_a_proposals_accepted_prefix():
    """bench.bench_lookup_evidence: a reply's content, or its tool calls' JSON with the arguments
    as written (even cut short); a proposal's accepted tokens are the prefix the output continues with."""
    from bench.bench_lookup_evidence import accepted, written

    assert written(json.dumps({"content": "hello", "tool_calls": None})) == "hello"
    cut = {"content": None, "tool_calls": [{"id": "x", "function": {"name": "get", "arguments": '{"city": "Pa'}}]}
    assert written(json.dumps(cut)) == '{"name": "get", "arguments": {"city": "Pa}'
    assert accepted([1, 2, 3], [1, 2, 4, 5]) == 2 and accepted([9], [1]) == 0 and accepted([1, 2], [1]) == 1


def test_the_round_replay_counts_rounds_against_a_brute_force_oracle():
    """The oracle takes the longest continuation that starts anywhere in the text (whatever
    precedes it); a replay advances by the accepted tokens and the target's one, so an output
    copied whole from its prompt takes fewer rounds than its length, and the oracle never more
    than a lookup."""
    from bench.bench_lookup_evidence import longest_copy, replay_rounds

    assert longest_copy([5, 1, 2, 3, 1, 2, 9], [1, 2, 9, 4], 8) == 3  # the later "1 2" continues with 9
    assert longest_copy([5, 1, 2], [1, 2, 3], 2) == 2 and longest_copy([5, 6], [7], 8) == 0

    class Words:  # a tokenizer of single characters, its chat template the last message's text
        chat_template = "x"

        def __len__(self):
            return 256

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return messages[-1]["content"]

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    tasks = {"t": {"category": "copy", "messages": [{"role": "user", "content": "the cat sat on the mat"}]}}
    rows = [{"id": "t", "output": json.dumps({"content": "cat sat on the mat", "tool_calls": None})}]
    got = {(r["source"], r["category"]): r for r in replay_rounds(rows, tasks, Words(), 4)}
    assert got[("oracle", "copy")]["tokens"] == 18 and got[("oracle", "copy")]["rounds"] < 18
    assert {**got[("oracle", "all")], "category": "copy"} == got[("oracle", "copy")]
    assert got[("oracle", "copy")]["rounds"] <= got[("ngram", "copy")]["rounds"] <= got[("ngram-2", "copy")]["rounds"]
    assert got[("oracle", "copy")]["rounds"] <= min(got[("suffix", "copy")]["rounds"], got[("suffix-4", "copy")]["rounds"])
    assert got[("ngram-tree-8", "copy")]["drafted_per_round"] >= got[("ngram", "copy")]["drafted_per_round"] > 0


def test_a_lookup_tree_branches_on_distinct_continuations_and_starts_with_ngrams_chain():
    """bench.bench_lookup_evidence.lookup_tree: its first branch is ``ngram``'s chain (PromptLookup,
    checked on random texts), every branch follows an earlier occurrence of a suffix of the text,
    no two are equal, longer suffixes come first; a tree's drafted tokens are its distinct prefixes."""
    import random

    from bench.bench_lookup_evidence import lookup_tree, tree_nodes
    from goodspeed.lm.decoding.lookup import PromptLookup

    text = [7, 1, 2, 3, 9, 2, 4, 1, 2, 5, 8, 1, 2]
    # "1 2" occurs ending at 8 (then 5 8 1 2) and 2 (then 3 9 2 4); "2" also ends at 5 (then 4 1 2 5)
    assert lookup_tree(text, 8, 4) == [[5, 8, 1, 2], [3, 9, 2, 4], [4, 1, 2, 5]]
    assert lookup_tree(text, 2, 4) == [[5, 8, 1, 2], [3, 9, 2, 4]] and lookup_tree([1, 2, 3], 4, 4) == []
    assert tree_nodes([[1, 2, 3], [1, 2, 4], [5]]) == 5 and tree_nodes([]) == 0
    rng = random.Random(0)
    lookup = PromptLookup(6)
    for trial in range(300):
        text = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        tree = lookup_tree(text, 4, 5)
        lookup.add("t")
        assert (tree[0] if tree else []) == lookup.propose("t", text, 5), text
        lookup.remove("t")
        assert len(tree) <= 4 and len({tuple(b) for b in tree}) == len(tree)
        for branch in tree:
            assert any(text[end + 1 : end + 1 + 5] == branch and text[end - n + 1 : end + 1] == text[-n:]
                       for n in range(1, 6) for end in range(n - 1, len(text) - 1)), (text, branch)


def test_the_local_control_is_a_second_plain_server():
    """``--local-control`` adds ``plain-2``, served as plain decoding is (no drafting policy); a
    source gets its draft and the policy's flags."""
    import argparse

    from bench.bench_workloads import local_flags

    args = argparse.Namespace(local_policy="goodput", local_k=6, budget=32)
    assert local_flags(args, "plain-2", "real:d") == local_flags(args, "plain", "real:d")
    assert local_flags(args, "plain-2", "real:d")[-2:] == ["--local-policy", "none"]
    ngram = local_flags(args, "ngram", "real:d")
    assert ngram[:4] == ["--local-draft", "ngram", "--local-policy", "goodput"] and "--local-k" in ngram
    assert "--local-floor" not in ngram


def test_local_floors_serve_each_source_at_each_floor():
    """``--local-floors 0.97,0``: each source twice, its config naming the floor its verifier gets."""
    import argparse

    from bench.bench_workloads import floor_configs, local_flags, source_name

    args = argparse.Namespace(local_policy="goodput", local_k=6, budget=32)
    configs = floor_configs(["ngram", "model"], ["0.97", "0"])
    assert configs == ["ngram:floor=0.97", "ngram:floor=0", "model:floor=0.97", "model:floor=0"]
    assert local_flags(args, "ngram:floor=0", "real:d")[:2] == ["--local-draft", "ngram"]
    assert local_flags(args, "ngram:floor=0", "real:d")[-2:] == ["--local-floor", "0"]
    assert source_name("model:floor=0.97", "real:d") == "real:d"


def test_a_source_may_name_another_model_draft():
    from bench import bench_workloads

    assert bench_workloads.source_name("model", "real:a-draft") == "real:a-draft"
    assert bench_workloads.source_name("model@real:a-draft-large", "real:a-draft") == "real:a-draft-large"
    assert bench_workloads.source_name("hybrid@real:a-draft-large", "real:a-draft") == "suffix+real:a-draft-large"
    assert bench_workloads._label("model@real:a-draft-large/allotted") == "model-real-a-draft-large-allotted"
    with pytest.raises(SystemExit):
        bench_workloads.main(["--sources", "suffix@real:a-draft", "--summarize", ""])  # a lookup takes no model


def test_every_verifier_takes_the_device_and_the_flags_and_a_cut_run_keeps_its_rows(tmp_path):
    """``--device`` and ``--verifier-flags`` reach every verifier; with ``--json PATH`` the rows of
    the mode running are kept in ``PATH.partial`` and summarised from there, and writing the report
    removes them."""
    import argparse

    from bench.bench_workloads import keep_partial, resummarize, verifier_flags, write_report

    args = argparse.Namespace(device="cuda", verifier_flags="--cuda-graphs --rounds async", json=str(tmp_path / "r.json"))
    assert verifier_flags(args) == ["--device", "cuda", "--cuda-graphs", "--rounds", "async"]
    text = json.dumps({"content": "x", "tool_calls": None})
    keep_partial(args, "edge", ["plain", "src"], [row("plain", "a", "1", 2.0, 20, text), row("src", "a", "1", 1.0, 20, text, 4, 16, 8)])
    partial = tmp_path / "r.json.partial"
    assert resummarize(partial) == 0
    assert json.loads(partial.read_text())["edge"]["by_category"]["a"]["src"]["speedup"] == 2.0
    write_report(args, {"edge": {}})
    assert not partial.exists() and json.loads((tmp_path / "r.json").read_text()) == {"edge": {}}


def test_a_server_that_exits_fails_the_wait_at_once_with_its_log(tmp_path):
    """A verifier or node that dies while starting (a missing package, a bad flag) fails the wait
    for its port with its exit code and the end of its log, not after the wait's timeout: the wait
    is given a day, so only the exit can end it within the suite's per-test timeout."""
    import sys

    from bench.bench_http import free_port
    from bench.bench_workloads import Servers

    with Servers(tmp_path) as servers:
        servers.spawn([sys.executable, "-c", "import sys; print('no module named boom', file=sys.stderr); sys.exit(3)"],
                      "0", 1, "verifier")
        with pytest.raises(RuntimeError, match=r"(?s)verifier exited with 3 .*no module named boom"):
            servers.wait_http(free_port(), 86_400)


def test_relative_capacity_sets_the_slo_at_twice_plain_decodings_own_tpot_at_one_client():
    from bench.bench_workloads import relative_capacity

    def cell(n, phase, tpots):
        return {"clients": n, "phase": phase, "tpot_ms": tpots, "tpot_ms_p50": sorted(tpots)[len(tpots) // 2]}

    cells = [cell(1, "plain", [40.0, 50.0, 60.0]), cell(1, "edge", [20.0, 20.0, 20.0]),
             cell(2, "plain", [90.0, 99.0, 101.0]), cell(2, "edge", [30.0, 100.0, 100.0]),
             cell(4, "plain", [150.0, 150.0, 150.0]), cell(4, "edge", [100.0, 100.0, 100.0])]
    report = relative_capacity(cells)
    assert report["relative_tpot_slo_ms"] == 100.0  # twice the one-client plain p50 of 50 ms
    # plain's 101 ms at 2 clients misses (2 of 3 < 0.9); the edge meets it up to 4 (100 <= 100)
    assert report["capacity_at_relative_slo"] == {"plain": 1, "edge": 4}
    assert relative_capacity([c for c in cells if c["clients"] != 1]) == {}


def test_run_clients_returns_replies_in_the_order_of_its_work(monkeypatch):
    """capacity_mode names each reply by zipping run_clients' replies with its work, flattened."""
    import bench.bench_workloads as bw

    monkeypatch.setattr(bw, "post", lambda port, task, max_tokens: {"port": port, "id": task["id"]})
    work = [[{"id": f"c{i}t{c}"} for c in range(3)] for i in range(4)]
    replies = bw.run_clients([100 + i for i in range(4)], work, 8)
    assert [r["id"] for r in replies] == [t["id"] for mine in work for t in mine]
    assert [r["port"] for r in replies] == [100 + i for i in range(4) for _ in range(3)]


def fake_servers(on_spawn=lambda cmd, name: None):
    """A stand-in for ``bench_workloads.Servers`` that starts nothing: each spawn's command line
    and name go to ``on_spawn``, and every server is up at once."""

    class FakeServers:
        def __init__(self, out):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def spawn(self, cmd, cpus, threads, name):
            on_spawn(cmd, name)

        def wait_http(self, port, timeout_s):
            pass

    return FakeServers


def test_capacity_runs_plain_decoding_each_floor_the_edge_nodes_and_the_control_in_turn(monkeypatch, tmp_path):
    """``--local-floors 0.97,0 --capacity-phases local,edge,control``: per number of clients,
    plain decoding, a centralised server a floor (given its ``--local-floor``), the edge nodes,
    then plain decoding again (``plain-2``); each cell's ``tpot_over_plain`` is against that
    number's plain cell, request by request."""
    import argparse

    import bench.bench_workloads as bw

    spawned, ports = [], iter(range(20_000, 20_100))
    speed = {}  # port -> seconds a token

    def spawn(cmd, name):
        spawned.append((name, cmd))
        port = int(cmd[cmd.index("--http-port") + 1]) if "--http-port" in cmd else int(cmd[cmd.index("--serve") + 1].split(":")[1])
        speed[port] = 0.01 if "--local-floor" in cmd and cmd[cmd.index("--local-floor") + 1] == "0" else 0.02

    monkeypatch.setattr(bw, "Servers", fake_servers(spawn))
    monkeypatch.setattr(bw, "free_port", lambda: next(ports))
    monkeypatch.setattr(bw, "post", lambda port, task, max_tokens: {"wall_s": 10 * speed.get(port, 0.02), "tokens": 10})
    args = argparse.Namespace(clients="2", per_client=2, fleet_source="suffix", budget=32, max_draft_len=8, local_k=6,
                              max_tokens=10, tpot_slo_ms=60.0, device="cpu", verifier_flags="",
                              local_floors=["0.97", "0"], capacity_phases=["local", "edge", "control"])
    tasks = [{"id": f"t{i}", "messages": []} for i in range(4)]
    report = bw.capacity_mode(args, tasks, "real:t", "real:d", "auto", tmp_path)
    assert [c["phase"] for c in report["cells"]] == ["plain", "local-spec:floor=0.97", "local-spec:floor=0", "edge", "plain-2"]
    floors = [cmd[cmd.index("--local-floor") + 1] for name, cmd in spawned if "--local-floor" in cmd]
    assert floors == ["0.97", "0"]
    ratios = {c["phase"]: c["tpot_over_plain"] for c in report["cells"]}
    assert ratios["local-spec:floor=0"] == [0.5] * 4 and ratios["plain-2"] == ratios["plain"] == [1.0] * 4


def _record_requests(monkeypatch, bw):
    """Fake servers and requests: each request's port in the order sent (warm-ups included)."""
    sent, ports = [], iter(range(21_000, 21_100))

    def post(port, task, max_tokens):
        sent.append((port, task["id"]))
        return {"wall_s": 1.0, "tokens": 4, "output": json.dumps({"content": "x"})}

    monkeypatch.setattr(bw, "Servers", fake_servers())
    monkeypatch.setattr(bw, "free_port", lambda: next(ports))
    monkeypatch.setattr(bw, "post", post)
    monkeypatch.setattr(bw, "counters", lambda port, names=bw.COUNTERS: dict.fromkeys(names, 0.0))
    monkeypatch.setattr(bw, "keep_partial", lambda *a, **kw: None)
    return sent


def test_the_edge_benchmark_sends_every_other_task_to_the_configs_in_reverse_order(monkeypatch, tmp_path):
    """A machine drifting over a run weighs on plain decoding as on the nodes: task 0 goes to plain,
    then each node; task 1 to the nodes in reverse, plain last; and so on."""
    import argparse

    import bench.bench_workloads as bw

    sent = _record_requests(monkeypatch, bw)
    args = argparse.Namespace(sources=["ngram", "suffix"], draft_lengths=["goodput"], max_draft_len=8, budget=16,
                              max_tokens=4, device="cpu", verifier_flags="")
    tasks = [{"id": f"t{i}", "category": "c", "messages": []} for i in range(3)]
    report = bw.edge_mode(args, tasks, "real:t", "real:d", "auto", tmp_path)
    plain, ngram, suffix = 21_001, 21_002, 21_003  # 21_000: the verifier's gRPC port
    assert sent[3:] == [(plain, "t0"), (ngram, "t0"), (suffix, "t0"), (suffix, "t1"), (ngram, "t1"), (plain, "t1"),
                        (plain, "t2"), (ngram, "t2"), (suffix, "t2")]
    assert report["by_category"]["c"]["suffix"]["speedup"] == 1.0


def test_the_local_benchmark_alternates_its_configs_order_over_categories_and_repeats(monkeypatch, tmp_path):
    """Each batch goes to every server in turn; the order reverses from one category to the next
    and, for one category, from one repeat to the next."""
    import argparse

    import bench.bench_workloads as bw

    sent = _record_requests(monkeypatch, bw)

    def run_batch(port, batch, max_tokens):
        sent.append((port, batch[0]["category"]))
        return 1.0, [{"wall_s": 1.0, "tokens": 4, "output": "{}"}] * len(batch)

    monkeypatch.setattr(bw, "run_batch", run_batch)
    args = argparse.Namespace(sources=["ngram"], local_floors=[], local_control=True, repeats=2, batch=2, local_load="closed",
                              waves=1, max_tokens=4, local_policy="goodput", local_k=6, budget=32, device="cpu",
                              verifier_flags="")
    tasks = [{"id": f"{c}{i}", "category": c, "messages": []} for c in "ab" for i in range(2)]
    bw.local_mode(args, tasks, "real:t", "real:d", "auto", tmp_path)
    batches = [(port, category) for port, category in sent if category in ("a", "b")]
    # repeat 0: plain 21_000, plain-2 21_002, ngram 21_004 (each server's gRPC port after its HTTP port)
    first, second = [21_000, 21_002, 21_004], [21_006, 21_008, 21_010]
    assert batches == ([(p, "a") for p in first] + [(p, "b") for p in reversed(first)]
                       + [(p, "a") for p in reversed(second)] + [(p, "b") for p in second])
