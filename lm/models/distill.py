"""Distil a small draft for a real pretrained target on this machine, in minutes on 2 cores.

The draft is a small Llama on the target's own tokenizer. What makes it trainable on a CPU with a
49,152-token vocabulary:

- **Embeddings from the target.** The draft's (tied) embedding starts as the top principal
  components of the target's embedding matrix, so similar tokens start similar.
- **Candidate softmax.** The output layer dominates the cost (hidden x 49,152 per token, forward
  and backward). Each step normalises over the tokens that matter for that batch, the labels (or
  the teacher's top-k) plus a few thousand random negatives, instead of the whole vocabulary:
  about 6x cheaper per step. At inference the draft is an ordinary ``LlamaForCausalLM`` over the
  full vocabulary.
- **Text the target writes itself.** The target continues code snippets from the standard
  library and answers chat-style requests (greedy, in its chat template); a draft that has seen
  the target's own continuations predicts them far better than one trained on the corpus alone
  (sequence-level distillation).
- **Two phases.** (1) Next-token cross-entropy on the standard library's source mixed with those
  transcripts; (2) distillation on the target's top-k next-token distributions (forward KL
  restricted to the teacher's top-k, renormalised), which is what raises acceptance under
  sampling (AdaServe section 4.2 cites distilled drafts).

Seeds and step counts are fixed (never wall time), so a build is reproducible on the same corpus
and the same kind of CPU. A build runs on a GPU when torch sees one (:func:`build_device`), in
bfloat16 there; on a CPU the teacher's transcripts and labels, and the draft's training forwards,
run in bfloat16 where the CPU computes it natively (x86 ``avx512_bf16`` or ``amx_bf16``, Arm
``bf16``; 2-3x faster than float32 there), else in float32 (:func:`build_precision`). On a CPU
without it torch emulates bfloat16: on an AVX2-only EPYC a training step took 5.72 s in bfloat16
against 0.54 s in float32, and the teacher's generation 3.6x as long (``python -m
bench.bench_build_precision``). The manifest records the precision a build used.
Recipes (:data:`RECIPES`): ``default``, above, and ``large``: twice the width, a pruned output
head (:mod:`goodspeed.lm.models.draft_head`), many more of the target's transcripts
(:mod:`goodspeed.lm.models.transcript_prompts`) and more steps of both phases. Every stage is kept
as it finishes and an interrupted build resumes from it (:func:`build_draft`).
Acceptance is measured against the float32 target on what speculation meets in serving: the
target's own continuations of held-out code prompts and its answers to held-out chat requests
(every 8th of each, never trained on). Reported per position: the greedy rate
``P[argmax p = argmax q]`` and ``E[sum_x min(p, q)]`` at T = 0.8 and T = 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from goodspeed.lm.models.corpus import encode, load_corpus, prompt_snippets, stdlib_files
from goodspeed.lm.models.draft_head import prune_head, write_head_file
from goodspeed.lm.models.model_dirs import save_model_dir
from goodspeed.lm.models.precision import cpu_has_native_bf16
from goodspeed.lm.models.train import intermediate_size, optimize, save_atomically
from goodspeed.lm.models.transcript_prompts import large_chat_requests


@dataclass(frozen=True)
class DraftRecipe:
    hidden: int = 128
    layers: int = 4
    head_dim: int = 64
    kv_heads: int = 1
    pretrain_steps: int = 1200
    distill_steps: int = 400
    teacher_windows: int = 768  # sequences of seq_len tokens labelled with the teacher's top-k
    batch: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    negatives: int = 4096  # random tokens added to each step's candidate set
    top_k: int = 32
    generated_share: float = 0.4  # of the rows of each batch drawn from the target's own transcripts
    code_prompts: int = 256  # stdlib snippets the target continues
    code_prompt_chars: int = 160
    new_tokens: int = 128  # per transcript
    corpus_bytes: int = 8_000_000
    seed: int = 0
    # Fields added with the large recipe; at these defaults a recipe's digest is what it was before them.
    head_tokens: int = 0  # > 0: a pruned output head over the target's most frequent tokens (draft_head)
    extra_chat: bool = False  # also answer transcript_prompts.large_chat_requests
    held_code_prompts: int = 0  # held-out code prompts (0: code_prompts // 8)


_FIRST_FIELDS = 18  # the recipe's fields before head_tokens


DRAFT_RECIPE = DraftRecipe()
# The stronger recipe (`goodspeed models get smollm2-135m --recipe large`): twice the width, a head
# over the 8,192 tokens the target writes most, six times the transcripts, more of every phase.
LARGE_RECIPE = DraftRecipe(hidden=256, layers=4, lr=2e-3, pretrain_steps=3000, distill_steps=1500, teacher_windows=2048,
                           generated_share=0.6, code_prompts=768, head_tokens=8192, extra_chat=True, held_code_prompts=32)
RECIPES = {"default": DRAFT_RECIPE, "large": LARGE_RECIPE}
CHECKPOINT_EVERY = 200  # training steps between a build's checkpoints


def recipe_digest(recipe: DraftRecipe) -> str:
    values = dataclasses.astuple(recipe)
    added = tuple((f.name, v) for f, v in zip(dataclasses.fields(recipe)[_FIRST_FIELDS:], values[_FIRST_FIELDS:]) if v != f.default)
    return hashlib.sha256(repr(values[:_FIRST_FIELDS] + added).encode()).hexdigest()


# Chat-style requests the target answers to make its own training transcripts. Disjoint from the
# shipped prompt set launch/prompts/chat.jsonl, which the benchmarks use.
_TASKS = (
    "reverses a string", "checks whether a number is prime", "merges two sorted lists", "counts the words in a text",
    "flattens a nested list", "computes the factorial of n", "removes duplicates from a list while keeping order",
    "finds the largest element of a list", "converts Celsius to Fahrenheit", "checks whether a string is a palindrome",
    "reads a CSV file and returns its rows", "computes the mean and median of a list", "returns the n-th Fibonacci number",
    "sorts a dictionary by its values", "parses a date string", "computes the greatest common divisor of two numbers",
    "transposes a matrix", "counts vowels in a string", "finds all files with a given extension in a folder",
    "implements binary search", "groups words by their first letter", "validates an email address with a regular expression",
    "computes the running sum of a list", "chunks a list into pieces of size n", "capitalizes every word in a sentence",
    "returns the intersection of two lists", "computes the power set of a set", "checks whether brackets are balanced",
)
_QUESTIONS = (
    "What is the difference between a list and a tuple in Python?", "Explain what a hash table is.", "What is recursion?",
    "How does a for loop work in Python?", "What is an API?", "Explain the difference between TCP and UDP.",
    "What causes the seasons on Earth?", "Give me three tips for writing clean code.", "What is machine learning?",
    "How do I open a file in Python?", "What is the capital of Japan?", "Explain what a virtual environment is.",
    "Why is the sky blue?", "What is a decorator in Python?", "Summarize the water cycle.", "What is Big O notation?",
    "How does garbage collection work?", "What are the benefits of unit testing?", "Explain what JSON is.",
    "What is the difference between a process and a thread?", "How do vaccines work?", "What is an exception?",
    "Write a haiku about the ocean.", "What does the `with` statement do in Python?",
)


def chat_requests(seed: int, modules: int = 40) -> list[str]:
    """The chat-style requests (deterministic): tasks, questions and questions about stdlib modules."""
    names = sorted({p.stem for p in stdlib_files() if not p.stem.startswith("_")})
    rng = random.Random(seed)
    picked = rng.sample(names, min(modules, len(names)))
    out = [f"Write a Python function that {t}." for t in _TASKS] + list(_QUESTIONS)
    out += [f"What is the Python module `{m}` used for? Show a short example." for m in picked]
    rng.shuffle(out)
    return out


@torch.inference_mode()
def target_transcripts(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch: int = 32, progress: bool = True) -> list[np.ndarray]:
    """Each prompt followed by the target's greedy continuation (up to its end of turn), as ids."""
    eos = tokenizer.eos_token_id
    out = []
    bar = tqdm(total=len(prompts), desc="target writes transcripts", disable=not progress, unit="prompt",
               mininterval=0.1 if sys.stderr.isatty() else 10.0)
    for i in range(0, len(prompts), batch):
        encoded = prompts[i : i + batch]
        width = max(map(len, encoded))
        device = next(target.parameters()).device
        ids = torch.tensor([[eos] * (width - len(e)) + e for e in encoded], device=device)
        mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded], device=device)
        gen = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos)
        for e, row in zip(encoded, gen[:, width:].tolist()):
            answer = row[: row.index(eos) + 1] if eos in row else row
            out.append(np.asarray(e + answer, dtype=np.int64))
        bar.update(len(encoded))
    bar.close()
    return out


