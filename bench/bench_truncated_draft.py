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
import json
import math
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.bench_feature_head import BATCH, SEQ, _features, _load_group, _step_ms, _transcripts
from goodspeed.lm.models.draft_head import HEAD_FILE, apply_head_file, prune_head
from goodspeed.lm.models.real import real_model_path

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


def _train(draft, keep: torch.Tensor, head_rows: torch.Tensor, seqs, feats, steps: int, peak: float) -> list[dict]:
    for name, p in draft.named_parameters():
        p.requires_grad = not name.startswith(("model.embed_tokens", "lm_head"))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=peak, weight_decay=0.0)
    lengths = np.array([len(s) for s in seqs])
    usable = np.where(lengths > SEQ + 2)[0]
    weights = lengths[usable] / lengths[usable].sum()
    rng = np.random.default_rng(0)
    curve, started = [], time.perf_counter()
    draft.train()
    for step in tqdm(range(steps), desc="truncated draft", unit="step", mininterval=0.1 if sys.stderr.isatty() else 10.0):
        for group in opt.param_groups:
            group["lr"] = peak * min(1.0, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * step / steps))
        xs, fs = [], []
        for r in rng.choice(usable, BATCH, p=weights):
            s = int(rng.integers(0, lengths[r] - SEQ - 1))
            xs.append(torch.from_numpy(seqs[r][s : s + SEQ]))
            fs.append(feats[r][s : s + SEQ])
        x, f = torch.stack(xs), torch.stack(fs).float()
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


@torch.inference_mode()
def _first_token(work: Path, target32, draft, label: str) -> dict:
    """Per held-out group: the share of generated positions where the draft's greedy token is the
    target's."""
    out = {}
    for name in ("chat", "tasks", "code"):
        starts, transcripts = _load_group(work, name)
        agree = total = 0
        for start, ids in tqdm(list(zip(starts, transcripts)), desc=f"{label}: {name}", unit="transcript",
                               mininterval=0.1 if sys.stderr.isatty() else 10.0):
            x = torch.from_numpy(ids)[None]
            greedy = target32(input_ids=x).logits[0].argmax(-1)
            first = draft(input_ids=x).logits[0].argmax(-1)
            hit = first[start - 1 : ids.size - 1] == greedy[start - 1 : ids.size - 1]
            agree, total = agree + int(hit.sum()), total + hit.numel()
        out[name] = {"first_token_greedy": round(agree / total, 4), "positions": total}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a draft of the target's first layers: its held-out acceptance on the real pair")
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "goodspeed" / "bench" / "feature-head",
                        help="bench_feature_head's work folder (its transcripts and features are reused)")
    parser.add_argument("--extra-chat", type=int, default=480, help="as bench_feature_head's: which of its work folders")
    parser.add_argument("--corpus-tokens", type=int, default=300_000, help="as bench_feature_head's")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--peak", type=float, default=1.5e-3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(2)
    target_dir, large_dir = real_model_path("smollm2-135m"), real_model_path("smollm2-135m-draft-large")
    if not (large_dir / HEAD_FILE).exists():
        parser.error("the draft's vocabulary is the large recipe's pruned head: run `goodspeed models get smollm2-135m --recipe large` first")
    work = args.work / f"extra{args.extra_chat}"
    work.mkdir(parents=True, exist_ok=True)
    log = lambda message: print(message, flush=True)  # noqa: E731
    keep = torch.tensor(json.loads((large_dir / HEAD_FILE).read_text())["tokens"])
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    _transcripts(work, target, tokenizer, args.extra_chat, log)
    seqs, feats = _features(work, target, tokenizer, args.corpus_tokens, log)
    target32 = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    report: dict = {"command": " ".join(["python -m bench.bench_truncated_draft", *(argv if argv is not None else sys.argv[1:])]),
                    "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.processor() or platform.machine(),
                    "layers": args.layers, "steps": args.steps, "peak": args.peak, "train_tokens": int(sum(len(s) for s in seqs))}
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
    report["parameters"] = {"trained": sum(p.numel() for n, p in draft.named_parameters() if not n.startswith(("model.embed_tokens", "lm_head"))),
                            "total": sum(p.numel() for p in draft.parameters())}
    large = LlamaForCausalLM.from_pretrained(large_dir, dtype=torch.float32).eval()
    apply_head_file(large, large_dir)
    report["eval"] = {"truncated": _first_token(work, target32, draft, "truncated"),
                      "draft-large": _first_token(work, target32, large, "draft-large")}
    log(f"first-token greedy agreement: {report['eval']}")
    torch.set_num_threads(1)
    token = torch.tensor([[42]])
    draft16, large16 = draft.to(torch.bfloat16), large.to(torch.bfloat16)
    with torch.inference_mode():
        report["step_ms"] = {"truncated": _step_ms(lambda: draft16(input_ids=token).logits),
                             "draft-large": _step_ms(lambda: large16(input_ids=token).logits)}
    log(f"one draft step (ms, one thread, bf16, no cache): {report['step_ms']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
