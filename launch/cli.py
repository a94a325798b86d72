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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
