"""One setting, one meaning: the verifier's settings as a spec's ``[verifier]`` keys
(``VerifierSpec``), as ``goodspeed verifier`` flags, in the spec file the launcher hands its
verifier, and as the library configs the daemon runs on must name and default the same things. A setting added in one
place and forgotten in another fails here (issue 15, part 5)."""

import dataclasses

import pytest

from goodspeed.launch.cli import build_parser, drafter_settings, verifier_settings
from goodspeed.launch.spec import DrafterSpec, SpecError, VerifierSpec
from goodspeed.verifier.local import LocalConfig
from goodspeed.verifier.server import ServerConfig
from goodspeed.verifier.sessions import EngineConfig

PLACEMENT = set(VerifierSpec.PLACEMENT)  # where the launcher runs the daemon, not the daemon's
CLI_DEFAULTS = {"port": 50051, "target": None}  # the daemon listens on 50051; a target is required of a user


def subcommand_parser(name):
    return build_parser()._subparsers._group_actions[0].choices[name]


def verifier_parser():
    return subcommand_parser("verifier")


def test_every_spec_setting_is_a_flag_with_the_same_default_and_no_flag_is_spec_less():
    flags = {a.dest: a.default for a in verifier_parser()._actions if a.dest not in ("help", "spec")}
    spec = {f.name: f.default for f in dataclasses.fields(VerifierSpec) if f.name not in PLACEMENT}
    assert set(flags) == set(spec) == set(VerifierSpec.daemon_settings())
    assert {name: flags[name] for name in spec if flags[name] != spec[name]} == CLI_DEFAULTS


CHANGED = dict(target="demo:other", host="0.0.0.0", port=6000, budget=11, policy="fixed", eta=0.3, beta=0.25,
               rounds="async", round_deadline_ms=123.0, max_missed_rounds=7, idle_timeout_s=9.0, drain_timeout_s=4.0,
               stream_open_timeout_s=3.0,
               max_message_bytes=4096, max_seq_len=300, max_drafters=5, max_draft_len=9, prefill_chunk=0,
               device="cuda", dtype="bfloat16", seed=42, metrics_port=9100, metrics_host="0.0.0.0", http_port=8001,
               http_host="0.0.0.0", auth_tokens="/t", tls_cert="/c", tls_key="/k", tls_client_ca="/ca", insecure=True,
               local_draft="demo:draft-tiny", local_policy="tetris", local_k=3, local_extra=5, local_capacity=17,
               local_budget=40, local_max_depth=4, local_max_width=2, local_max_k=5, latency_profile="/p",
               max_local_requests=8, max_local_waiting=9, transit_tokens=4, transit_alone=True, attention="masked", pad_rows=True, cuda_graphs=True, torch_compile=True,
               async_shares="free", tool_call_parser="llama3_json", reasoning_parser="qwen3", local_draft_adapt=True,
               local_adapt_every=5, local_adapt_dir="/adapted", local_admission="slo", local_floor=0.5,
               batch_invariant=True)


def test_the_launchers_spec_file_carries_every_setting(launched):
    """A spec with every daemon setting away from its default, through the file ``verifier_command``
    writes and the daemon's own argument handling, comes back whole."""
    defaults = VerifierSpec()
    assert set(CHANGED) == {f.name for f in dataclasses.fields(VerifierSpec)} - PLACEMENT
    assert all(getattr(defaults, name) != value for name, value in CHANGED.items())
    assert launched(VerifierSpec(**CHANGED)) == VerifierSpec(**CHANGED)
    assert launched(VerifierSpec(target="demo:other")) == VerifierSpec(target="demo:other", port=0)  # a free port


def test_flags_override_the_spec_file_and_a_target_is_required(tmp_path):
    path = tmp_path / "v.toml"
    path.write_text(VerifierSpec(**CHANGED).to_toml())
    served = verifier_settings(["--budget", "3", "--spec", str(path), "--no-insecure", "--rounds", "sync"])
    assert served == VerifierSpec(**{**CHANGED, "budget": 3, "insecure": False, "rounds": "sync"})
    assert verifier_settings(["--target", "demo:target", "--budget", "5"]) == VerifierSpec(budget=5, port=50051)
    path.write_text('seed = 7\n[verifier]\nbudget = 4\n[[drafters]]\nname = "a"\n')  # a launch spec: [verifier] and its seed
    with pytest.raises(SystemExit):
        verifier_settings(["--spec", str(path)])  # no target anywhere
    assert verifier_settings(["--spec", str(path), "--target", "x"]) == VerifierSpec(target="x", budget=4, seed=7, port=50051)


