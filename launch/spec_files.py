"""Reading spec files: a launch spec (:func:`load_spec`), one daemon's settings from one
(:func:`load_verifier_settings`, :func:`load_drafter_settings`), the verifier's flags from its
declared settings (:func:`add_setting_flags`), and the checks every table passes
(:func:`build_table`). What the keys mean is :mod:`goodspeed.launch.spec`."""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from pathlib import Path

from goodspeed.launch.cluster.links import LinkSpec
from goodspeed.launch.spec import DEFAULT_SPEC, RESERVED_RESOURCES, DrafterSpec, LaunchSpec, SpecError, VerifierSpec
from goodspeed.lm.decoding.params import check_proposal_top_k

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def load_verifier_settings(path: str | Path, spec_class: type | None = None) -> dict:
    """The verifier settings a spec file names (``goodspeed verifier --spec FILE``): its
    ``[verifier]`` table, validated as :class:`VerifierSpec` keys, with the spec's top-level
    ``seed`` where the table sets none. A launch spec works (its ``[[drafters]]`` are not read),
    and so does the file ``goodspeed launch`` writes for its verifier. Only the keys the file
    gives are returned: settings it leaves out keep their defaults (or the flags given).
    ``spec_class``: a :class:`VerifierSpec` subclass declaring more settings."""
    spec_class, path = spec_class or VerifierSpec, Path(path)
    data = _spec_tables(path)
    if "verifier" not in data:
        raise SpecError(f"{path}: no [verifier] table")
    table = dict(data["verifier"])
    if data.get("seed") is not None and table.get("seed") is None:
        table["seed"] = data["seed"]
    spec = build_table(spec_class, table, f"{path} [verifier]")
    placement = sorted(set(table) & set(spec_class.PLACEMENT))
    if placement:  # where a launcher runs the daemon: the daemon itself cannot honour them
        raise SpecError(f"{path} [verifier]: {placement} place the process (goodspeed launch reads them), "
                        "not settings of the daemon")
    return {name: getattr(spec, name) for name in table}


def load_drafter_settings(path: str | Path, name: str | None = None) -> dict:
    """The draft node settings a spec file names (``goodspeed drafter --spec FILE [--name NAME]``):
    its ``[[drafters]]`` entry called ``name`` (the only entry when ``name`` is None), validated as
    :class:`DrafterSpec` keys, with the spec's top-level ``seed`` where the entry sets none. A
    launch spec works (its ``[verifier]`` is not read), and so does the file ``goodspeed launch``
    writes for each drafter. The entry means what it means to ``goodspeed launch``: keys it leaves
    out take :class:`DrafterSpec`'s defaults (not the flags' own). The keys that place or copy
    the process (``count``, ``cpus``, ``link``, ...) are refused: the launcher reads them, a
    draft node cannot honour them."""
    path = Path(path)
    data = _spec_tables(path)
    entries = data.get("drafters")
    if not isinstance(entries, list) or not entries:
        raise SpecError(f"{path}: no [[drafters]] entry")
    names = [entry.get("name") for entry in entries]
    if name is None and len(entries) > 1:
        raise SpecError(f"{path}: {len(entries)} [[drafters]] entries ({names}): pick one with --name")
    matches = [entry for entry in entries if name is None or entry.get("name") == name]
    if len(matches) != 1:
        raise SpecError(f"{path}: {len(matches)} [[drafters]] entries are named {name!r} (names: {names})")
    table = dict(matches[0])
    if data.get("seed") is not None and table.get("seed") is None:
        table["seed"] = data["seed"]
    where = f"{path} [[drafters]] {table.get('name')!r}"
    known = DrafterSpec.node_settings()
    launcher = sorted(set(table) & set(DrafterSpec.LAUNCHER))
    if launcher:
        raise SpecError(f"{where}: {launcher} tell goodspeed launch how to start the process, not settings of the draft node")
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise SpecError(unknown_keys(where, unknown, known))
    defaults = {f.name: f.default for f in fields(DrafterSpec) if f.name in known and f.default is not MISSING}
    return {**defaults, **_typed(DrafterSpec, table, where)}  # name, draft and prompts may come from flags


