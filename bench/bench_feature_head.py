"""Would an EAGLE-style draft head pay on the real pair? Its held-out acceptance against the large
recipe's draft, before any of it is built into serving (the optional EAGLE-style draft of *Drafts
that learn*, docs/BENCHMARKS.md).

    python -m bench.bench_feature_head [--work DIR] [--extra-chat 480] [--corpus-tokens 300000]
                                       [--steps 800] [--ttt-steps 500] [--json PATH]

An EAGLE-style head (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", ICML 2024, arXiv 2401.15077) drafts from the target's own last hidden state (its
*feature*, what the LM head reads) instead of from the text alone: from the feature of position
``t`` and the token at ``t + 1`` it predicts the feature at ``t + 1``, and the target's own LM head
turns that into the draft token for ``t + 2``; the next draft step feeds the predicted feature
back. Here the head is one decoder layer of the target's shape over ``fc([embedding; feature])``,
a final RMSNorm, and the target's (tied) LM head restricted to the large recipe's 8,193-token
pruned head. Stages, each kept in ``--work`` and reused by a later run:

1. **transcripts**: the target (bf16) answers, greedily, the large recipe's held-out groups
   (chat: every 8th of its chat requests, the group ``goodspeed models list`` reports; tasks: its
   held-out task requests; code: its held-out stdlib continuations) and, to train on, the recipe's
   training chat requests, ``--extra-chat`` of its extra requests and 160 of its code prompts;
2. **features**: the target's features (bf16) over those transcripts and ``--corpus-tokens`` of
   the standard library in 512-token pieces;
3. **head**: ``--steps`` steps (batch 16 x 128, AdamW, peak 1e-3, 50 warm-up steps, cosine) of
   smooth-L1 on the feature plus 0.1 x the cross-entropy of the head's distribution against the
   target's (both over the pruned head);
4. **ttt**: ``--ttt-steps`` more at peak 5e-4 with training-time test (EAGLE-3, arXiv
   2503.01840): three streams in one forward, the second and third fed the stream before's
   predicted features, each position attending to the true features a real draft step would see
   and to its own chain (:func:`chain_mask`), the loss over all three;
5. **eval**: against the float32 target on the held-out groups, for the head after stage 3, after
   stage 4, and the large recipe's draft (``real:smollm2-135m-draft-large``, which must be built:
   its pruned head is the head's vocabulary): the greedy
   agreement of the first draft token at every generated position (the figure ``goodspeed models
   list`` reports for a draft), and, every fourth position, a greedy chain of ``S = 4`` drafted
   from the true text (and, for the head, the true features) up to there: the mean of its tokens
   the target's greedy decoding would accept, and their histogram.

It also times one head step and one step of the large draft (one token, no cache, one thread,
bf16, median of 200): the drafting side of the trade. Nothing here is served: the figures say
whether building the head into local serving and over the wire (each verdict then carrying a
576-value feature per committed token, 1,152 bytes in bf16) would buy acceptance.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from typing import NamedTuple
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from goodspeed.drafter.prompts import chat_prompt_ids
from goodspeed.lm.models.corpus import encode, load_corpus, prompt_snippets, stdlib_files
from goodspeed.lm.models.distill import _ALSO_A_BENCHMARK_TASK, _TASKS, LARGE_RECIPE, chat_requests, target_transcripts
from goodspeed.lm.models.draft_head import HEAD_FILE, apply_head_file
from goodspeed.lm.models.real import real_model_path
from goodspeed.lm.models.transcript_prompts import large_chat_requests

SEQ, BATCH, PIECE = 128, 16, 512
DEPTH = 3  # training-time test's streams
S = 4  # the evaluated chains' length


def chain_mask(length: int, depth: int) -> torch.Tensor:
    """The additive attention mask of training-time test over ``depth`` streams of ``length``
    positions laid end to end: stream 0 holds the true features, stream ``s`` at position ``p``
    stands for the ``s``-th draft step of a chain whose last true feature is at ``p - s``. So it
    sees stream 0 up to ``p - s``, stream ``k`` (``1 <= k <= s``) at ``p - (s - k)`` alone (the
    chain's earlier steps, and itself), and nothing else."""
    neg = torch.finfo(torch.float32).min
    mask = torch.full((depth * length, depth * length), neg)
    p = torch.arange(length)
    for s in range(depth):
        rows = s * length + p
        mask[rows[:, None], p[None, :]] = torch.where(p[None, :] <= p[:, None] - s, 0.0, neg)
        for k in range(1, s + 1):
            q = p - (s - k)
            mask[rows[q >= 0], k * length + q[q >= 0]] = 0.0
    return mask


class FeatureHead(torch.nn.Module):
    """``fc([embedding(x_{t+1}); f_t])``, one decoder layer of the target's shape, an RMSNorm:
    the predicted feature at ``t + 1``. The target's embedding is read, not trained."""

    def __init__(self, target) -> None:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        super().__init__()
        config = target.config
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rope = LlamaRotaryEmbedding(config)
        self.embed = target.model.embed_tokens

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(torch.cat([self.embed(tokens).to(features.dtype), features], -1))
        length = h.shape[1]
        positions = (torch.arange(length) if positions is None else positions)[None].expand(h.shape[0], -1)
        if mask is None:
            mask = torch.full((length, length), torch.finfo(h.dtype).min, dtype=h.dtype).triu(1)
        out = self.layer(h, attention_mask=mask.to(h.dtype)[None, None], position_ids=positions,
                         position_embeddings=self.rope(h, positions))
        return self.norm(out[0] if isinstance(out, tuple) else out)


def _load_head(head: FeatureHead, state: dict) -> FeatureHead:
    """``state`` (saved without the target's embedding, which the head reads) into ``head``."""
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("embed.") for k in missing):
        raise RuntimeError(f"a saved head does not fit: missing {missing}, unexpected {unexpected}")
    return head