@pytest.mark.parametrize("text,match", [('[verifier]\nbudgt = 3\n', "unknown keys"), ('budget = 3\n', "unknown tables"),
                                        ('[drafters]\n', "no \\[verifier\\]"), ('[verifier]\ncpus = [0]\n', "place the process"),
                                        ('[verifier]\nbudget = "x"\n', "budget")])
def test_a_bad_spec_file_is_refused_by_key(tmp_path, text, match):
    from goodspeed.launch.spec import SpecError
    from goodspeed.launch.spec_files import load_verifier_settings

    path = tmp_path / "v.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=match):
        load_verifier_settings(path)


CONFIGS = {"engine": EngineConfig, "server": ServerConfig, "local": LocalConfig}
# The settings launch/daemons/serve.py turns into something other than one config field, and why.
SERVE_HANDLES = {
    "target": "the model to load", "device": "where the models load", "dtype": "how the models load",
    "local_draft": "the local draft model to load", "latency_profile": "a file read into LocalConfig.latency",
    "eta": "EngineConfig.smoothing, with the policy", "beta": "EngineConfig.smoothing, with the policy",
    "prefill_chunk": "EngineConfig.prefill_chunk, 0 meaning None", "port": "ServerConfig.port, None meaning 50051",
    "metrics_port": "the Prometheus endpoint", "metrics_host": "the Prometheus endpoint",
}


def test_every_setting_lands_in_a_config_field_that_exists_and_defaults_alike():
    """Each setting's route names a field of EngineConfig / ServerConfig / LocalConfig with the
    same default; a setting with no route is one serve.py handles itself (listed above, so a new
    setting without a route fails here)."""
    unrouted = set()
    for f in dataclasses.fields(VerifierSpec):
        if f.name in PLACEMENT:
            continue
        routes = f.metadata["to"]
        if not routes:
            unrouted.add(f.name)
        for route in routes:
            where, name = route.split(".")
            config = {c.name: c for c in dataclasses.fields(CONFIGS[where])}
            assert name in config, f"{f.name} -> {route}: no such field"
            assert config[name].default == f.default, f"{f.name} defaults to {f.default!r}, {route} to {config[name].default!r}"
    assert unrouted == set(SERVE_HANDLES)
    assert VerifierSpec().beta == EngineConfig().smoothing.beta  # the one unrouted default a config also holds


def test_a_setting_declared_once_is_a_flag_a_spec_file_key_and_a_config_field(tmp_path):
    """What docs/ARCHITECTURE.md promises: one ``setting(...)`` line is the whole
    change. A spec class with one more (routed to a ServerConfig field no spec sets) gets the flag,
    carries it through the spec file the launcher writes, and the daemon's config receives it."""
    import argparse

    from goodspeed.launch.daemons import serve
    from goodspeed.launch.spec import setting
    from goodspeed.launch.spec_files import add_setting_flags, load_verifier_settings

    @dataclasses.dataclass(frozen=True)
    class Extended(VerifierSpec):
        warmup: bool = setting(True, "run one forward before serving", to="server.warmup")

    parser = argparse.ArgumentParser()
    add_setting_flags(parser, Extended)
    spec = Extended(warmup=False, round_deadline_ms=80.0, port=6000)
    (tmp_path / "v.toml").write_text(spec.to_toml())
    assert Extended(**load_verifier_settings(tmp_path / "v.toml", Extended)) == spec
    parsed = vars(parser.parse_args(["--target", "demo:target", "--no-warmup", "--round-deadline-ms", "80", "--port", "6000"]))
    assert Extended(**{name: parsed[name] for name in Extended.daemon_settings()}) == spec
    config = serve.server_config(spec)
    assert (config.warmup, config.round_deadline_ms) == (False, 80.0)
    assert ServerConfig().warmup is True and serve.server_config(VerifierSpec()).warmup is True


def test_the_daemon_runs_on_the_settings_it_was_given(monkeypatch):
    """The settings a spec could not reach before (drain timeout, message size, context length)
    land in the server and engine configs ``goodspeed verifier`` builds."""
    from goodspeed.launch.daemons import serve
    from goodspeed.lm.models.loading import LoadedModel
    from modelkit import tiny_llama

    monkeypatch.setattr(serve, "load_causal_lm", lambda name, **kw: LoadedModel(name, name, tiny_llama(0), None, ""))
    spec = VerifierSpec(drain_timeout_s=4.0, max_message_bytes=4096, max_seq_len=300, round_deadline_ms=90.0, budget=7,
                        rounds="async")
    server = serve.server_config(spec)
    assert (server.drain_timeout_s, server.max_message_bytes, server.round_deadline_ms, server.rounds) == (4.0, 4096, 90.0, "async")
    engine, _ = serve.build_engine(spec)
    assert (engine.max_seq_len, engine.config.budget) == (300, 7)


