"""Launch specs: a TOML file naming the verifier and the drafters of a local cluster.

    [verifier]                        # every `goodspeed verifier` flag, as a key (VerifierSpec's
    target = "demo:target"            # fields), e.g. budget, policy, eta, round_deadline_ms,
    budget = 16                       # max_seq_len, seed, cpus, port (default: a free one)
    [[drafters]]                      # name, draft, prompts (a shipped set: code, docstrings,
    name = "code"                     # comments, project; or a JSONL path), max_new_tokens,
    draft = "demo:draft-distilled"    # temperature, top_k, top_p, count (copies), max_prompts,
    prompts = "code"                  # device, dtype, seed, cpus, link

``link = { rtt_ms = 40, jitter_ms = 5, mbit = 20, loss = 0.01 }`` runs that drafter in its own
network namespace behind an emulated edge link (:mod:`goodspeed.launch.links`; needs root).
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

import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from goodspeed.launch.links import LinkSpec
from goodspeed.lm.seeding import resolve_root_seed

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROMPT_SETS = Path(__file__).resolve().parent / "prompts"
SPECS_DIR = Path(__file__).resolve().parent / "specs"
DEFAULT_SPEC = SPECS_DIR / "default.toml"


def spec_path(name: str | Path | None) -> Path | None:
    """A spec file, or a shipped spec by name (``real-smollm2`` -> launch/specs/real-smollm2.toml)."""
    if name is None:
        return None
    shipped = SPECS_DIR / f"{name}.toml"
    return shipped if not Path(name).exists() and shipped.exists() else Path(name)


class SpecError(ValueError):
    """The spec is invalid; the message names the key."""


RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


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


@dataclass(frozen=True)
class VerifierSpec:
    """The verifier daemon's settings (``goodspeed verifier`` flags, a spec's ``[verifier]``)."""

    target: str = "demo:target"
    host: str = "127.0.0.1"
    # `goodspeed verifier` listens on 50051 by default; `goodspeed launch` on a free port unless a spec
    # sets one (e.g. a port a firewall opens on a Ray cluster), reading the bound port from the log.
    port: int | None = None
    budget: int = 16
    policy: str = "goodspeed"
    eta: float | None = None  # default: the policy's (scheduler.policy.default_eta)
    beta: float = 0.5
    rounds: str = "sync"  # sync: the paper's lockstep round; async: every drafter at its own cadence (verifier.round_loop)
    round_deadline_ms: float = 250.0
    max_missed_rounds: int = 3
    idle_timeout_s: float = 60.0
    drain_timeout_s: float = 30.0  # on SIGTERM: let rounds and local requests in progress finish this long
    max_message_bytes: int = 32 * 1024 * 1024  # largest gRPC message either way (a dense q is S x V floats)
    max_seq_len: int | None = None  # prompt + generated tokens per request (default: the target's max_position_embeddings)
    max_drafters: int = 64
    max_draft_len: int = 16
    prefill_chunk: int = 512  # prompt tokens prefilled per step, next to verification (chunked prefill); 0: whole prompts
    device: str = "cpu"
    dtype: str = "float32"
    seed: int | None = None  # root seed (default: the spec's top-level seed)
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"  # the metrics endpoint stays on loopback unless told otherwise
    http_port: int | None = None  # the OpenAI-compatible API of local serving (needs local_draft)
    http_host: str = "127.0.0.1"
    auth_tokens: str | None = None  # token file (goodspeed tokens add); `goodspeed launch` makes one per run if unset
    tls_cert: str | None = None  # PEM certificate + key: serve TLS (`goodspeed launch` makes a CA per run if unset)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # PEM: mutual TLS (clients need a certificate signed by it)
    insecure: bool = False  # accept plaintext on a non-loopback host (refused otherwise)
    cpus: tuple[int, ...] | None = None  # CPU affinity (Linux), e.g. to keep drafters off the verifier's cores
    # Local serving (Generate RPC): the verifier's own draft model and how it speculates.
    local_draft: str | None = None
    local_policy: str = "chain"  # none, chain, tetris, adaserve, turbospec, nightjar
    local_k: int = 4  # chain length (chain), base length (tetris)
    local_extra: int = 2  # tetris: extra tokens drafted per request
    local_capacity: int | None = None  # tetris: tokens verified per iteration (default k * requests)
    local_budget: int = 32  # adaserve: B, tree nodes per iteration (roots included)
    local_max_depth: int = 6  # adaserve: D_max
    local_max_width: int = 3  # adaserve: W_max
    local_max_k: int = 6  # turbospec / nightjar: largest k
    latency_profile: str | None = None  # turbospec: the file `goodspeed profile` wrote
    max_local_requests: int = 32  # local requests decoded together
    max_local_waiting: int = 256  # local requests queued behind them; more get RESOURCE_EXHAUSTED
    # Placement (Ray backend): see the module docstring.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] | None = None
    node: str | None = None

    LOCAL_FLAGS = ("local_draft", "local_policy", "local_k", "local_extra", "local_capacity", "local_budget",
                   "local_max_depth", "local_max_width", "local_max_k", "latency_profile", "max_local_requests",
                   "max_local_waiting")
    PLACEMENT = ("cpus", "num_cpus", "num_gpus", "resources", "node")  # where the launcher runs it: not the daemon's

    @classmethod
    def daemon_settings(cls) -> list[str]:
        """The fields that are ``goodspeed verifier`` flags, one for one (same names and defaults:
        ``tests/launch/test_settings_sync.py``). A new daemon setting is a field here, its flag in
        ``launch/cli.py`` and its use in ``launch/serve.py``; the launcher's argv and the CLI's spec
        follow from this list."""
        return [f.name for f in fields(cls) if f.name not in cls.PLACEMENT]

    def daemon_flags(self) -> list[str]:
        """The ``goodspeed verifier`` argv for these settings: unset (None) ones are left out, a true
        switch is its bare flag, and the local-serving settings only go when local serving is on."""
        out = []
        for name in self.daemon_settings():
            value = getattr(self, name)
            if value is None or value is False or (self.local_draft is None and name in self.LOCAL_FLAGS):
                continue
            out += ["--" + name.replace("_", "-")] + ([] if value is True else [str(value)])
        return out


def flag_args(spec, *names: str) -> list[str]:
    """``--name value`` for each of the spec's settings ``names`` that is set (not None)."""
    out = []
    for name in names:
        value = getattr(spec, name)
        if value is not None:
            out += ["--" + name.replace("_", "-"), str(value)]
    return out


