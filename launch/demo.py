"""``goodspeed demo``: the embedded default, in one process.

Builds the demo models if they are missing, then serves four drafters — each with a different
demo draft and its own prompts cut from held-out stdlib source — through one verification
engine under GoodSpeed's allocation, and prints per-drafter results. Greedy outputs are checked
against the target's own greedy decoding of the same prompts, so the run also proves losslessness.
"""

from __future__ import annotations

from dataclasses import dataclass

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.lm.models.corpus import load_corpus, prompt_snippets
from goodspeed.lm.models.demo import build_demo
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.verifier.engine import EngineConfig, VerificationEngine

DRAFTS = ("draft-distilled", "draft-small", "draft-tiny", "draft-distilled")


@dataclass(frozen=True)
class DemoConfig:
    budget: int = 16
    policy: str = "goodspeed"
    prompts_per_drafter: int = 3
    max_new_tokens: int = 48


def _greedy_reference(model, prompt: list[int], max_new: int) -> list[int]:
    engine = VerificationEngine(model, EngineConfig(budget=0, policy="fixed"))
    d = InProcessDrafter("reference", DraftRunner(model), [prompt], max_new_tokens=max_new)
    run_inprocess(engine, [d])
    return d.outputs[0]


def run_demo(config: DemoConfig = DemoConfig(), log=print) -> dict:
    build_demo(log=log)
    target = load_causal_lm("demo:target")
    snippets = prompt_snippets(load_corpus().heldout_text, len(DRAFTS) * config.prompts_per_drafter, 160, seed=7)
    prompts = [target.tokenizer(s)["input_ids"] for s in snippets]
    engine = VerificationEngine(target.model, EngineConfig(budget=config.budget, policy=config.policy), target.fingerprint)
    drafters = []
    for i, name in enumerate(DRAFTS):
        draft = load_causal_lm(f"demo:{name}")
        own = prompts[i * config.prompts_per_drafter : (i + 1) * config.prompts_per_drafter]
        drafters.append(InProcessDrafter(f"edge{i}-{name}", DraftRunner(draft.model), own, SamplingParams(), config.max_new_tokens, seed=i))
    log(f"serving {len(drafters)} drafters, budget C={config.budget}, policy {config.policy}")
    results = run_inprocess(engine, drafters)
    summary = _summarise(engine, drafters, results)
    lossless = all(out == _greedy_reference(target.model, p, config.max_new_tokens) for d in drafters for p, out in zip(d.prompts, d.outputs))
    summary["lossless"] = lossless
    _print(summary, log)
    return summary


def _summarise(engine, drafters, results) -> dict:
    rows = {}
    for d in drafters:
        verdicts = [r.verdicts[v] for r in results for v in r.verdicts if v.startswith(d.name + "#")]
        drafted = sum(v.num_drafted for v in verdicts)
        accepted = sum(v.num_accepted for v in verdicts)
        rows[d.name] = {
            "rounds": len(verdicts),
            "tokens": sum(len(o) for o in d.outputs),
            "mean_draft_len": drafted / max(1, len(verdicts)),
            "acceptance": accepted / drafted if drafted else 0.0,
            "alpha_hat": verdicts[-1].acceptance,
            "goodput_X": verdicts[-1].goodput,
        }
    verifier_s = sum(r.timings.total_s for r in results)
    return {"drafters": rows, "rounds": len(results), "verifier_s": verifier_s}


def _print(summary: dict, log) -> None:
    log(f"{'drafter':<24} {'rounds':>6} {'tokens':>6} {'mean S':>6} {'accept':>6} {'alpha_hat':>9} {'X':>6}")
    for name, r in summary["drafters"].items():
        log(f"{name:<24} {r['rounds']:>6} {r['tokens']:>6} {r['mean_draft_len']:>6.2f} {r['acceptance']:>6.3f} {r['alpha_hat']:>9.3f} {r['goodput_X']:>6.2f}")
    log(f"{summary['rounds']} rounds, {summary['verifier_s']:.2f} s of verifier time; "
        f"outputs equal the target's own greedy decoding: {'yes' if summary['lossless'] else 'NO'}")