def test_bad_settings_fail_as_spec_errors_before_any_model_loads(monkeypatch):
    import asyncio

    import pytest

    from goodspeed.launch.daemons import serve
    from goodspeed.launch.spec import SpecError

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(serve, "load_causal_lm", no_load)
    for bad, message in ((dict(max_seq_len=1), "max_seq_len"), (dict(budget=-1), "budget"), (dict(drain_timeout_s=-1.0), "drain_timeout_s"),
                         (dict(local_draft="demo:draft-tiny", local_policy="turbospec"), "latency profile"),
                         (dict(attention="varlen"), "'varlen'.*needs a CUDA device"),
                         (dict(attention="varlen", device="cuda", dtype="float32"), "'varlen'.*needs bfloat16 or float16"),
                         (dict(cuda_graphs=True), "--cuda-graphs needs a CUDA device, not cpu")):
        with pytest.raises(SpecError, match=message):
            asyncio.run(serve.serve(VerifierSpec(**bad)))


# The draft node's flags that default otherwise than a spec's [[drafters]] keys, and why: a spec
# entry must name itself, its model and its prompts; a node started by hand drafts proactively
# (launched drafters share the launching machine's cores, so a spec turns it on per drafter).
DRAFTER_CLI_DEFAULTS = {"name": None, "draft": None, "prompts": None, "proactive": True}
DRAFTER_RUNTIME = {"spec", "verifier", "serve", "max_concurrency", "max_waiting", "api_key_file", "tool_call_parser", "reasoning_parser", "out",
                   "connect_timeout_s", "quiet"}
DRAFTER_CHANGED = dict(name="edge", draft="demo:other", prompts="/p.jsonl", max_new_tokens=7, temperature=0.7, top_k=5,
                       top_p=0.9, device="cuda:1", dtype="bfloat16", seed=42, token_file="/t", tls_ca="/ca", tls_cert="/c",
                       tls_key="/k", tls_server_name="host", proactive=True, concurrency=3, proposal_top_k=64, cuda_graphs=True,
                       torch_compile=True, tokenizer="demo:target", draft_length="allotted", adapt=True,
                       adapt_every=4, adapt_dir="/adapted", admission="slo")


def test_every_drafter_setting_is_a_flag_and_every_other_flag_is_the_nodes_run_time():
    flags = {a.dest: a.default for a in subcommand_parser("drafter")._actions if a.dest != "help"}
    spec = {f.name: f.default for f in dataclasses.fields(DrafterSpec) if f.name in DrafterSpec.node_settings()}
    assert set(flags) - DRAFTER_RUNTIME == set(spec)
    assert {name: flags[name] for name in spec if flags[name] != spec[name]} == DRAFTER_CLI_DEFAULTS


# The node settings launch/daemons/draft_node.py turns into something other than one config field,
# and why; and the routed ones whose config default differs from the spec's, and why.
DRAFT_NODE_HANDLES = {
    "prompts": "the file whose prompts it generates", "temperature": "SamplingParams", "top_k": "SamplingParams",
    "top_p": "SamplingParams", "device": "where the draft loads", "dtype": "how the draft loads",
    "tokenizer": "the tokenizer of a draft source with no model", "token_file": "the token read from it",
    "tls_ca": "the client's TLS settings", "tls_cert": "the client's TLS settings", "tls_key": "the client's TLS settings",
    "tls_server_name": "the client's TLS settings", "concurrency": "how many prompts it generates at once",
}
ROUTED_DEFAULTS_DIFFER = {
    "draft": "a spec entry must name its draft; a config's model name defaults to ''",
    "proactive": "launched drafters share the launching machine's cores (the spec's False); the client on its own device drafts ahead",
}


