"""What each ``goodspeed`` subcommand does, given its parsed flags (:mod:`goodspeed.launch.cli`
declares the flags). The daemons' own commands, ``verifier`` and ``drafter``, live with their
flags in the CLI module; each function here returns the process's exit status."""

from __future__ import annotations

import argparse
import json
import sys

from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.records import ROUND_MODES


def input_problem(args: argparse.Namespace) -> str | None:
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


def bad_input(command: str, args: argparse.Namespace) -> int:
    """2 after saying what :func:`input_problem` finds, else 0."""
    if (problem := input_problem(args)) is None:
        return 0
    print(f"goodspeed {command}: error: {problem}", file=sys.stderr)
    return 2


def models_build(args: argparse.Namespace) -> int:
    from goodspeed.lm.models.demo import build_demo

    build_demo(force=args.force, progress=not args.quiet)
    return 0


def models_get(args: argparse.Namespace) -> int:
    from goodspeed.lm.models.demo import build_demo
    from goodspeed.lm.models.model_dirs import ModelLoadError
    from goodspeed.lm.models.real import get_real

    log = (lambda *a, **k: None) if args.quiet else print
    for name in args.names:  # errors (unknown name, pip, digest) are ModelLoadErrors: main() reports them
        if name == "demo":
            if args.recipe != "default":
                raise ModelLoadError("--recipe chooses a real model's draft recipe; the demo models have one recipe")
            build_demo(force=args.force, progress=not args.quiet, log=log)
        else:
            get_real(name, force_draft=args.force, progress=not args.quiet, log=log, recipe=args.recipe)
    return 0


def _fmt(m: dict, key: str) -> str:
    return f"{m[key]:.3f}" if key in m else "-"


def models_list(args: argparse.Namespace) -> int:
    from goodspeed.lm.models.demo import demo_dir, list_models
    from goodspeed.lm.models.real import list_real, real_root

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
    print(f"{'model':<30} {'role':<11} {'params':>11} {'greedy':>7} {'T=0.8':>7} {'T=1':>7} {'chat greedy':>11}  path")
    for m in models:
        print(f"{m['spec']:<30} {m['role']:<11} {m['params']:>11,} {_fmt(m, 'greedy_acceptance'):>7} {_fmt(m, 'acceptance_t08'):>7} "
              f"{_fmt(m, 'acceptance'):>7} {_fmt(m, 'chat_greedy_acceptance'):>11}  {m['path']}")
    return 0


def tokens_add(args: argparse.Namespace) -> int:
    from goodspeed.verifier.auth import add_token

    token = add_token(args.file, args.name, args.max_sessions, max_streams=args.max_streams, max_kv_tokens=args.max_kv_tokens,
                      rate_per_s=args.rate_per_s)
    print(token)
    print(f"token for {args.name!r} added to {args.file} (only its hash is stored: keep this one safe, "
          "e.g. in a file given to --token-file)", file=sys.stderr)
    return 0


def certs_init(args: argparse.Namespace) -> int:
    from goodspeed.launch.cluster.certs import init_certs

    issued = init_certs(args.dir, names=tuple(n for n in args.names.split(",") if n),
                        hosts=tuple(h for h in args.hosts.split(",") if h), days=args.days)
    for role, files in issued.items():
        print(f"{role:<10} {files.cert}  {files.key}")
    print("verifier: --tls-cert server.pem --tls-key server.key --tls-client-ca ca.pem; "
          "each client: --tls-ca ca.pem --tls-cert NAME.pem --tls-key NAME.key", file=sys.stderr)
    return 0


def demo(args: argparse.Namespace) -> int:
    from goodspeed.launch.demo import DemoConfig, run_demo

    summary = run_demo(DemoConfig(budget=args.budget, policy=args.policy, max_new_tokens=args.max_new_tokens))
    return 0 if summary["lossless"] else 1


def _structure_arg(args: argparse.Namespace):
    """``goodspeed generate``'s structured output flag as a constraint (the verifier compiles it)."""
    import json
    from pathlib import Path

    from goodspeed.lm.decoding.structured import Structure

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


