"""Launch specs: a TOML file naming the verifier and the drafters of a local cluster.

    [verifier]                        # every `goodspeed verifier` flag, as a key (VerifierSpec's
    target = "demo:target"            # fields), e.g. budget, policy, eta, round_deadline_ms,
    budget = 16                       # max_seq_len, seed, cpus, port (default: a free one)
    [[drafters]]                      # name, draft, prompts (a shipped set: code, docstrings,
    name = "code"                     # comments, project; or a JSONL path), max_new_tokens,
    draft = "demo:draft-distilled"    # temperature, top_k, top_p, count (copies), max_prompts,
    prompts = "code"                  # device, dtype, seed, cpus, link, proactive, concurrency,
                                      # proposal_top_k

``link = { rtt_ms = 40, jitter_ms = 5, mbit = 20, loss = 0.01 }`` runs that drafter in its own
network namespace behind an emulated edge link (:mod:`goodspeed.launch.cluster.links`; needs root).
The verifier's ``local_*`` keys and ``latency_profile`` turn on local serving.

``cpus`` pins a process to those CPUs (and sizes its thread pools to match), so experiments on
one machine can keep drafting off the verifier's cores, as separate edge devices would.

Placement keys, for ``goodspeed launch --backend ray`` (the local backend runs everything on this
machine and does not read them): ``num_cpus`` (logical CPUs Ray reserves on the node, also the
process's thread count; default 1), ``num_gpus`` (default 0; a ``cuda`` device needs >= 1),
``resources`` (custom node resources, e.g. ``resources = { h100 = 1 }`` or ``{ l4 = 1 }``) and
``node`` (a node's name, IP or ID: put the process exactly there).

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from goodspeed.api.reasoning import PARSER_HELP as REASONING_PARSER_HELP
from goodspeed.api.reasoning import PARSERS as REASONING_PARSERS
from goodspeed.api.tools import PARSER_HELP as TOOL_PARSER_HELP
from goodspeed.api.tools import PARSERS as TOOL_PARSERS
from goodspeed.launch.cluster.links import LinkSpec
from goodspeed.lm.models.precision import DTYPES as TORCH_DTYPES
from goodspeed.lm.decoding.params import PROPOSAL_TOP_K
from goodspeed.lm.decoding.seeding import resolve_root_seed
from goodspeed.scheduler.policy import POLICIES
from goodspeed.verifier.records import ROUND_MODES, SHARE_MODES
from goodspeed.verifier.sessions import ATTENTION_PATHS

PROMPT_SETS = Path(__file__).resolve().parent / "prompts"
SPECS_DIR = Path(__file__).resolve().parent / "specs"
DEFAULT_SPEC = SPECS_DIR / "default.toml"


def spec_path(name: str | Path | None) -> Path | None:
    """A spec file, or a shipped spec by name (``real-smollm2`` -> launch/specs/real-smollm2.toml);
    ``SpecError`` listing the shipped names when it is neither."""
    if name is None:
        return None
    shipped = SPECS_DIR / f"{name}.toml"
    if Path(name).exists():
        return Path(name)
    if shipped.exists():
        return shipped
    known = ", ".join(sorted(p.stem for p in SPECS_DIR.glob("*.toml")))
    raise SpecError(f"{name}: neither a spec file nor a shipped spec (shipped: {known})")


class SpecError(ValueError):
    """The spec is invalid; the message names the key."""


RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
# What --dtype accepts; auto: bf16 where the device computes it natively, else fp32 (lm.models.precision)
DTYPES = ("auto", *TORCH_DTYPES)


@dataclass(frozen=True)
class Placement:
    """What one process asks of the node it runs on (the Ray backend's placement keys)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()
    node: str | None = None

    def demand(self) -> dict[str, float]:
        """Ray resource names -> amounts (zeros left out)."""
        out = {"CPU": self.num_cpus, "GPU": self.num_gpus, **dict(self.resources)}
        return {k: v for k, v in out.items() if v > 0}

    def describe(self) -> str:
        parts = [f"{k} {v:g}" for k, v in self.demand().items()]
        return ", ".join(parts + ([f"node {self.node}"] if self.node else [])) or "nothing"


def placement_of(spec: "VerifierSpec | DrafterSpec") -> Placement:
    return Placement(spec.num_cpus, spec.num_gpus, tuple(sorted((spec.resources or {}).items())), spec.node)


def setting(default, help: str = "", to: str | tuple[str, ...] | None = None, cli_default=..., **flag):
    """One ``goodspeed verifier`` or ``goodspeed drafter`` setting, declared once (``MISSING``: a
    key every spec entry must give): its spec key and flag (the field's name),
    its default, its flag's ``help``, and where it lands: ``to`` names the library config fields
    the daemon sets from it (``"engine.budget"``: ``EngineConfig.budget``; ``"server.*"``:
    ``ServerConfig``; ``"local.*"``: ``LocalConfig``), or None for the few that
    :mod:`goodspeed.launch.daemons.serve` turns into something else (the model to load, the smoothing
    config, the metrics endpoint). ``cli_default``: the flag's default where it differs from the
    spec's; ``flag``: extra ``argparse`` keywords (``choices``, ``required``). The flag, its help,
    the launcher's argv and the configs the daemon runs on all follow from this one line
    (``tests/launch/test_settings_sync.py``)."""
    routes = () if to is None else (to,) if isinstance(to, str) else tuple(to)
    if cli_default is not ...:
        flag["default"] = cli_default
    return field(default=default, metadata={"help": help, "to": routes, "flag": flag})


class DeclaredSettings:
    """What a spec whose settings are declared with :func:`setting` can say about them."""

    @classmethod
    def flag_settings(cls) -> list[str]:
        """The settings that are flags of the spec's command."""
        raise NotImplementedError

    @classmethod
    def local_settings(cls) -> list[str]:
        """The flags listed under local serving in the command's help (none but the verifier's)."""
        return []

    def routed(self, config: str) -> dict:
        """The settings that land in ``config`` (the first part of a route: ``engine``,
        ``server``, ``local``; ``client``, ``node``), as that config's keyword arguments."""
        out = {}
        for f in fields(self):
            for route in f.metadata.get("to", ()):
                where, name = route.split(".")
                if where == config:
                    out[name] = getattr(self, f.name)
        return out


@dataclass(frozen=True)
class VerifierSpec(DeclaredSettings):
    """The verifier daemon's settings (``goodspeed verifier`` flags, a spec's ``[verifier]``); each
    declared once, with :func:`setting`."""

    target: str = setting("demo:target", "hub id, directory or demo:<name> (required, here or in --spec's file)", cli_default=None)
    host: str = setting("127.0.0.1", "address the gRPC service listens on", to="server.host")
    # `goodspeed verifier` listens on 50051 by default; `goodspeed launch` on a free port unless a spec
    # sets one (e.g. a port a firewall opens on a Ray cluster), reading the bound port from the log.
    port: int | None = setting(None, "gRPC port (`goodspeed launch`: a free one unless set)", cli_default=50051)
    budget: int = setting(16, "C: drafted tokens per round, all drafters together", to="engine.budget")
    policy: str = setting("goodspeed", "the draft-length policy", to="engine.policy", choices=sorted(POLICIES))
    eta: float | None = setting(None, "acceptance smoothing (eq. 3; default: the policy's, 0.1 for goodspeed, "
                                      "0.2 for goodspeed-paper)")
    beta: float = setting(0.5, "goodput smoothing (eq. 4)")
    rounds: str = setting("sync", "sync: the paper's lockstep round; async: verify whatever drafts arrived whenever the "
                                  "engine is free (verifier.round_loop)", to="server.rounds", choices=ROUND_MODES)
    async_shares: str = setting("plan", "async rounds: plan: the policy splits C among every drafter with a request at each "
                                        "step and the step's drafters take their shares as far as the others' outstanding "
                                        "allotments leave room; free: the step's drafters split what the others leave", to="server.async_shares", choices=SHARE_MODES)
    round_deadline_ms: float = setting(250.0, "close a round this long after its first draft", to="server.round_deadline_ms")
    max_missed_rounds: int = setting(3, "drop a drafter after this many consecutive misses", to="server.max_missed_rounds")
    idle_timeout_s: float = setting(60.0, "drop a session with a request in progress that sends nothing this long",
                                    to="server.idle_timeout_s")
    stream_open_timeout_s: float = setting(10.0, "drop a session that opens no verdict stream this long after joining",
                                           to="server.stream_open_timeout_s")
    drain_timeout_s: float = setting(30.0, "on SIGTERM: let rounds and local requests in progress finish this long, then stop",
                                     to="server.drain_timeout_s")
    max_message_bytes: int = setting(32 * 1024 * 1024, "largest gRPC message either way (a dense draft distribution "
                                                       "is S x V floats)", to="server.max_message_bytes")
    max_seq_len: int | None = setting(None, "prompt + generated tokens per request (default: the target's "
                                            "max_position_embeddings)", to="engine.max_seq_len")
    max_drafters: int = setting(64, "edge drafters served at once", to="engine.max_drafters")
    max_draft_len: int = setting(16, "cap on any one drafter's S_i", to="engine.max_draft_len")
    prefill_chunk: int = setting(512, "prompt tokens prefilled per step, packed next to verification, so a long prompt "
                                      "delays others' rounds by one chunk at most (0: whole prompts at StartRequest)")
    transit_tokens: int = setting(0, "async rounds: while a drafter's draft is in transit, decode up to this many of its "
                                     "tokens in the steps that run anyway (verifier.engine; 0: off)",
                                  to="engine.transit_tokens")
    transit_alone: bool = setting(False, "with transit decoding: when no draft is waiting, also run a step that only "
                                         "decodes for drafters whose drafts are away, where the wait rule's objective "
                                         "says it pays (verifier.round_loop)", to="server.transit_alone")
    attention: str = setting("auto", "packed forwards' attention: auto (flash's varlen kernel for chains on CUDA in "
                                     "bf16 / fp16 where torch has it, else masked SDPA), varlen (require that kernel) "
                                     "or masked (masked SDPA everywhere)", to="engine.attention", choices=ATTENTION_PATHS)
    pad_rows: bool = setting(False, "lay a step's rows out padded, pads in the target's input, where the step allows it "
                                    "(no prompt chunk): tree rows then attend with no gather or scatter, two ops a layer "
                                    "that a launch-bound GPU pays; the linear layers see the pads (14-20%% slower on CPU; "
                                    "not yet timed on a GPU)", to="engine.pad_rows")
    cuda_graphs: bool = setting(False, "replay the target's steps (and the local draft's forwards) as CUDA graphs, one per "
                                       "shape of rows, queries and keys rounded up to powers of two, rows padded "
                                       "(goodspeed.lm.runtime.graphs); steps with prompt chunks or over 1,024 tokens run eagerly; "
                                       "CUDA only (on an H200 a step cost 2.4-5.5x less: docs/MEASUREMENTS.md)",
                                to="engine.cuda_graphs")
    torch_compile: bool = setting(False, "run the target's steps (and the local draft's forwards) at the same fixed shapes "
                                         "through a decoder compiled by torch.compile (inductor; a handful of graphs, tens "
                                         "of seconds each on a CPU, compiled in the verifier's warm-up); any device; with --cuda-graphs the graphs "
                                         "record the compiled kernels (not yet run on a GPU)",
                                  to="engine.torch_compile")
    batch_invariant: bool = setting(False, "run the target's linear layers in runs of at most 32 rows, so a token's logits are "
                                           "the same bit for bit in any step and greedy output in bf16 equals plain decoding's "
                                           "at a batch too (without it: one request at a time); bf16 on a CPU with AMX only; a forward of "
                                           "over 32 tokens costs more in its linear layers (goodspeed.lm.runtime.invariant)", to="engine.batch_invariant")
    device: str = setting("cpu", "the target's (and the local draft's) torch device: cpu, cuda or cuda:N")
    dtype: str = setting("auto", "the target's (and the local draft's) torch dtype; auto: bf16 where the device computes it "
                                 "natively (a GPU, a CPU with avx512_bf16 / amx_bf16 / Arm bf16), float32 elsewhere and "
                                 "for the demo models", choices=DTYPES)
    seed: int | None = setting(None, "root seed: every random stream of this process derives from it and its role and name "
                                     "(default: fresh OS entropy, logged so the run can be replayed; in a spec: the "
                                     "spec's top-level seed)", to=("engine.seed", "local.seed"))
    metrics_port: int | None = setting(None, "serve Prometheus metrics here")
    metrics_host: str = setting("127.0.0.1", "address of the metrics endpoint (default: loopback only)")
    http_port: int | None = setting(None, "serve the OpenAI-compatible API of local serving here (/v1/chat/completions, "
                                          "/v1/completions, /v1/models, /metrics; needs --local-draft)", to="server.http_port")
    http_host: str = setting("127.0.0.1", "address of the HTTP API (default: loopback only)", to="server.http_host")
    tool_call_parser: str | None = setting(None, "the HTTP API: " + TOOL_PARSER_HELP, to="server.tool_call_parser",
                                           choices=TOOL_PARSERS)
    reasoning_parser: str | None = setting(None, "the HTTP API: " + REASONING_PARSER_HELP, to="server.reasoning_parser",
                                           choices=REASONING_PARSERS)
    auth_tokens: str | None = setting(None, "token file (`goodspeed tokens add`): every RPC but health needs a listed bearer "
                                            "token (`goodspeed launch` makes one per run if unset)", to="server.auth_tokens")
    tls_cert: str | None = setting(None, "PEM certificate: serve TLS (with --tls-key; `goodspeed launch` makes a CA per run "
                                         "if unset)", to="server.tls_cert")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert", to="server.tls_key")
    tls_client_ca: str | None = setting(None, "PEM CA: mutual TLS, clients must present a certificate it signed (its common "
                                              "name is the caller's identity without --auth-tokens)", to="server.tls_client_ca")
    insecure: bool = setting(False, "accept plaintext on a non-loopback --host (refused otherwise)", to="server.insecure")
    cpus: tuple[int, ...] | None = None  # CPU affinity (Linux), e.g. to keep drafters off the verifier's cores
    # Local serving (Generate RPC): the verifier's own draft model and how it speculates.
    local_draft: str | None = setting(None, "serve Generate requests, drafting with this source: a model (hub id, directory or "
                                            "demo:<name>), a lookup (ngram, suffix) or LOOKUP+MODEL")
    local_policy: str = setting("chain", "how local requests speculate: none, chain, tetris, adaserve, turbospec, nightjar or goodput "
                                         "(goodspeed.verifier.local_policies.LOCAL_POLICY_CLASSES; checked before any model loads)",
                                to="local.policy")
    local_k: int = setting(4, "chain: tokens drafted per request; tetris: base length", to="local.k")
    local_extra: int = setting(2, "tetris: extra tokens drafted per request", to="local.extra")
    local_capacity: int | None = setting(None, "tetris: draft tokens verified per iteration (default k x requests)",
                                         to="local.capacity")
    local_budget: int = setting(32, "adaserve: B, tree nodes per iteration, roots included", to="local.budget")
    local_max_depth: int = setting(6, "adaserve: D_max", to="local.max_depth")
    local_max_width: int = setting(3, "adaserve: W_max", to="local.max_width")
    local_max_k: int = setting(6, "turbospec / nightjar: largest k", to="local.max_k")
    local_floor: float = setting(0.0, "goodput: keep every local request at least this fraction of plain decoding's pace "
                                      "over its life, by what other requests' drafts may add to its steps (0, the default: "
                                      "off, the batch's most tokens a second alone; on a CPU 0.97 cost more than it "
                                      "protected: docs/MEASUREMENTS.md)", to="local.floor")
    latency_profile: str | None = setting(None, "turbospec: the JSON `goodspeed profile` wrote")
    max_local_requests: int = setting(32, "local requests decoded together; later ones wait", to="local.max_requests")
    max_local_waiting: int = setting(256, "local requests queued behind those; more are refused (RESOURCE_EXHAUSTED)",
                                     to="local.max_waiting")
    local_admission: str = setting("count", "which waiting local requests join the batch: count (while fewer than "
                                   "--max-local-requests decode) or slo (also only while the batch's predicted time per "
                                   "token, measured from its steps, stays within every decoding request's TPOT SLO)",
                                   to="local.admission", choices=("count", "slo"))
    local_draft_adapt: bool = setting(False, "fine-tune the local draft model on the local requests served, in the "
                                      "background, keeping new weights only when they accept more on held-back recent "
                                      "requests (goodspeed.verifier.local_adapt; lossless)", to="local.adapt")
    local_adapt_every: int = setting(16, "--local-draft-adapt: finished requests between two fine-tunes (default: "
                                     "%(default)s)", to="local.adapt_every")
    local_adapt_dir: str | None = setting(None, "--local-draft-adapt: a directory where adopted weights persist across "
                                          "restarts", to="local.adapt_dir")
    # Placement (Ray backend): see the module docstring.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] | None = None
    node: str | None = None

    PLACEMENT = ("cpus", "num_cpus", "num_gpus", "resources", "node")  # where the launcher runs it: not the daemon's

    @classmethod
    def daemon_settings(cls) -> list[str]:
        """The fields that are ``goodspeed verifier`` flags, one for one (same names and defaults,
        but for the CLI-only ones :func:`setting` names). The launcher's argv, the CLI's flags and
        the configs :mod:`goodspeed.launch.daemons.serve` builds follow from this list."""
        return [f.name for f in fields(cls) if f.name not in cls.PLACEMENT]

    @classmethod
    def local_settings(cls) -> list[str]:
        """The local-serving settings: ``local_draft`` and those landing in ``LocalConfig``."""
        return ["local_draft"] + [f.name for f in fields(cls) if f.metadata.get("to", ())[:1] and
                                  all(t.startswith("local.") for t in f.metadata["to"])] + ["latency_profile"]

    @classmethod
    def flag_settings(cls) -> list[str]:
        return cls.daemon_settings()

    def to_toml(self) -> str:
        """These daemon settings as a spec file's ``[verifier]`` table (unset ones left out): what
        ``goodspeed launch`` hands the verifier process (``goodspeed verifier --spec FILE``), read
        back by :func:`load_verifier_settings` to the same spec."""
        return _toml_table("[verifier]", self, self.daemon_settings())


def _toml_table(header: str, spec, names: list[str]) -> str:
    """``spec``'s settings ``names`` under ``header`` as TOML (unset ones left out)."""
    lines = [header]
    for name in names:
        value = getattr(spec, name)
        if value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # JSON's string escapes are TOML's basic-string escapes
    if isinstance(value, float):
        return repr(value)  # TOML floats, inf and nan included
    if isinstance(value, int):
        return str(value)
    raise TypeError(f"no TOML form for {value!r}")


@dataclass(frozen=True)
class DrafterSpec(DeclaredSettings):
    """One draft node's settings (``goodspeed drafter`` flags, a spec's ``[[drafters]]``); each node
    setting declared once, with :func:`setting` (routes: ``client.*`` is the single-request client's
    ``DrafterConfig``, ``node.*`` the edge node's ``NodeConfig``)."""

    name: str = setting(MISSING, "this node's name, its identity without a token or certificate (default: drafter); "
                        "with --spec, the entry to read (default: the file's only one)", to=("client.name", "node.name"),
                        cli_default=None)
    draft: str = setting(MISSING, "the draft source (required, here or in --spec's file): a model (hub id, directory or "
                         "demo:<name>), a lookup with no model (ngram, suffix; give --tokenizer), or LOOKUP+MODEL (each "
                         "round the part whose draft is worth more by its acceptance measured on the request)",
                         to=("client.model_name", "node.model_name"), cli_default=None)
    prompts: str = setting(MISSING, "JSONL with 'prompt' or 'prompt_ids' (and optional 'id') per line, or a shipped set "
                           "name", cli_default=None)
    max_new_tokens: int = setting(64, "tokens each request generates at most", to="client.max_new_tokens")
    temperature: float = setting(0.0, "0: greedy")
    top_k: int = setting(0, "0: off")
    top_p: float = setting(1.0, "1: off")
    count: int = 1
    max_prompts: int | None = None
    device: str = setting("cpu", "cpu, cuda or cuda:N")
    dtype: str = setting("auto", "the draft's weights; auto: bf16 where the device computes it natively, float32 "
                                 "elsewhere and for the demo models", choices=DTYPES)
    seed: int | None = setting(None, "root seed: every random stream of this process derives from it and its role and "
                               "name (default: the spec's top-level seed, else fresh OS entropy, logged so the run can "
                               "be replayed)", to=("client.seed", "node.seed"))
    tokenizer: str | None = setting(None, "the target's tokenizer (a model name), for a draft source with no model")
    cpus: tuple[int, ...] | None = None  # CPU affinity (Linux)
    token_file: str | None = setting(None, "file holding a bearer token (for a verifier with --auth-tokens; "
                                     "`goodspeed launch` sets it with the verifier's tokens)")
    tls_ca: str | None = setting(None, "PEM CA of the verifier's certificate: dial with TLS")
    tls_cert: str | None = setting(None, "PEM client certificate for mutual TLS (with --tls-key)")
    tls_key: str | None = setting(None, "PEM private key of --tls-cert")
    tls_server_name: str | None = setting(None, "name to check in the verifier's certificate, if not the dialled host")
    link: LinkSpec | None = None  # an emulated edge link (needs root): rtt_ms, jitter_ms, mbit, loss
    # Off for launched drafters, which share this machine's cores: one drafter's pre-drafting takes
    # CPU from another's drafting (docs/EXPERIMENT-LOG.md measured it); `goodspeed drafter` on its
    # own device has it on unless --no-proactive.
    proactive: bool = setting(False, "draft the next round while a draft is being verified (SpecEdge's idea; one "
                              "request at a time; default: on)", to="client.proactive", cli_default=True)
    concurrency: int = setting(1, "--prompts: requests generating at once, drafted together through the node's "
                               "batched drafting (one verifier session each, all under this node's name: one device, "
                               "one utility term); more than 1 needs --no-proactive")
    proposal_top_k: int = setting(PROPOSAL_TOP_K, "sampled drafts: draw from and send only the draft distribution's K "
                                  "most likely tokens a position, K (id, prob) pairs on the wire instead of the "
                                  "vocabulary's floats; lossless (the verifier tests against exactly that q); 0: the "
                                  "whole vocabulary (default: %(default)s)", to="node.proposal_top_k")
    cuda_graphs: bool = setting(False, "replay the node's draft forwards (one request's at a time, or its batched "
                                "drafting with --serve or --concurrency > 1) as CUDA graphs (goodspeed.lm.runtime.graphs); "
                                "CUDA only; on an H200 a round of one request's drafting cost 0.15-0.41x "
                                "(docs/MEASUREMENTS.md)", to="node.cuda_graphs")
    torch_compile: bool = setting(False, "run the node's draft forwards at fixed shapes through a decoder compiled by "
                                  "torch.compile (goodspeed.lm.runtime.graphs; compiled in a warm-up before the node "
                                  "joins); any device; on this project's CPU a round of one request's drafting cost "
                                  "0.88-0.93x the eager one's with the SmolLM2 draft (docs/MEASUREMENTS.md)",
                                  to="node.torch_compile")
    draft_length: str = setting("goodput", "goodput: each round drafts the length (at most the verifier's S_i) with the "
                                "most expected tokens per second from the request's measured acceptance and this node's "
                                "drafting and round times, 0 where speculation does not pay (goodspeed.scheduler.paying); "
                                "allotted: always S_i (through the node: --concurrency > 1, --serve, or a lookup draft "
                                "source)", to="node.draft_length", choices=("goodput", "allotted"))
    admission: str = setting("count", "--serve: which waiting requests start: count (while fewer than "
                             "--max-concurrency generate) or slo (also only while the node's time per token, fitted on "
                             "its requests' rounds, stays within 90%% of every request's tpot_slo_ms; first in, first "
                             "out; goodspeed.scheduler.admission)", to="node.admission", choices=("count", "slo"))
    adapt: bool = setting(False, "fine-tune the draft on this node's own traffic between requests, in the background, "
                          "keeping new weights only when they accept more on held-back recent requests "
                          "(goodspeed.lm.models.adapt; drafts through the node; lossless: the verifier verifies any draft)",
                          to="node.adapt")
    adapt_every: int = setting(16, "--adapt: finished requests between two fine-tunes (default: %(default)s)",
                               to="node.adapt_every")
    adapt_dir: str | None = setting(None, "--adapt: a directory where adopted weights persist across restarts (loaded "
                                    "only onto the same shipped draft)", to="node.adapt_dir")
    # Placement (Ray backend): see the module docstring.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] | None = None
    node: str | None = None

    # How the launcher starts the process (copies, a trimmed prompt file, where it runs, its link):
    # not settings of the draft node itself.
    LAUNCHER = ("count", "max_prompts", "cpus", "link", "num_cpus", "num_gpus", "resources", "node")

    def cuda_graphs_missing(self) -> str | None:
        """Why ``cuda_graphs`` cannot apply to this drafter, in words, or None: it needs a CUDA device."""
        if self.cuda_graphs and not self.device.startswith("cuda"):
            return f"needs a CUDA device, not {self.device}"
        return None

    def adapt_missing(self) -> str | None:
        """Why ``adapt`` cannot apply to this drafter, in words, or None: it needs a draft model."""
        from goodspeed.lm.decoding.draft_source import DraftSpec

        if not self.adapt:
            return None
        try:
            source = DraftSpec.parse(self.draft)
        except ValueError:  # a bad --draft is said where the draft loads
            return None
        if not source.needs_model:
            return f"needs a draft model to fine-tune; {self.draft} is a lookup alone (give MODEL or LOOKUP+MODEL)"
        return None

    def setting_problem(self) -> tuple[str, str] | None:
        """The first setting that cannot apply to this drafter and why, in words (``cuda_graphs``
        off CUDA, ``adapt`` with no draft model), or None: said before anything loads."""
        for name, why in (("cuda_graphs", self.cuda_graphs_missing()), ("adapt", self.adapt_missing())):
            if why is not None:
                return name, why
        return None

    @classmethod
    def node_settings(cls) -> list[str]:
        """The fields that are ``goodspeed drafter`` flags, one for one (same names; the defaults
        the flags differ in are each declared with ``cli_default``)."""
        return [f.name for f in fields(cls) if f.name not in cls.LAUNCHER]

    @classmethod
    def flag_settings(cls) -> list[str]:
        return cls.node_settings()

    def to_toml(self) -> str:
        """This node's settings as a spec file's one ``[[drafters]]`` entry: what ``goodspeed
        launch`` hands each drafter process (``goodspeed drafter --spec FILE``), read back by
        :func:`load_drafter_settings` to the same settings."""
        return _toml_table("[[drafters]]", self, self.node_settings())

    def prompt_path(self) -> Path:
        return prompt_set_path(self.prompts, f"drafter {self.name!r}")


def prompt_set_path(prompts: str, where: str = "prompts") -> Path:
    """A shipped prompt set by name (code, docstrings, comments, project) or a JSONL path."""
    shipped = PROMPT_SETS / f"{prompts}.jsonl"
    path = shipped if shipped.exists() else Path(prompts)
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROMPT_SETS.glob("*.jsonl")))
        raise SpecError(f"{where}: prompts {prompts!r} is neither a shipped set ({known}) nor a file")
    return path