def test_every_drafter_setting_lands_in_a_config_field_that_exists_and_defaults_alike():
    """Each node setting's route names a field of the client's DrafterConfig or the node's
    NodeConfig with the same default (or one listed above, with why); a setting with no route is
    one draft_node.py handles itself (listed above, so a new setting without a route fails here)."""
    from goodspeed.drafter.client import DrafterConfig
    from goodspeed.drafter.node import NodeConfig

    configs = {"client": DrafterConfig, "node": NodeConfig}
    unrouted, differ = set(), set()
    for f in dataclasses.fields(DrafterSpec):
        if f.name not in DrafterSpec.node_settings():
            continue
        if not f.metadata["to"]:
            unrouted.add(f.name)
        for route in f.metadata["to"]:
            where, name = route.split(".")
            config = {c.name: c for c in dataclasses.fields(configs[where])}
            assert name in config, f"{f.name} -> {route}: no such field"
            if config[name].default != f.default:
                differ.add(f.name)
    assert unrouted == set(DRAFT_NODE_HANDLES)
    assert differ == set(ROUTED_DEFAULTS_DIFFER)
    spec = DrafterSpec(**DRAFTER_CHANGED)
    assert spec.routed("node")["proposal_top_k"] == 64 and spec.routed("client")["max_new_tokens"] == 7


def test_the_launchers_drafter_file_carries_every_node_setting(launched_drafter, tmp_path):
    """Every node setting away from its default, through the file ``drafter_command`` writes and
    the node's own argument handling, comes back whole; what places or copies the process does
    not travel, and the prompt file is the one the launcher prepared."""
    from dataclasses import replace

    from goodspeed.launch.cluster.links import LinkSpec

    defaults = DrafterSpec(name="x", draft="y", prompts="z")
    assert set(DRAFTER_CHANGED) == set(DrafterSpec.node_settings())
    assert all(getattr(defaults, name) != value for name, value in DRAFTER_CHANGED.items())
    node, args = launched_drafter(DrafterSpec(**DRAFTER_CHANGED), prompts="/p.jsonl", address="10.0.0.1:7")
    assert node == DrafterSpec(**DRAFTER_CHANGED) and (args.verifier, args.quiet) == ("10.0.0.1:7", True)
    placed = replace(DrafterSpec(**DRAFTER_CHANGED), proactive=False, count=1, max_prompts=3, cpus=(0,), link=LinkSpec(rtt_ms=40),
                     num_cpus=2.0, resources={"l4": 1.0}, node="n")
    node, _ = launched_drafter(placed, prompts=tmp_path / "trimmed.jsonl")
    assert node == replace(DrafterSpec(**DRAFTER_CHANGED), proactive=False, prompts=str(tmp_path / "trimmed.jsonl"))