def _load_group(work: Path, name: str) -> tuple[np.ndarray, list[np.ndarray]]:
    saved = np.load(work / f"{name}.npz")
    return saved["starts"], np.split(saved["ids"], np.cumsum(saved["lengths"])[:-1])


def _transcripts(work: Path, target, tokenizer, extra_chat: int, log) -> None:
    recipe = LARGE_RECIPE
    corpus = load_corpus(recipe.corpus_bytes)

    def snippets(text: str, count: int) -> list[list[int]]:  # the recipe's code prompts, as distill.build_draft cuts them
        return [tokenizer(s, add_special_tokens=False)["input_ids"]
                for s in prompt_snippets(text, count, recipe.code_prompt_chars, seed=recipe.seed)]

    def chat_ids(requests: list[str]) -> list[list[int]]:
        return [chat_prompt_ids(tokenizer, [{"role": "user", "content": r}]) for r in requests]

    requests = chat_requests(recipe.seed)
    chat_train = [r for i, r in enumerate(requests) if i % 8 != 7 and r not in _ALSO_A_BENCHMARK_TASK]
    modules = sorted({p.stem for p in stdlib_files() if not p.stem.startswith("_")})
    extra = large_chat_requests(recipe.seed, corpus.train_text, modules, _TASKS)
    extra_train = [r for i, r in enumerate(extra) if i % 8 != 7]
    picked = random.Random(0).sample(extra_train, min(extra_chat, len(extra_train)))
    groups = {"chat": chat_ids([r for i, r in enumerate(requests) if i % 8 == 7]),
              "tasks": chat_ids([r for i, r in enumerate(extra) if i % 8 == 7]),
              "code": snippets(corpus.heldout_text, recipe.held_code_prompts),
              "train": chat_ids(chat_train + picked) + snippets(corpus.train_text, recipe.code_prompts)[:160]}
    for name, prompts in groups.items():
        if (work / f"{name}.npz").exists():
            continue
        started = time.perf_counter()
        out = target_transcripts(target, tokenizer, prompts, recipe.new_tokens, progress=True)
        np.savez(work / f"{name}.partial.npz", ids=np.concatenate(out), lengths=np.array([t.size for t in out]),
                 starts=np.array([len(p) for p in prompts]))
        (work / f"{name}.partial.npz").replace(work / f"{name}.npz")
        log(f"transcripts {name}: {len(prompts)} prompts, {sum(t.size for t in out):,} tokens, {time.perf_counter() - started:.0f} s")