@dataclass(frozen=True)
class LaunchSpec:
    verifier: VerifierSpec
    drafters: tuple[DrafterSpec, ...] = field(default_factory=tuple)
    seed: int | None = None  # the run's root seed: every process without its own seed gets it

    def expanded_drafters(self) -> list[DrafterSpec]:
        """One entry per process: ``count = n`` becomes ``name-0 .. name-(n-1)``. Their random
        streams differ by name (goodspeed.lm.decoding.seeding), so the copies may share a root seed."""
        out = []
        for d in self.drafters:
            if d.count == 1:
                out.append(d)
            else:
                out.extend(replace(d, name=f"{d.name}-{i}", count=1) for i in range(d.count))
        return out

    def seeded(self) -> "LaunchSpec":
        """This spec with a root seed fixed for the run (fresh OS entropy when the spec has none)
        and given to every process that has no seed of its own, so the run can be replayed by
        putting that seed in the spec."""
        root = resolve_root_seed(self.seed)
        verifier = self.verifier if self.verifier.seed is not None else replace(self.verifier, seed=root)
        drafters = tuple(d if d.seed is not None else replace(d, seed=root) for d in self.drafters)
        return LaunchSpec(verifier, drafters, root)


def split_host_port(text: str, least_port: int = 0) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``, the port in ``least_port..65535`` (0: any free port, where
    listening); ``ValueError`` saying what is wrong otherwise. ``[::1]:50051`` keeps its brackets.

    >>> split_host_port("127.0.0.1:8000")
    ('127.0.0.1', 8000)
    """
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"wants HOST:PORT, got {text!r}")
    if not least_port <= int(port) <= 65535:
        raise ValueError(f"port must lie in {least_port}..65535, got {text!r}")
    return host, int(port)