def _pca_embedding(target_embedding: torch.Tensor, hidden: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    emb = target_embedding.float()
    centred = emb - emb.mean(0)
    _, _, v = torch.pca_lowrank(centred, q=hidden, center=False)
    proj = centred @ v[:, :hidden]
    return proj / proj.std() * 0.02


def draft_config(recipe: DraftRecipe, target_config):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=recipe.hidden,
        intermediate_size=intermediate_size(recipe.hidden),
        num_hidden_layers=recipe.layers,
        num_attention_heads=recipe.hidden // recipe.head_dim,
        num_key_value_heads=recipe.kv_heads,
        head_dim=recipe.head_dim,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_theta=getattr(target_config, "rope_theta", None) or target_config.rope_parameters["rope_theta"],
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )


class _Windows:
    """Fixed-length training windows from the corpus and from the target's transcripts."""

    def __init__(self, corpus: np.ndarray, generated: np.ndarray, recipe: DraftRecipe, rng: np.random.Generator):
        self.corpus, self.generated, self.recipe, self.rng = corpus, generated, recipe, rng

    def sample(self, rows: int) -> torch.Tensor:
        n_gen = int(round(rows * self.recipe.generated_share))
        out = [self._window(self.generated) for _ in range(n_gen)] + [self._window(self.corpus) for _ in range(rows - n_gen)]
        return torch.from_numpy(np.stack(out))

    def _window(self, ids: np.ndarray) -> np.ndarray:
        s = int(self.rng.integers(0, ids.size - self.recipe.seq_len))
        return ids[s : s + self.recipe.seq_len]