@torch.inference_mode()
def _features(work: Path, target, tokenizer, corpus_tokens: int, log) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    _, train = _load_group(work, "train")
    ids = encode(tokenizer, load_corpus(LARGE_RECIPE.corpus_bytes).train_text)[:corpus_tokens]
    seqs = list(train) + [ids[i : i + PIECE] for i in range(0, len(ids) - PIECE, PIECE)]
    path = work / f"features-{corpus_tokens}.pt"
    if path.exists():
        return seqs, torch.load(path)
    started = time.perf_counter()
    feats = [target.model(input_ids=torch.from_numpy(s)[None]).last_hidden_state[0].to(torch.bfloat16)
             for s in tqdm(seqs, desc="target features", unit="seq", mininterval=0.1 if sys.stderr.isatty() else 10.0)]
    torch.save(feats, work / "features.partial.pt")
    (work / "features.partial.pt").replace(path)
    log(f"features of {sum(len(s) for s in seqs):,} tokens in {time.perf_counter() - started:.0f} s")
    return seqs, feats


def windows(seqs, feats, length: int):
    """Endless training batches: ``BATCH`` windows of ``length`` tokens (and their features), each
    from a sequence drawn by its length and a start drawn in it (seed 0, the same draws whatever
    ``length`` up to ``SEQ + 1``)."""
    lengths = np.array([len(s) for s in seqs])
    usable = np.where(lengths > SEQ + 2)[0]
    weights = lengths[usable] / lengths[usable].sum()
    rng = np.random.default_rng(0)
    while True:
        xs, fs = [], []
        for r in rng.choice(usable, BATCH, p=weights):
            s = int(rng.integers(0, lengths[r] - SEQ - 1))
            xs.append(torch.from_numpy(seqs[r][s : s + length]))
            fs.append(feats[r][s : s + length])
        yield torch.stack(xs), torch.stack(fs)


def set_lr(opt: torch.optim.Optimizer, peak: float, step: int, steps: int, warmup: int) -> None:
    """A linear warm-up over ``warmup`` steps, then a cosine decay to 0 at ``steps``."""
    for group in opt.param_groups:
        group["lr"] = peak * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def _train(target, keep: torch.Tensor, seqs, feats, steps: int, peak: float, depth: int, start: dict | None, desc: str) -> tuple[dict, list]:
    torch.manual_seed(0)
    head = FeatureHead(target)
    if start is not None:
        _load_head(head, start)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed.")]
    opt = torch.optim.AdamW(params, lr=peak, weight_decay=0.0)
    head_rows = target.lm_head.weight.detach()[keep].float()
    masks = {s: chain_mask(SEQ, s) for s in range(2, depth + 1)}
    curve = []
    started = time.perf_counter()
    batches = windows(seqs, feats, SEQ + 1)
    for step in tqdm(range(steps), desc=desc, unit="step", mininterval=0.1 if sys.stderr.isatty() else 10.0):
        set_lr(opt, peak, step, steps, warmup=50)
        x, f = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if depth == 1:
                pred = head(f[:, :-1], x[:, 1:])
            else:
                streams = [f[:, :-1]]
                for s in range(1, depth + 1):
                    pred = head(torch.cat(streams, 1), x[:, 1:].repeat(1, s), torch.arange(SEQ).repeat(s),
                                masks.get(s))
                    if s < depth:  # the next stream reads this one's predictions, one position on
                        streams.append(torch.cat([f[:, :1], pred[:, (s - 1) * SEQ :][:, :-1].to(f.dtype)], 1))
        pred, true = pred.float(), f[:, 1:].float().repeat(1, depth, 1)
        log_q = torch.log_softmax(pred @ head_rows.T, -1)
        with torch.no_grad():
            p = torch.softmax(true @ head_rows.T, -1)
        regression, ce = F.smooth_l1_loss(pred, true), -(p * log_q).sum(-1).mean()
        loss = regression + 0.1 * ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            curve.append({"step": step, "regression": round(regression.item(), 4), "ce": round(ce.item(), 3),
                          "train_agreement": round((log_q.argmax(-1) == p.argmax(-1)).float().mean().item(), 3),
                          "seconds": round(time.perf_counter() - started, 1)})
    return {k: v for k, v in head.state_dict().items() if not k.startswith("embed.")}, curve