def generate(args: argparse.Namespace) -> int:
    from goodspeed.drafter.credentials import read_token
    from goodspeed.launch.generate import generate_request, run_generate

    if bad := bad_input("generate", args):
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
        from goodspeed.lm.models.tokenizers import resolve_model_path

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
    return run_generate(args.verifier, request, args.json, args.timeout_s, token=read_token(args.token_file), tls=client_tls(args))


def profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from goodspeed.lm.models.loading import load_causal_lm
    from goodspeed.verifier.clocks import LatencyProfile
    from goodspeed.verifier.profiling import baseline_tpot_s, fit_error, profile_model

    if args.cuda_graphs and not args.device.startswith("cuda"):
        print(f"goodspeed profile: --cuda-graphs needs a CUDA device, not {args.device}", file=sys.stderr)
        return 2
    ensure_models([args.target, args.draft])
    result = {"device": args.device, "dtype": args.dtype, "cuda_graphs": args.cuda_graphs, "torch_compile": args.torch_compile}
    fitted = {}
    for role, spec in (("target", args.target), ("draft", args.draft)):
        model = load_causal_lm(spec, dtype=args.dtype, device=args.device).model
        result[f"{role}_dtype"] = str(model.dtype).removeprefix("torch.")  # auto resolved for this model
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


def loadgen(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from goodspeed.drafter.credentials import read_token
    from goodspeed.launch.experiments.loadgen import make_trace, run_trace_grpc, summarize
    from goodspeed.launch.spec import prompt_set_path

    if bad := bad_input("loadgen", args):
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
                                             tls=client_tls(args)))
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
    from goodspeed.lm.models.tokenizers import resolve_model_path

    ensure_models([tokenizer_spec])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer_spec))
    return [p.prompt_ids for p in load_prompts(path, tokenizer)]


def spec_models(spec) -> list[str]:
    """Every model a launch spec's processes load: the target, the local draft's, the drafts'
    and the tokenizers of drafters without one."""
    from goodspeed.lm.decoding.draft_source import DraftSpec

    sources = [spec.verifier.local_draft] * bool(spec.verifier.local_draft) + [d.draft for d in spec.drafters]
    models = [DraftSpec.parse(name).model for name in sources]
    return [spec.verifier.target] + [m for m in models if m] + [d.tokenizer for d in spec.drafters if d.tokenizer]


def ensure_models(models: list[str]) -> None:
    from goodspeed.lm.models.loading import ensure_models

    ensure_models(models)


