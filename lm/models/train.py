"""Training, distilling and evaluating the small Llama models of the demo.

Everything is fixed by seeds and step counts (never wall time), so a build is reproducible on the
same corpus. Distillation trains the draft on the target's next-token distributions (forward KL),
which is what raises speculative acceptance (AdaServe section 4.2 cites distilled drafts).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM


@dataclass(frozen=True)
class ModelRecipe:
    name: str
    role: str  # "target" or "draft"
    layers: int
    hidden: int
    steps: int
    seed: int
    distill: bool = False
    lr: float = 3e-3
    batch: int = 16
    seq_len: int = 128
    heads: int = 4
    kv_heads: int = 2


def intermediate_size(hidden: int) -> int:
    """The SwiGLU width Llama uses for ``hidden``: 8/3 of it, rounded up to a multiple of 64."""
    return int(hidden * 8 / 3 + 63) // 64 * 64


def llama_config(recipe: ModelRecipe, vocab_size: int, eos_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden,
        intermediate_size=intermediate_size(recipe.hidden),
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )


def _batches(ids: np.ndarray, recipe: ModelRecipe, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, ids.size - recipe.seq_len - 1, recipe.batch)
    return torch.from_numpy(np.stack([ids[s : s + recipe.seq_len] for s in starts]).astype(np.int64))


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of ``peak``."""
    warmup = max(1, total // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimize(model: torch.nn.Module, steps: int, peak_lr: float, loss_fn, desc: str, progress: bool = True,
             weight_decay: float = 0.0, checkpoint: Path | None = None, every: int = 100,
             rng: np.random.Generator | None = None) -> torch.nn.Module:
    """``steps`` AdamW steps on ``loss_fn()`` (which draws its own batch) with :func:`lr_at`'s
    schedule and gradient clipping at 1; returns the model in eval mode.

    With ``checkpoint``, the model, the optimiser, the step and ``rng``'s state (the generator
    ``loss_fn`` draws its batches from) are saved there every ``every`` steps and at the end, and
    a run that finds the file resumes from it: an interrupted run, resumed, ends with the weights
    an uninterrupted one would have (same machine, same threads)."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=weight_decay)
    start = 0
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=next(model.parameters()).device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
        if rng is not None:
            rng.bit_generator.state = state["rng"]
    # On a terminal the bar redraws in place; in logs (CI, pipes) a line every 10 s is enough.
    interval = 0.1 if sys.stderr.isatty() else 10.0
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=desc, disable=not progress, unit="step", mininterval=interval)
    model.train()
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr)
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
        if checkpoint is not None and ((step + 1) % every == 0 or step + 1 == steps):
            save_atomically({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                             "rng": rng.bit_generator.state if rng is not None else None}, checkpoint)
    return model.eval()


def save_atomically(obj, path: Path) -> None:
    """``torch.save`` to ``path`` through a temporary file and a rename: a kill mid-write leaves the
    previous file (or none), never a torn one."""
    staging = path.with_name(path.name + ".partial")
    torch.save(obj, staging)
    staging.replace(path)


def train_model(
    recipe: ModelRecipe, ids: np.ndarray, vocab_size: int, eos_id: int, teacher: torch.nn.Module | None = None, progress: bool = True
) -> LlamaForCausalLM:
    """Train from scratch on ``ids`` (cross-entropy), or distil from ``teacher`` (forward KL)."""
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(llama_config(recipe, vocab_size, eos_id))
    rng = np.random.default_rng(recipe.seed)

    def loss_fn():
        x = _batches(ids, recipe, rng)
        logits = model(input_ids=x).logits[:, :-1]
        if teacher is not None:
            with torch.no_grad():
                target_logp = F.log_softmax(teacher(input_ids=x).logits[:, :-1], dim=-1)
            return F.kl_div(F.log_softmax(logits, dim=-1), target_logp, log_target=True, reduction="batchmean") / x.shape[1]
        return F.cross_entropy(logits.reshape(-1, vocab_size), x[:, 1:].reshape(-1))

    return optimize(model, recipe.steps, recipe.lr, loss_fn, f"train {recipe.name}", progress, weight_decay=0.01)


def _eval_windows(ids: np.ndarray, seq_len: int, num: int) -> torch.Tensor:
    starts = np.linspace(0, ids.size - seq_len - 1, num).astype(np.int64)
    return torch.from_numpy(np.stack([ids[s : s + seq_len] for s in starts]).astype(np.int64))


@torch.inference_mode()
def heldout_cross_entropy(model: torch.nn.Module, ids: np.ndarray, seq_len: int = 128, num: int = 32) -> float:
    x = _eval_windows(ids, seq_len, num)
    logits = model(input_ids=x).logits[:, :-1]
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)))


@torch.inference_mode()
def acceptance_against(target: torch.nn.Module, draft: torch.nn.Module, ids: np.ndarray, seq_len: int = 128, num: int = 32) -> tuple[float, float]:
    """Mean acceptance rate on held-out text: ``E[sum_x min(p, q)]`` at temperature 1 (the
    paper's alpha) and the greedy rate ``P[argmax p = argmax q]``."""
    x = _eval_windows(ids, seq_len, num)
    p = torch.softmax(target(input_ids=x).logits.double(), -1)
    q = torch.softmax(draft(input_ids=x).logits.double(), -1)
    sampled = torch.minimum(p, q).sum(-1).mean()
    greedy = (p.argmax(-1) == q.argmax(-1)).double().mean()
    return float(sampled), float(greedy)