@torch.inference_mode()
def _evaluate(work: Path, target32, draft_fn, label: str, chains: bool = True) -> dict:
    """The first-token agreement and (with ``chains``) the chains of module docstring's stage 5 on
    each held-out group; ``draft_fn`` is a :class:`_HeadDrafts` or a :class:`_ModelDrafts`
    (``first``: the draft's token after every position; ``chain``: its ``S`` greedy tokens after
    position ``t + 1``)."""
    weight = target32.lm_head.weight
    out = {}
    for name in ("chat", "tasks", "code"):
        starts, transcripts = _load_group(work, name)
        agree = total = 0
        chain = [0] * (S + 1)
        for start, ids in tqdm(list(zip(starts, transcripts)), desc=f"{label}: {name}", unit="transcript",
                               mininterval=0.1 if sys.stderr.isatty() else 10.0):
            x = torch.from_numpy(ids)
            hs = target32.model(input_ids=x[None]).last_hidden_state[0]
            greedy = (hs @ weight.T).argmax(-1)  # the target's greedy token after each position
            first = draft_fn.first(x, hs)  # first[t]: the draft's token for position t + 1, from the text up to t
            hit = first[start - 1 : len(ids) - 1] == greedy[start - 1 : len(ids) - 1]
            agree, total = agree + int(hit.sum()), total + hit.numel()
            for t in range(start - 1, len(ids) - 2, 4) if chains else ():  # known: the text up to t + 1 (t + 1: the round's bonus token)
                drafted = draft_fn.chain(x, hs, t)
                k = 0
                while k < S and t + 2 + k < len(ids) and int(drafted[k]) == int(greedy[t + 1 + k]):
                    k += 1
                chain[k] += 1
        out[name] = {"first_token_greedy": round(agree / total, 4), "positions": total}
        if chains:
            out[name].update(chain_accepted_mean=round(sum(i * c for i, c in enumerate(chain)) / sum(chain), 3), chain_histogram=chain)
    return out