@dataclass(frozen=True)
class DrafterSpec:
    """One draft node's settings (``goodspeed drafter`` flags, a spec's ``[[drafters]]``)."""

    name: str
    draft: str
    prompts: str
    max_new_tokens: int = 48
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    count: int = 1
    max_prompts: int | None = None
    device: str = "cpu"
    dtype: str = "float32"
    seed: int | None = None  # root seed (default: the spec's top-level seed)
    cpus: tuple[int, ...] | None = None  # CPU affinity (Linux)
    token_file: str | None = None  # this drafter's bearer token (set by `goodspeed launch` with the verifier's tokens)
    tls_ca: str | None = None  # PEM: the CA of the verifier's certificate (TLS); tls_cert/tls_key: this node's
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None  # the name to check in the verifier's certificate, if not the dialled host
    link: LinkSpec | None = None  # an emulated edge link (needs root): rtt_ms, jitter_ms, mbit, loss
    # Draft the next round while a draft is in flight (goodspeed.drafter.runner). Off for launched
    # drafters, which share this machine's cores: one drafter's pre-drafting takes CPU from
    # another's drafting (docs/EXPERIMENTS.md measured it); `goodspeed drafter` on its own device
    # has it on unless --no-proactive.
    proactive: bool = False
    # Placement (Ray backend): see the module docstring.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] | None = None
    node: str | None = None

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
        streams differ by name (goodspeed.lm.seeding), so the copies may share a root seed."""
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


def build_table(cls, table: dict, where: str):
    """A frozen dataclass from a TOML table; unknown keys and wrong types raise :class:`SpecError`."""
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise SpecError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    if "link" in table:
        link = table["link"]
        if not isinstance(link, dict):
            raise SpecError(f"{where}: link must be a table, e.g. link = {{ rtt_ms = 40, jitter_ms = 5, mbit = 20, loss = 0.01 }}")
        try:
            table = {**table, "link": LinkSpec(**link)}
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{where}: {exc}") from None
    if "resources" in table:
        resources = table["resources"]
        if not isinstance(resources, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      and v > 0 for k, v in resources.items()):
            raise SpecError(f"{where}: resources must be a table of positive amounts, e.g. resources = {{ h100 = 1 }}")
        reserved = sorted(set(resources) & set(RESERVED_RESOURCES))
        if reserved:
            raise SpecError(f"{where}: resources cannot name {reserved}: use num_cpus / num_gpus")
        table = {**table, "resources": {k: float(v) for k, v in resources.items()}}
    for key in ("num_cpus", "num_gpus"):
        if key in table and (isinstance(table[key], bool) or not isinstance(table[key], (int, float)) or table[key] < 0):
            raise SpecError(f"{where}: {key} must be a number >= 0")
    if "node" in table and (not isinstance(table["node"], str) or not table["node"]):
        raise SpecError(f"{where}: node must be a node's name, IP or ID")
    if "cpus" in table:
        cpus = table["cpus"]
        if not isinstance(cpus, list) or not cpus or not all(isinstance(c, int) and c >= 0 for c in cpus):
            raise SpecError(f"{where}: cpus must be a non-empty list of CPU indices")
        table = {**table, "cpus": tuple(cpus)}
    try:
        return cls(**table)
    except TypeError as exc:
        raise SpecError(f"{where}: {exc}") from None


def load_spec(path: str | Path | None = None, data: dict | None = None) -> LaunchSpec:
    """Parse a spec file (or, with ``data``, its already-parsed tables; ``path`` names it in errors)."""
    path = Path(path) if path else DEFAULT_SPEC
    if data is None:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SpecError(f"{path}: {exc}") from None
    unknown = set(data) - {"verifier", "drafters", "seed"}
    if unknown:
        raise SpecError(f"{path}: unknown tables or keys {sorted(unknown)}")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise SpecError(f"{path}: seed must be an integer >= 0 (the run's root seed), got {seed!r}")
    verifier = build_table(VerifierSpec, data.get("verifier", {}), f"{path} [verifier]")
    drafters = tuple(build_table(DrafterSpec, d, f"{path} [[drafters]] #{i}") for i, d in enumerate(data.get("drafters", [])))
    spec = LaunchSpec(verifier, drafters, seed)
    _validate(spec, path)
    return spec


def _validate(spec: LaunchSpec, path: Path) -> None:
    if not spec.drafters:
        raise SpecError(f"{path}: no [[drafters]]")
    names = [d.name for d in spec.expanded_drafters()]
    if len(set(names)) != len(names):
        raise SpecError(f"{path}: drafter names must be unique, got {names}")
    if "verifier" in names:
        raise SpecError(f"{path}: 'verifier' is the verifier's name (its log is verifier.log); name the drafter otherwise")
    for d in spec.drafters:
        if d.count < 1 or d.max_new_tokens < 1:
            raise SpecError(f"drafter {d.name!r}: count and max_new_tokens must be >= 1")
        d.prompt_path()
    if spec.verifier.budget < 0:
        raise SpecError("[verifier] budget must be >= 0")