def launch(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from goodspeed.launch.cluster.local import launch_local, local_plan
    from goodspeed.launch.spec import spec_path
    from goodspeed.launch.spec_files import load_spec

    spec = load_spec(spec_path(args.spec))
    out = Path(args.out or Path("goodspeed-runs") / time.strftime("%Y%m%d-%H%M%S"))
    if args.backend == "ray":
        from goodspeed.launch.cluster.ray_cluster import launch_ray

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
        ensure_models(spec_models(spec))
        summary = launch_local(spec, out, live=not args.no_live)
    if args.dry_run:
        return 0
    return 0 if all(r["exit_code"] == 0 for r in summary["drafters"].values()) else 1


def experiment(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from dataclasses import replace

    from goodspeed.launch.experiments.experiment import check_policies, load_experiment, run_experiment
    from goodspeed.launch.spec import SpecError, spec_path

    settings, spec = load_experiment(spec_path(args.spec))  # a file or a shipped name, e.g. table1-4drafters
    if args.seed is not None:
        settings = replace(settings, seed=args.seed)
    only = tuple(args.policies.split(",")) if args.policies else None
    if only:
        check_policies(only, "--policies")
    ensure_models(spec_models(spec))
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


def simulate(args: argparse.Namespace) -> int:
    import json
    import time
    from pathlib import Path

    from goodspeed.launch.experiments.experiment import load_experiment
    from goodspeed.launch.experiments.sim_profiles import SimulationError, load_profile, parse_range, profile_path
    from goodspeed.launch.experiments.simulate import run_simulation
    from goodspeed.launch.spec import spec_path

    spec_file = spec_path(args.spec)
    settings, spec = load_experiment(spec_file)
    profile = load_profile(profile_path(args.profile, settings.name))
    if args.save_profile:
        Path(args.save_profile).write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")
        print(f"profile: {args.save_profile}")
    out = Path(args.out or Path("goodspeed-simulations") / f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.capacity is not None:
        return simulate_capacity(args, settings, spec, profile, out)
    if args.tpot_slo_ms is not None:
        raise SimulationError("--tpot-slo-ms goes with --capacity")
    run_simulation(spec_file, profile, out, drafters=args.drafters, seeds=args.seeds, rounds=args.rounds,
                   policies=tuple(args.policies.split(",")) if args.policies else None, spread=args.spread,
                   rtt_ms=parse_range(args.rtt_ms), validate=[Path(v) for v in args.validate])
    return 0


def simulate_capacity(args: argparse.Namespace, exp, spec, profile, out) -> int:
    """``goodspeed simulate --capacity``: the spec's verifier settings (C per drafter, the longest
    draft, eta) and its drafters' median ``max_new_tokens``; every profiled drafter drawn round robin."""
    import json
    import statistics

    from goodspeed.launch.experiments.sim_capacity import capacity_at_slo, capacity_cells, capacity_markdown, capacity_ratio
    from goodspeed.launch.experiments.sim_profiles import SimulationError, parse_range
    from goodspeed.scheduler import smoothing_of

    if args.tpot_slo_ms is None or not args.tpot_slo_ms > 0:
        raise SimulationError("--capacity needs --tpot-slo-ms, a positive number of milliseconds")
    if args.drafters is not None or args.validate:
        raise SimulationError("--capacity gives the numbers of drafters itself and validates against nothing: "
                              "drop --drafters and --validate")
    clients = list(_int_list("--capacity", args.capacity, 1, "a number of drafters"))
    policy = args.policies.split(",")[0] if args.policies else "goodspeed"
    drafters = spec.expanded_drafters()
    max_new_tokens = int(statistics.median(d.max_new_tokens for d in drafters))
    rounds = args.rounds or max(exp.rounds, 400)
    cells = capacity_cells(profile, clients, args.tpot_slo_ms / 1000.0, policy=policy,
                           budget_per_drafter=spec.verifier.budget / len(drafters), max_draft_len=spec.verifier.max_draft_len,
                           max_new_tokens=max_new_tokens, rounds=rounds, seed=0, spread=args.spread,
                           rtt_ms=parse_range(args.rtt_ms), smoothing=smoothing_of(policy, spec.verifier.eta, spec.verifier.beta),
                           progress=True)
    capacity = capacity_at_slo(cells)
    title = (f"{exp.name}, policy {policy}, {rounds} rounds, {max_new_tokens} tokens a request, RTT {args.rtt_ms} ms, "
             f"profile {profile.source or args.profile}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps({"title": title, "tpot_slo_ms": args.tpot_slo_ms, "policy": policy,
                                                   "rounds": rounds, "max_new_tokens": max_new_tokens, "rtt_ms": args.rtt_ms,
                                                   "spread": args.spread, "profile": profile.to_dict(), "cells": cells,
                                                   "capacity_at_slo": capacity, "ratio": capacity_ratio(capacity)}, indent=2))
    report = capacity_markdown(title, cells, args.tpot_slo_ms, capacity)
    (out / "CAPACITY.md").write_text(report)
    print(report)
    print(f"report: {out / 'CAPACITY.md'}")
    return 0


def compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from goodspeed.launch.experiments.compare import compare_runs

    out = Path(args.out)
    summary = compare_runs([Path(d) for d in args.runs], out)
    for policy, t in summary["policies"].items():
        rate = (f", U(tok/s) {t['utility_per_s_mean']:.3f} ± {t['utility_per_s_sd']:.3f}" if "utility_per_s" in t
                else ", U(tok/s) not in every run's report")
        print(f"{policy}: U {t['utility_mean']:.3f} ± {t['utility_sd']:.3f}{rate} over {len(t['utility'])} runs")
    print(f"report: {out / 'COMPARISON.md'}")
    return 0


def client_tls(args: argparse.Namespace):
    from goodspeed.drafter.credentials import client_tls

    return client_tls(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
