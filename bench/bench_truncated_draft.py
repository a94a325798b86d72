"""Would a draft made of the target's own first layers pay on the real pair? Its held-out greedy
acceptance against the large recipe's draft, before any of it becomes a recipe (*Drafts that
learn*, docs/BENCHMARKS.md).

    python -m bench.bench_truncated_draft [--work DIR] [--layers 4] [--steps 1500] [--peak 1.5e-3]
                                          [--json PATH]

The draft is the target's embedding, its first ``--layers`` decoder layers, its final RMSNorm and
its tied LM head restricted to the large recipe's 8,193-token pruned head: a self-speculative
draft in the manner of early exit (LayerSkip, Elhoushi et al., ACL 2024, arXiv 2404.16710; Draft &
Verify, Zhang et al., ACL 2024, arXiv 2309.08168), starting from the target's pretrained weights
rather than from scratch as the recipes' drafts do. The layers and the norm are then distilled
(``--steps`` steps, batch 16 x 128, AdamW at ``--peak`` with 30 warm-up steps and a cosine decay;
the embedding and head stay the target's) on the cross-entropy of the draft's distribution
against the target's, both over the pruned head, on the training transcripts and standard-library
text of :mod:`bench.bench_feature_head` and the target's features over them (its stages 1-2,
reused from ``--work`` or made there).

Measured on that harness's held-out groups (chat, the recipe's tasks, code) against the float32
target: the greedy agreement of the first draft token at every generated position (the figure
``goodspeed models list`` reports for a draft), for this draft and for the large recipe's
(``real:smollm2-135m-draft-large``, which must be built); and one draft step of each (one token
without a cache, one thread, bf16, median of 200): what a drafted token costs. Nothing here is
served.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.bench_feature_head import (SEQ, _evaluate, _ModelDrafts, _step_ms, log, prepare_stages, report_header, set_lr, stage_arguments,
                                      windows, write_json)
from goodspeed.lm.models.draft_head import apply_head_file, prune_head

WARMUP = 30


def truncated_target(target, layers: int):
    """A causal LM of ``target``'s config with its first ``layers`` decoder layers, its embedding,
    final norm and (tied) head, the weights copied: ``layers`` of early exit, before training."""
    from transformers import LlamaForCausalLM

    if not 1 <= layers < target.config.num_hidden_layers:
        raise ValueError(f"--layers must lie in [1, {target.config.num_hidden_layers}); got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    draft = LlamaForCausalLM(config).to(target.dtype)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"the truncated target does not fit: missing {missing}, unexpected {unexpected}")
    draft.tie_weights()
    return draft


def _trained(name: str) -> bool:
    """Whether the draft's parameter ``name`` is distilled: its layers and norm, not the target's
    embedding and (tied) head."""
    return not name.startswith(("model.embed_tokens", "lm_head"))


def _train(draft, keep: torch.Tensor, head_rows: torch.Tensor, seqs, feats, steps: int, peak: float) -> list[dict]:
    for name, p in draft.named_parameters():
        p.requires_grad = _trained(name)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak, weight_decay=0.0)
    curve, started = [], time.perf_counter()
    batches = windows(seqs, feats, SEQ)
    draft.train()
    for step in tqdm(range(steps), desc="truncated draft", unit="step", mininterval=0.1 if sys.stderr.isatty() else 10.0):
        set_lr(opt, peak, step, steps, WARMUP)
        x, f = next(batches)
        f = f.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = draft.model(input_ids=x).last_hidden_state
        log_q = torch.log_softmax(hidden.float() @ head_rows.T, -1)
        with torch.no_grad():
            p = torch.softmax(f @ head_rows.T, -1)
        loss = -(p * log_q).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            curve.append({"step": step, "ce": round(loss.item(), 3),
                          "train_agreement": round((log_q.argmax(-1) == p.argmax(-1)).float().mean().item(), 3),
                          "seconds": round(time.perf_counter() - started, 1)})
    draft.eval()
    return curve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a draft of the target's first layers: its held-out acceptance on the real pair")
    stage_arguments(parser)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--peak", type=float, default=1.5e-3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    work, target_dir, large_dir, keep, _, seqs, feats = prepare_stages(parser, args, log)
    target32 = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    report = {**report_header("bench.bench_truncated_draft", argv, seqs), "layers": args.layers, "steps": args.steps, "peak": args.peak}
    draft = truncated_target(target32, args.layers)
    path = work / f"truncated-{args.layers}-{args.corpus_tokens}-{args.steps}-{args.peak:g}.pt"
    if path.exists():
        saved = torch.load(path)
        draft.load_state_dict(saved["state"])
        report["curve"] = saved["curve"]
    else:
        report["curve"] = _train(draft, keep, target32.lm_head.weight.detach()[keep].float(), seqs, feats, args.steps, args.peak)
        torch.save({"state": draft.state_dict(), "curve": report["curve"]}, path)
    del feats
    log(f"trained: {report['curve'][-1]}")
    prune_head(draft, keep)
    report["parameters"] = {"trained": sum(p.numel() for n, p in draft.named_parameters() if _trained(n)),
                            "total": sum(p.numel() for p in draft.parameters())}
    large = LlamaForCausalLM.from_pretrained(large_dir, dtype=torch.float32).eval()
    apply_head_file(large, large_dir)
    report["eval"] = {"truncated": _evaluate(work, target32, _ModelDrafts(draft), "truncated", chains=False),
                      "draft-large": _evaluate(work, target32, _ModelDrafts(large), "draft-large", chains=False)}
    log(f"first-token greedy agreement: {report['eval']}")
    torch.set_num_threads(1)
    token = torch.tensor([[42]])
    draft16, large16 = draft.to(torch.bfloat16), large.to(torch.bfloat16)
    with torch.inference_mode():
        report["step_ms"] = {"truncated": _step_ms(lambda: draft16(input_ids=token).logits),
                             "draft-large": _step_ms(lambda: large16(input_ids=token).logits)}
    log(f"one draft step (ms, one thread, bf16, no cache): {report['step_ms']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
