"""The ``goodspeed`` command. argparse lives here only; each subcommand is a small function."""

from __future__ import annotations

import argparse
import json
import sys


def _models_build(args: argparse.Namespace) -> int:
    from goodspeed.lm.demo import build_demo

    build_demo(force=args.force, progress=not args.quiet)
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from goodspeed.lm.demo import demo_dir, list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    if not models:
        print(f"no demo models in {demo_dir()}; run `goodspeed models build-demo`")
        return 1
    print(f"{'name':<22} {'role':<7} {'params':>9} {'heldout CE':>10} {'accept':>7} {'greedy':>7}  path")
    for m in models:
        acc = f"{m['acceptance']:.3f}" if "acceptance" in m else "-"
        greedy = f"{m['greedy_acceptance']:.3f}" if "greedy_acceptance" in m else "-"
        print(f"{'demo:' + m['name']:<22} {m['role']:<7} {m['params']:>9,} {m['heldout_ce']:>10.3f} {acc:>7} {greedy:>7}  {m['path']}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from goodspeed.launch.demo import DemoConfig, run_demo

    summary = run_demo(DemoConfig(budget=args.budget, policy=args.policy, max_new_tokens=args.max_new_tokens))
    return 0 if summary["lossless"] else 1


def _verifier(args: argparse.Namespace) -> int:
    import asyncio

    from goodspeed.launch.serve import serve
    from goodspeed.launch.spec import VerifierSpec

    return asyncio.run(serve(VerifierSpec(
        target=args.target, host=args.host, port=args.port, budget=args.budget, policy=args.policy, eta=args.eta,
        beta=args.beta, round_deadline_ms=args.round_deadline_ms, max_missed_rounds=args.max_missed_rounds,
        idle_timeout_s=args.idle_timeout_s, max_drafters=args.max_drafters, max_draft_len=args.max_draft_len, metrics_port=args.metrics_port,
        device=args.device, dtype=args.dtype, seed=args.seed,
    )))


def _drafter(args: argparse.Namespace) -> int:
    from goodspeed.launch.draft_node import run_drafter
    from goodspeed.launch.spec import DrafterSpec

    spec = DrafterSpec(
        name=args.name, draft=args.draft, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, device=args.device, dtype=args.dtype, seed=args.seed,
    )
    return run_drafter(spec, args.verifier, args.out, args.connect_timeout_s, progress=not args.quiet)


def _launch(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from goodspeed.launch.local import launch_local
    from goodspeed.launch.spec import load_spec

    spec = load_spec(args.spec)
    models = [spec.verifier.target] + [d.draft for d in spec.drafters]
    if any(m.startswith("demo:") for m in models):
        from goodspeed.lm.demo import build_demo

        build_demo()
    out = Path(args.out or Path("goodspeed-runs") / time.strftime("%Y%m%d-%H%M%S"))
    summary = launch_local(spec, out, live=not args.no_live)
    return 0 if all(r["exit_code"] == 0 for r in summary["drafters"].values()) else 1


def _experiment(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from goodspeed.launch.experiment import SPECS_DIR, load_experiment, run_experiment

    path = args.spec
    if path and not Path(path).exists() and (SPECS_DIR / f"{path}.toml").exists():
        path = SPECS_DIR / f"{path}.toml"  # a shipped experiment by name, e.g. table1-4drafters
    settings, spec = load_experiment(path)
    if any(m.startswith("demo:") for m in [spec.verifier.target] + [d.draft for d in spec.drafters]):
        from goodspeed.lm.demo import build_demo

        build_demo()
    only = tuple(args.policies.split(",")) if args.policies else None
    out = Path(args.out or Path("goodspeed-experiments") / f"{settings.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = run_experiment(settings, spec, out, only=only, force=args.force)
    return 1 if result["failed"] else 0


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"])
    parser.add_argument("--seed", type=int, default=0)


def _add_serving_parsers(sub) -> None:
    ver = sub.add_parser("verifier", help="run the verification daemon (gRPC)")
    ver.add_argument("--target", required=True, help="hub id, directory or demo:<name>")
    ver.add_argument("--host", default="127.0.0.1")
    ver.add_argument("--port", type=int, default=50051)
    ver.add_argument("--budget", type=int, default=16, help="C: drafted tokens per round, all drafters together")
    ver.add_argument("--policy", default="goodspeed", choices=["goodspeed", "fixed", "random"])
    ver.add_argument("--eta", type=float, default=0.2, help="acceptance smoothing (eq. 3)")
    ver.add_argument("--beta", type=float, default=0.5, help="goodput smoothing (eq. 4)")
    ver.add_argument("--round-deadline-ms", type=float, default=250.0, help="close a round this long after its first draft")
    ver.add_argument("--max-missed-rounds", type=int, default=3, help="drop a drafter after this many consecutive misses")
    ver.add_argument("--idle-timeout-s", type=float, default=60.0, help="drop a session with a request in progress that sends nothing this long")
    ver.add_argument("--max-drafters", type=int, default=64)
    ver.add_argument("--max-draft-len", type=int, default=16, help="cap on any one drafter's S_i")
    ver.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics here")
    _add_model_args(ver)
    ver.set_defaults(func=_verifier)
    dr = sub.add_parser("drafter", help="run an edge draft node against a verifier")
    dr.add_argument("--verifier", required=True, help="HOST:PORT")
    dr.add_argument("--draft", required=True, help="hub id, directory or demo:<name>")
    dr.add_argument("--prompts", required=True, help="JSONL with 'prompt' or 'prompt_ids' (and optional 'id') per line, or a shipped set name")
    dr.add_argument("--max-new-tokens", type=int, default=64)
    dr.add_argument("--temperature", type=float, default=0.0)
    dr.add_argument("--top-k", type=int, default=0)
    dr.add_argument("--top-p", type=float, default=1.0)
    dr.add_argument("--out", default=None, help="JSONL results (default: stdout)")
    dr.add_argument("--name", default="drafter")
    dr.add_argument("--connect-timeout-s", type=float, default=60.0)
    dr.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_model_args(dr)
    dr.set_defaults(func=_drafter)
    la = sub.add_parser("launch", help="start a verifier and drafters as local processes from a spec (default: the embedded demo)")
    la.add_argument("spec", nargs="?", default=None, help="SPEC.toml (default: the embedded default spec)")
    la.add_argument("--out", default=None, help="results directory (default: goodspeed-runs/<timestamp>)")
    la.add_argument("--no-live", action="store_true", help="no live table")
    la.set_defaults(func=_launch)
    ex = sub.add_parser("experiment", help="compare draft-length policies on a local cluster and write a report")
    ex.add_argument("spec", nargs="?", default=None, help="SPEC.toml or a shipped name (default, table1-4drafters, table1-8drafters)")
    ex.add_argument("--out", default=None, help="results directory (rerun into the same one to complete a failed policy)")
    ex.add_argument("--policies", default=None, help="comma-separated: run only these (e.g. a policy that failed)")
    ex.add_argument("--force", action="store_true", help="rerun policies that already have data")
    ex.set_defaults(func=_experiment)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="goodspeed", description="Fast, fair, lossless speculative decoding across edge drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    models = sub.add_parser("models", help="the embedded demo models").add_subparsers(dest="models_command", required=True)
    build = models.add_parser("build-demo", help="train the demo tokenizer, target and drafts (~4 min on 2 cores)")
    build.add_argument("--force", action="store_true", help="rebuild even if the cached models are current")
    build.add_argument("--quiet", action="store_true", help="no progress bars")
    build.set_defaults(func=_models_build)
    listing = models.add_parser("list", help="list built demo models with their measured acceptance")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_models_list)
    demo = sub.add_parser("demo", help="run the embedded default in one process (builds the demo models if needed)")
    demo.add_argument("--budget", type=int, default=16, help="tokens per round, C")
    demo.add_argument("--policy", default="goodspeed", choices=["goodspeed", "fixed", "random"])
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.set_defaults(func=_demo)
    _add_serving_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