class _HeadDrafts:
    def __init__(self, head: FeatureHead, keep: torch.Tensor, weight: torch.Tensor) -> None:
        self.head, self.keep, self.rows = head, keep, weight[keep]

    def token(self, feature: torch.Tensor) -> torch.Tensor:
        return self.keep[(feature @ self.rows.T).argmax(-1)]

    def first(self, x: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
        pred = self.token(self.head(hs[None, :-1], x[None, 1:])[0])  # pred[t]: from f_t and x_{t+1}, for x_{t+2}
        return torch.cat([x[:1], pred])  # first[t] = pred[t - 1]; position 0 has no draft

    def chain(self, x: torch.Tensor, hs: torch.Tensor, t: int) -> list[int]:
        fs, xs, drafted = hs[: t + 1], x[1 : t + 2], []
        for _ in range(S):
            out = self.head(fs[None], xs[None])[0, -1]
            token = self.token(out)
            drafted.append(int(token))
            fs, xs = torch.cat([fs, out[None]]), torch.cat([xs, token[None]])
        return drafted


class _ModelDrafts:
    def __init__(self, draft) -> None:
        self.draft = draft

    def first(self, x: torch.Tensor, hs: torch.Tensor) -> torch.Tensor:
        return self.draft(input_ids=x[None]).logits[0].argmax(-1)

    def chain(self, x: torch.Tensor, hs: torch.Tensor, t: int) -> list[int]:
        context, drafted = x[: t + 2], []
        for _ in range(S):
            token = self.draft(input_ids=context[None]).logits[0, -1].argmax()
            drafted.append(int(token))
            context = torch.cat([context, token[None]])
        return drafted


@torch.inference_mode()
def _step_ms(fn, repeats: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 3)


def stage_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of stages 1-2, which bench_truncated_draft shares (it reuses their folder)."""
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "goodspeed" / "bench" / "feature-head",
                        help="where the stages are kept and reused")
    parser.add_argument("--extra-chat", type=int, default=480, help="the large recipe's extra chat requests to train on")
    parser.add_argument("--corpus-tokens", type=int, default=300_000)


class Stages(NamedTuple):
    """Stages 1-2, made or reused: the work folder, the models' folders, the pruned head's tokens,
    the bf16 target, and the training sequences with the target's features over them."""

    work: Path
    target_dir: Path
    large_dir: Path
    keep: torch.Tensor
    target: torch.nn.Module
    seqs: list
    feats: list


def prepare_stages(parser: argparse.ArgumentParser, args: argparse.Namespace, log) -> Stages:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    target_dir, large_dir = real_model_path("smollm2-135m"), real_model_path("smollm2-135m-draft-large")
    if not (large_dir / HEAD_FILE).exists():
        parser.error("the vocabulary is the large recipe's pruned head: run `goodspeed models get smollm2-135m --recipe large` first")
    work = args.work / f"extra{args.extra_chat}"
    work.mkdir(parents=True, exist_ok=True)
    keep = torch.tensor(json.loads((large_dir / HEAD_FILE).read_text())["tokens"])
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    _transcripts(work, target, tokenizer, args.extra_chat, log)
    seqs, feats = _features(work, target, tokenizer, args.corpus_tokens, log)
    return Stages(work, target_dir, large_dir, keep, target, seqs, feats)


def report_header(module: str, argv: list[str] | None, seqs) -> dict:
    return {"command": " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": platform.processor() or platform.machine(),
            "train_tokens": int(sum(len(s) for s in seqs))}


def log(message: str) -> None:
    print(message, flush=True)


def write_json(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an EAGLE-style head's held-out acceptance on the real pair")
    stage_arguments(parser)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--ttt-steps", type=int, default=500)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    work, target_dir, large_dir, keep, target, seqs, feats = prepare_stages(parser, args, log)
    report = {**report_header("bench.bench_feature_head", argv, seqs), "curves": {}, "eval": {}}
    heads = {}
    for name, steps, peak, depth, start in (("head", args.steps, 1e-3, 1, None), ("head+ttt", args.ttt_steps, 5e-4, DEPTH, "head")):
        path = work / (f"{name}-{args.corpus_tokens}-{args.steps}" + (f"-{args.ttt_steps}" if start else "") + ".pt")
        if path.exists():
            saved = torch.load(path)
            heads[name], report["curves"][name] = saved["state"], saved["curve"]
            continue
        heads[name], report["curves"][name] = _train(target, keep, seqs, feats, steps, peak, depth, heads.get(start), name)
        torch.save({"state": heads[name], "curve": report["curves"][name]}, path)
    del feats
    target32 = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    large = LlamaForCausalLM.from_pretrained(large_dir, dtype=torch.float32).eval()
    apply_head_file(large, large_dir)
    for name, state in heads.items():
        head = _load_head(FeatureHead(target32), state)
        report["eval"][name] = _evaluate(work, target32, _HeadDrafts(head.eval(), keep, target32.lm_head.weight), name)
        log(f"{name}: {report['eval'][name]}")
    report["eval"]["draft-large"] = _evaluate(work, target32, _ModelDrafts(large), "draft-large")
    log(f"draft-large: {report['eval']['draft-large']}")
    # One draft step each, one thread, bf16, one token without a cache.
    torch.set_num_threads(1)
    head = FeatureHead(target).to(torch.bfloat16).eval()
    rows = target.lm_head.weight[keep]
    feature, token = torch.randn(1, 1, target.config.hidden_size, dtype=torch.bfloat16), torch.tensor([[42]])
    large16 = LlamaForCausalLM.from_pretrained(large_dir, dtype=torch.bfloat16).eval()
    apply_head_file(large16, large_dir)
    report["step_ms"] = {"head": _step_ms(lambda: head(feature, token) @ rows.T),
                         "draft-large": _step_ms(lambda: large16(input_ids=token).logits)}
    log(f"one draft step (ms, one thread, bf16, no cache): {report['step_ms']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