def test_drafter_flags_override_the_spec_file_and_a_launch_spec_entry_is_picked_by_name(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text(DrafterSpec(**DRAFTER_CHANGED).to_toml())
    node, _ = drafter_settings(["--spec", str(path), "--verifier", "h:1", "--top-k", "2", "--no-proactive"])
    assert node == DrafterSpec(**{**DRAFTER_CHANGED, "top_k": 2, "proactive": False})
    node, args = drafter_settings(["--spec", str(path), "--verifier", "h:1", "--serve", "127.0.0.1:0"])
    assert node.prompts is None and args.serve == "127.0.0.1:0"  # --serve answers requests: the file's prompts are not read
    path.write_text('seed = 7\n[verifier]\ncpus = [0]\n[[drafters]]\nname = "a"\ndraft = "da"\nprompts = "code"\n'
                    '[[drafters]]\nname = "b"\ndraft = "db"\nprompts = "docstrings"\ntemperature = 0.5\n')
    node, _ = drafter_settings(["--spec", str(path), "--name", "b", "--verifier", "h:1"])
    assert node == DrafterSpec(name="b", draft="db", prompts="docstrings", temperature=0.5, seed=7)  # as launched from it
    assert drafter_settings(["--verifier", "h:1", "--draft", "d", "--prompts", "code"])[0] == \
        DrafterSpec(name="drafter", draft="d", prompts="code", max_new_tokens=64, proactive=True)
    with pytest.raises(SpecError, match="pick one with --name"):  # two entries: which?
        drafter_settings(["--spec", str(path), "--verifier", "h:1"])
    with pytest.raises(SpecError, match="0 \\[\\[drafters\\]\\] entries are named 'c'"):
        drafter_settings(["--spec", str(path), "--name", "c", "--verifier", "h:1"])
    for argv in (["--verifier", "h:1", "--prompts", "code"],  # no draft model
                 ["--verifier", "h:1", "--draft", "d"],  # neither prompts nor --serve
                 ["--verifier", "h:1", "--draft", "d", "--prompts", "code", "--proposal-top-k", "-1"]):
        with pytest.raises(SystemExit):
            drafter_settings(argv)


@pytest.mark.parametrize("text,match", [('[[drafters]]\nname = "a"\nmodel = "x"\n', "unknown keys"),
                                        ('[verifier]\ntarget = "x"\n', "no \\[\\[drafters\\]\\]"),
                                        ('[[drafters]]\nname = "a"\ncpus = [0]\n', "goodspeed launch"),
                                        ('[[drafters]]\nname = "a"\ncount = 2\n', "goodspeed launch"),
                                        ('[[drafters]]\nname = "a"\ntop_k = 0.5\n', "top_k")])
def test_a_bad_drafter_file_is_refused_by_key(tmp_path, text, match):
    from goodspeed.launch.spec_files import load_drafter_settings

    path = tmp_path / "d.toml"
    path.write_text(text)
    with pytest.raises(SpecError, match=match):
        load_drafter_settings(path)


def test_adapt_needs_a_draft_model_and_says_so_before_loading_anything(monkeypatch):
    """--adapt fine-tunes a draft model: with a lookup alone the node (file mode and --serve) and
    a launch spec refuse it at once; a lookup in front of a model is fine."""
    from goodspeed.launch.daemons import draft_node
    from goodspeed.lm.models import loading
    from goodspeed.launch.spec_files import load_spec

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(loading, "load_causal_lm", no_load)  # draft_node imports it where a model loads
    lookup = DrafterSpec(name="edge", draft="suffix", tokenizer="demo:target", prompts="code", adapt=True)
    with pytest.raises(SystemExit, match="--adapt needs a draft model to fine-tune; suffix is a lookup alone"):
        draft_node.run_drafter(lookup, "127.0.0.1:1")
    with pytest.raises(SystemExit, match="--adapt needs a draft model"):
        draft_node.serve_node(lookup, "127.0.0.1:1", "127.0.0.1:0")
    assert dataclasses.replace(lookup, draft="suffix+demo:draft-tiny").adapt_missing() is None
    assert dataclasses.replace(lookup, adapt=False).adapt_missing() is None
    tables = {"verifier": {"target": "demo:target"},
              "drafters": [{"name": "edge", "draft": "ngram", "prompts": "code", "adapt": True}]}
    with pytest.raises(SpecError, match="drafter 'edge': adapt needs a draft model"):
        load_spec("s.toml", tables)


def test_drafter_cuda_graphs_are_refused_off_cuda_before_a_model_loads(monkeypatch):
    """--cuda-graphs replays the node's draft forwards on CUDA (one request at a time, batched or
    --serve): off CUDA the node says so before loading anything; a launch spec the same."""
    from goodspeed.launch.daemons import draft_node
    from goodspeed.lm.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")

    monkeypatch.setattr(loading, "load_causal_lm", no_load)  # draft_node imports it where a model loads
    base = DrafterSpec(name="edge", draft="demo:draft-tiny", prompts="code", cuda_graphs=True)
    for spec in (base, dataclasses.replace(base, concurrency=2, proactive=False)):
        with pytest.raises(SystemExit, match="--cuda-graphs needs a CUDA device, not cpu"):
            draft_node.run_drafter(spec, "127.0.0.1:1")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        draft_node.serve_node(base, "127.0.0.1:1", "127.0.0.1:0")
    for concurrency in (1, 2):
        assert dataclasses.replace(base, device="cuda", concurrency=concurrency).cuda_graphs_missing() is None
    from goodspeed.launch.spec_files import load_spec

    tables = {"verifier": {"target": "demo:target"},
              "drafters": [{"name": "edge", "draft": "d", "prompts": "code", "device": "cpu", "cuda_graphs": True}]}
    with pytest.raises(SpecError, match="drafter 'edge': cuda_graphs needs a CUDA device, not cpu"):
        load_spec("s.toml", tables)
    tables["drafters"][0]["device"] = "cuda"
    assert load_spec("s.toml", tables).drafters[0].cuda_graphs


def test_the_drafter_library_configs_default_as_the_node_settings_do():
    """A setting the client's DrafterConfig or the node's NodeConfig shares with DrafterSpec has
    the spec's default, except proactive drafting, which the library (like the flag) turns on and a
    spec turns on per drafter (DRAFTER_CLI_DEFAULTS says why)."""
    from goodspeed.drafter.client import DrafterConfig
    from goodspeed.drafter.node import NodeConfig

    spec = {f.name: f.default for f in dataclasses.fields(DrafterSpec)}
    for config in (DrafterConfig, NodeConfig):
        shared = {f.name: f.default for f in dataclasses.fields(config)
                  if f.name in spec and f.default is not dataclasses.MISSING and f.name != "proactive"}
        assert shared and shared == {name: spec[name] for name in shared}, config
    assert {f.name: f.default for f in dataclasses.fields(DrafterConfig)}["proactive"] == DRAFTER_CLI_DEFAULTS["proactive"]