def add_setting_flags(parser, spec_class=None) -> None:
    """``parser``'s flags for every setting of ``spec_class`` that is one (``flag_settings``;
    default :class:`VerifierSpec`, whose local-serving settings get a group of their own), typed,
    defaulted and documented from the fields' :func:`~goodspeed.launch.spec.setting` lines."""
    import argparse
    import typing

    spec_class = spec_class or VerifierSpec
    hints = typing.get_type_hints(spec_class)
    local_names = set(spec_class.local_settings())
    local = parser.add_argument_group("local serving (Generate RPC)") if local_names else parser
    names = set(spec_class.flag_settings())
    for f in fields(spec_class):
        if f.name not in names:
            continue
        if "flag" not in f.metadata:
            raise TypeError(f"{spec_class.__name__}.{f.name}: declare flag settings with setting(...), not a bare default")
        kind = hints[f.name]
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        kind = args[0] if args else kind
        options = {"default": f.default, "help": f.metadata.get("help") or None, **f.metadata["flag"]}
        if options.get("required") or options["default"] is MISSING:
            options.pop("default")
        if kind is bool:  # --x / --no-x: either way, over the default or over --spec's file
            options.update(action=argparse.BooleanOptionalAction)
        elif kind is not str:
            options.update(type=kind)
        (local if f.name in local_names else parser).add_argument("--" + f.name.replace("_", "-"), **options)


def unknown_keys(where: str, unknown, known) -> str:
    """The error for keys a table does not take, with the closest known key to each typo.

    >>> unknown_keys("[verifier]", ["budgte"], ["budget", "beta", "policy"])
    "[verifier]: unknown keys ['budgte'] (did you mean 'budget'?); known: ['beta', 'budget', 'policy']"
    """
    import difflib

    guesses = [g[0] for key in sorted(unknown) if (g := difflib.get_close_matches(key, known, n=1))]
    hint = f" (did you mean {', '.join(repr(g) for g in guesses)}?)" if guesses else ""
    return f"{where}: unknown keys {sorted(unknown)}{hint}; known: {sorted(known)}"


def build_table(cls, table: dict, where: str):
    """A frozen dataclass from a TOML table; unknown keys and wrong types raise :class:`SpecError`."""
    known = {f.name for f in fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise SpecError(unknown_keys(where, unknown, known))
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
    table = _typed(cls, table, where)
    try:
        return cls(**table)
    except TypeError as exc:
        raise SpecError(f"{where}: {exc}") from None


def _typed(cls, table: dict, where: str) -> dict:
    """``table`` with each scalar setting checked against its field's type (an int where a float
    is declared becomes that float); a value of another type raises :class:`SpecError`."""
    import typing

    hints, out = typing.get_type_hints(cls), dict(table)
    for key, value in table.items():
        kinds = [k for k in (typing.get_args(hints[key]) or (hints[key],)) if k is not type(None)]
        if len(kinds) != 1 or kinds[0] not in (bool, int, float, str):
            continue  # tables and lists are checked above
        kind = kinds[0]
        if value is None and len(typing.get_args(hints[key])) > 1:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            out[key] = float(value)
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise SpecError(f"{where}: {key} must be {'a ' + kind.__name__ if kind is not int else 'an int'}, got {value!r}")
    return out


def _spec_tables(path: Path, data: dict | None = None) -> dict:
    """A spec file's top-level tables (``data``: already parsed), its keys and root seed checked."""
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
    return data


def load_spec(path: str | Path | None = None, data: dict | None = None) -> LaunchSpec:
    """Parse a spec file (or, with ``data``, its already-parsed tables; ``path`` names it in errors)."""
    path = Path(path) if path else DEFAULT_SPEC
    data = _spec_tables(path, data)
    seed = data.get("seed")
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
    from goodspeed.lm.decoding.params import SamplingParams
    from goodspeed.verifier.fields import MAX_NAME_CHARS, PLAIN, is_plain_name

    for name in names:  # what the verifier would refuse at Join, refused before any process starts
        if not is_plain_name(name):
            raise SpecError(f"{path}: drafter name {name!r} must be 1-{MAX_NAME_CHARS} {PLAIN}")
    for d in spec.drafters:
        try:
            SamplingParams(d.temperature, d.top_k, d.top_p)
        except ValueError as exc:
            raise SpecError(f"drafter {d.name!r}: {exc}") from None
        if d.count < 1 or d.max_new_tokens < 1 or d.concurrency < 1:
            raise SpecError(f"drafter {d.name!r}: count, max_new_tokens and concurrency must be >= 1")
        if d.concurrency > 1 and d.proactive:
            raise SpecError(f"drafter {d.name!r}: proactive drafting is per request, one at a time; with concurrency > 1 "
                            "the node drafts its requests together instead: set proactive = false")
        try:
            check_proposal_top_k(d.proposal_top_k)
        except ValueError as exc:
            raise SpecError(f"drafter {d.name!r}: {exc}") from None
        if (problem := d.setting_problem()) is not None:
            raise SpecError(f"drafter {d.name!r}: {problem[0]} {problem[1]}")
        d.prompt_path()
    if spec.verifier.budget < 0:
        raise SpecError("[verifier] budget must be >= 0")