def build_device() -> torch.device:
    """Where the build computes: the first CUDA device when torch sees one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_precision(device: torch.device | None = None) -> torch.dtype:
    """The dtype the build computes in: bfloat16 on a GPU and on a CPU that computes it natively
    (module docstring), else float32."""
    native = (device or build_device()).type == "cuda" or cpu_has_native_bf16()
    return torch.bfloat16 if native else torch.float32


def _candidate_log_probs(draft, x: torch.Tensor, must: torch.Tensor, negatives: int, rng: np.random.Generator,
                         dtype: torch.dtype = torch.float32, exact: bool = False):
    """Log-probabilities of the draft at every position but the last, normalised over the
    candidate set (``must`` plus random negatives; ``exact``: ``must`` alone, already sorted and
    unique, such as a pruned head's tokens); returns (log_probs, sorted candidates).
    ``dtype``: bfloat16 runs the forward under autocast."""
    vocab, device = draft.config.vocab_size, x.device
    cand = must if exact else torch.unique(torch.cat([must.flatten(), torch.from_numpy(rng.integers(0, vocab, negatives)).to(device)]))
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        h = draft.model(input_ids=x).last_hidden_state[:, :-1]
        logits = h @ draft.model.embed_tokens.weight[cand].T
    return torch.log_softmax(logits.float(), -1), cand


@torch.inference_mode()
def _teacher_topk(target, x: torch.Tensor, k: int, batch: int = 16, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` next-token distributions (renormalised) at every position of ``x``
    but the last, on the CPU whatever the target's device."""
    probs = torch.empty(x.shape[0], x.shape[1] - 1, k)
    index = torch.empty(x.shape[0], x.shape[1] - 1, k, dtype=torch.int64)
    device = next(target.parameters()).device
    for i in tqdm(range(0, x.shape[0], batch), desc="target labels windows", disable=not progress, unit="batch",
                  mininterval=0.1 if sys.stderr.isatty() else 10.0):
        logp = torch.log_softmax(target(input_ids=x[i : i + batch].to(device)).logits[:, :-1].float(), -1)
        top = logp.topk(k, -1)
        p = top.values.exp()
        probs[i : i + batch], index[i : i + batch] = (p / p.sum(-1, keepdim=True)).cpu(), top.indices.cpu()
    return probs, index


@torch.inference_mode()
def held_out_acceptance(target, draft, transcripts: list[tuple[int, np.ndarray]]) -> dict[str, float]:
    """Greedy agreement and ``E[sum min(p, q)]`` at T = 0.8 and 1 at every generated position of
    ``transcripts`` (``(prompt length, ids)`` pairs)."""
    greedy, t08, t1, n = 0.0, 0.0, 0.0, 0
    device = next(target.parameters()).device
    for start, ids in transcripts:
        x = torch.from_numpy(ids).to(device)
        lp, lq = (m(input_ids=x[None]).logits[0, start - 1 : -1].double() for m in (target, draft))
        greedy += float((lp.argmax(-1) == lq.argmax(-1)).sum())
        t08 += float(torch.minimum(torch.softmax(lp / 0.8, -1), torch.softmax(lq / 0.8, -1)).sum())
        t1 += float(torch.minimum(torch.softmax(lp, -1), torch.softmax(lq, -1)).sum())
        n += lp.shape[0]
    return {"greedy": round(greedy / n, 4), "t0.8": round(t08 / n, 4), "t1": round(t1 / n, 4)}


_ALSO_A_BENCHMARK_TASK = frozenset({"Why is the sky blue?"})  # an open-chat task of bench/workloads: the large recipe skips it


def _transcripts_staged(teacher, tokenizer, prompts: list[list[int]], recipe: DraftRecipe, work: Path, progress: bool,
                        chunk: int = 256) -> list[np.ndarray]:
    """:func:`target_transcripts` of ``prompts`` in chunks, each saved under ``work/transcripts`` as
    it completes and reused by a later run (the longest stage of a large build). The folder is
    stamped with what the transcripts depend on (the prompts, the answers' length, the teacher's
    precision), so a recipe that changes only its training reuses them, and any other change
    writes them again."""
    out: list[np.ndarray] = []
    folder = work / "transcripts"
    stamp = hashlib.sha256(repr((prompts, recipe.new_tokens, str(next(teacher.parameters()).dtype))).encode()).hexdigest()
    if folder.exists() and (not (folder / "stamp").exists() or (folder / "stamp").read_text() != stamp):
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stamp").write_text(stamp)
    bar = tqdm(total=len(prompts), desc="target writes transcripts", disable=not progress, unit="prompt",
               mininterval=0.1 if sys.stderr.isatty() else 10.0)
    for i in range(0, len(prompts), chunk):
        path = folder / f"{i // chunk:05d}.npz"
        if path.exists():
            saved = np.load(path)
            part = np.split(saved["ids"], np.cumsum(saved["lengths"])[:-1])
        else:
            part = target_transcripts(teacher, tokenizer, prompts[i : i + chunk], recipe.new_tokens, progress=False)
            staging = path.with_name(path.stem + ".partial.npz")
            np.savez(staging, ids=np.concatenate(part), lengths=np.array([t.size for t in part]))
            staging.replace(path)
        out += part
        bar.update(len(part))
    bar.close()
    return out


def frequent_tokens(generated: np.ndarray, corpus_ids: np.ndarray, vocab: int, count: int, always: list[int]) -> list[int]:
    """The ``count`` tokens the target writes most (its transcripts' frequencies, plus a quarter
    weight of the corpus's), and ``always`` (special tokens), sorted."""
    score = np.bincount(generated, minlength=vocab) / max(1, generated.size)
    score = score + 0.25 * np.bincount(corpus_ids, minlength=vocab) / max(1, corpus_ids.size)
    top = np.argsort(-score, kind="stable")[:count]
    return sorted(set(int(t) for t in top) | set(int(t) for t in always if 0 <= t < vocab))


def _coverage(tokens: list[int], transcripts: list[tuple[int, np.ndarray]]) -> float:
    """The share of the target's generated tokens in ``transcripts`` that lie in ``tokens``."""
    generated = np.concatenate([ids[start:] for start, ids in transcripts])
    return round(float(np.isin(generated, np.asarray(tokens)).mean()), 4)


def _work_dir(out: Path, recipe: DraftRecipe, log) -> Path:
    """Where a build keeps its finished stages: ``<out>.build``. Training stages of another recipe
    are removed; the transcripts keep their own stamp (:func:`_transcripts_staged`)."""
    work = out.with_name(out.name + ".build")
    stamp = work / "recipe"
    if work.exists() and (not stamp.exists() or stamp.read_text() != recipe_digest(recipe)):
        _remove_training_stages(work)
    if any(work.glob("*")):
        log(f"resuming from the stages done in {work}")
    work.mkdir(parents=True, exist_ok=True)
    stamp.write_text(recipe_digest(recipe))
    return work


def _remove_training_stages(work: Path) -> None:
    """Everything in ``work`` but the transcripts (a few MB, reused by a recipe that differs in
    training only): the checkpoints and the teacher's labels (about 100 MB for the large recipe)."""
    for path in work.iterdir():
        if path.name != "transcripts":
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _losses(draft, recipe: DraftRecipe, rng: np.random.Generator, precision: torch.dtype, head: torch.Tensor | None):
    """The two phases' losses over the candidate softmax: (next-token loss of a window batch,
    distillation loss of teacher rows). With a pruned ``head`` the candidates are its tokens (what
    the draft computes when serving) and targets off it are left out."""

    device = next(draft.parameters()).device

    def candidates(x: torch.Tensor, must: torch.Tensor):
        if head is None:
            return _candidate_log_probs(draft, x, must, recipe.negatives, rng, precision)
        return _candidate_log_probs(draft, x, head, 0, rng, precision, exact=True)

    def positions(cand: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        at = torch.searchsorted(cand, tokens.contiguous()).clamp(max=cand.numel() - 1)
        return at, cand[at] == tokens

    def next_token(x: torch.Tensor) -> torch.Tensor:
        x = x.to(device)
        logp, cand = candidates(x, x)
        at, inside = positions(cand, x[:, 1:])
        return F.nll_loss(logp.reshape(-1, cand.numel()), torch.where(inside, at, -100).reshape(-1), ignore_index=-100)

    def distil(x: torch.Tensor, probs: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        x, probs, index = x.to(device), probs.to(device), index.to(device)
        logp, cand = candidates(x, index)
        at, inside = positions(cand, index)
        return -(probs * inside * logp.gather(-1, at)).sum(-1).mean()

    return next_token, distil


def build_draft(target_dir: Path, out: Path, recipe: DraftRecipe = DRAFT_RECIPE, progress: bool = True, log=print,
                device: str | torch.device | None = None) -> dict:
    """Distil a draft for the target in ``target_dir`` into ``out`` (atomically); returns the
    measured figures (parameters and held-out acceptance on code and on chat).

    Stages (the target's transcripts, chunk by chunk; each training phase, every
    :data:`CHECKPOINT_EVERY` steps; the teacher's labels) are kept in ``<out>.build`` as they
    finish, and a run interrupted anywhere resumes from the last of them with the same result.
    Once the draft is saved only the transcripts stay there, for a later recipe that differs in
    its training alone. ``device``: where to compute (default :func:`build_device`: a GPU when
    torch sees one); the saved draft and the figures are the same on either, up to numerics."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    started = time.perf_counter()
    work = _work_dir(out, recipe, log)
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    # The teacher's answers and labels in the build's precision; acceptance is measured in fp32.
    device = torch.device(device) if device is not None else build_device()
    precision = build_precision(device)
    log(f"computing in {str(precision).removeprefix('torch.')} on {device}" + ("" if device.type == "cuda" else
        f" (this CPU {'has' if precision == torch.bfloat16 else 'lacks'} native bfloat16)"))
    teacher = AutoModelForCausalLM.from_pretrained(target_dir, dtype=precision).to(device).eval()
    corpus = load_corpus(recipe.corpus_bytes)
    corpus_ids = encode(tokenizer, corpus.train_text)

    def snippets(text: str, count: int) -> list[list[int]]:
        return [tokenizer(s, add_special_tokens=False)["input_ids"]
                for s in prompt_snippets(text, count, recipe.code_prompt_chars, seed=recipe.seed)]

    def chat_ids(requests: list[str]) -> list[list[int]]:
        return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": r}], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"] for r in requests]

    # Code prompts to continue: from the training text, and (held out) from the held-out files.
    code = snippets(corpus.train_text, recipe.code_prompts)
    code_held = snippets(corpus.heldout_text, recipe.held_code_prompts or recipe.code_prompts // 8)
    requests = chat_requests(recipe.seed)
    chat_train, chat_held = [r for i, r in enumerate(requests) if i % 8 != 7], [r for i, r in enumerate(requests) if i % 8 == 7]
    extra_train, extra_held = [], []
    if recipe.extra_chat:
        chat_train = [r for r in chat_train if r not in _ALSO_A_BENCHMARK_TASK]
        modules = sorted({p.stem for p in stdlib_files() if not p.stem.startswith("_")})
        extra = large_chat_requests(recipe.seed, corpus.train_text, modules, _TASKS)
        extra_train, extra_held = [r for i, r in enumerate(extra) if i % 8 != 7], [r for i, r in enumerate(extra) if i % 8 == 7]
    groups = {"train": chat_ids(chat_train + extra_train) + code, "chat": chat_ids(chat_held), "code": code_held,
              "tasks": chat_ids(extra_held)}
    prompts = [p for g in groups.values() for p in g]
    log(f"stage 1/4: the target answers {len(prompts):,} prompts ({len(groups['train']):,} to train on, the rest held out)")
    transcripts = _transcripts_staged(teacher, tokenizer, prompts, recipe, work, progress)
    held, at = {}, 0
    for name, group in groups.items():
        held[name] = [(len(p), t) for p, t in zip(group, transcripts[at : at + len(group)])]
        at += len(group)
    train = [t for _, t in held.pop("train")]
    generated = np.concatenate(train)
    log(f"corpus: {corpus_ids.size:,} stdlib tokens and {generated.size:,} tokens of {len(train)} target transcripts")

    head = None
    if recipe.head_tokens:
        head = torch.tensor(frequent_tokens(generated, corpus_ids, teacher.config.vocab_size, recipe.head_tokens,
                                            tokenizer.all_special_ids), device=device)
    draft = LlamaForCausalLM(draft_config(recipe, teacher.config))
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(_pca_embedding(teacher.model.embed_tokens.weight.cpu(), recipe.hidden, recipe.seed))
    draft.to(device)
    windows = _Windows(corpus_ids, generated, recipe, rng)
    next_token, distil = _losses(draft, recipe, rng, precision, head)
    log("stage 2/4: next-token training")
    optimize(draft, recipe.pretrain_steps, recipe.lr, lambda: next_token(windows.sample(recipe.batch)), "draft: next-token",
             progress, checkpoint=work / "pretrain.pt", every=CHECKPOINT_EVERY, rng=rng)

    labels = work / "labels.pt"
    if labels.exists():
        saved = torch.load(labels, weights_only=False)
        x_teacher, t_probs, t_index = saved["x"], saved["probs"], saved["index"]
        rng.bit_generator.state = saved["rng"]
    else:
        x_teacher = windows.sample(recipe.teacher_windows)
        log(f"stage 3/4: labelling {x_teacher.numel():,} tokens with the target's top-{recipe.top_k}")
        t_probs, t_index = _teacher_topk(teacher, x_teacher, recipe.top_k, progress=progress)
        save_atomically({"x": x_teacher, "probs": t_probs, "index": t_index, "rng": rng.bit_generator.state}, labels)

    def distill_loss():
        rows = torch.from_numpy(rng.integers(0, x_teacher.shape[0], recipe.batch))
        return distil(x_teacher[rows], t_probs[rows], t_index[rows])

    log("stage 4/4: distillation on the target's distributions")
    optimize(draft, recipe.distill_steps, recipe.lr / 2, distill_loss, "draft: distil", progress,
             checkpoint=work / "distill.pt", every=CHECKPOINT_EVERY, rng=rng)

    del teacher
    if head is not None:
        prune_head(draft, head)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    measured = {name: held_out_acceptance(target, draft, pairs) for name, pairs in held.items() if pairs}
    log(f"held-out acceptance on the target's code continuations: {measured['code']}; on its chat answers: {measured['chat']}"
        + (f"; on the recipe's held-out requests: {measured['tasks']}" if "tasks" in measured else ""))
    acceptance = {
        "greedy_acceptance": measured["code"]["greedy"], "acceptance_t08": measured["code"]["t0.8"],
        "acceptance": measured["code"]["t1"],
        "chat_greedy_acceptance": measured["chat"]["greedy"], "chat_acceptance_t08": measured["chat"]["t0.8"],
        "chat_acceptance": measured["chat"]["t1"],
    }
    if "tasks" in measured:
        acceptance.update({"tasks_greedy_acceptance": measured["tasks"]["greedy"], "tasks_acceptance_t08": measured["tasks"]["t0.8"],
                           "tasks_acceptance": measured["tasks"]["t1"]})
    report = {}
    if head is not None:
        coverage = {name: _coverage(head.tolist(), pairs) for name, pairs in held.items() if pairs}
        report["head"] = {"tokens": head.numel(), "coverage": coverage}
        log(f"pruned head: {head.numel():,} tokens cover {report['head']['coverage']} of the held-out generated tokens")

    save_model_dir(draft.cpu(), tokenizer, out, extra=None if head is None else
                   (lambda folder: write_head_file(folder, head.tolist(), coverage=report["head"]["coverage"])))
    _remove_training_stages(work)
    return {
        "target_params": int(sum(p.numel() for p in target.parameters())),
        "target_layers": target.config.num_hidden_layers,
        "target_hidden": target.config.hidden_size,
        "draft_params": int(sum(p.numel() for p in draft.parameters())),
        "acceptance": acceptance,
        "seconds": round(time.perf_counter() - started, 1),
        "precision": str(precision).removeprefix("torch."),
        "device": device.type,
        **report,
    }
