"""What the real draft's build costs per step in bfloat16 and in float32 on this CPU.

    python -m bench.bench_build_precision [--repeats 4] [--json]

Needs ``goodspeed models get smollm2-135m`` (its target). Times the two costs of
:func:`goodspeed.lm.models.distill.build_draft`, in each precision:

- ``train_step``: one optimisation step of the draft (:data:`~goodspeed.lm.models.distill.DRAFT_RECIPE`'s
  shape: batch 16 x 128 tokens, candidate softmax over the labels and 4,096 negatives), the
  forward run as the build runs it (bfloat16 under autocast, or float32);
- ``teacher_generate``: the target, loaded in that precision, greedily generating 16 tokens for 32
  prompts of 60 random tokens (``generate``, as the build's transcripts are written).

Median of ``--repeats`` (train steps: after one discarded). Prints whether this CPU has native
bfloat16 (:func:`goodspeed.lm.models.precision.cpu_has_native_bf16`), which decides the build's precision.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from goodspeed.lm.models import distill, real


def train_step_seconds(target_config, dtype: torch.dtype, repeats: int) -> float:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    recipe = distill.DRAFT_RECIPE
    draft = LlamaForCausalLM(distill.draft_config(recipe, target_config))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=recipe.lr)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, target_config.vocab_size, (recipe.batch, recipe.seq_len)))
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        logp, cand = distill._candidate_log_probs(draft, x, x, recipe.negatives, rng, dtype)
        loss = F.nll_loss(logp.reshape(-1, cand.numel()), torch.searchsorted(cand, x[:, 1:].contiguous()).reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


@torch.inference_mode()
def generate_seconds(target_dir, dtype: torch.dtype, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, model.config.vocab_size, (32, 60)))
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not real.is_built("smollm2-135m"):
        parser.error("real:smollm2-135m is not built: run `goodspeed models get smollm2-135m` first")
    from transformers import AutoConfig

    target_dir = real.real_model_path("smollm2-135m")
    config = AutoConfig.from_pretrained(target_dir)
    report = {"native_bf16": distill.cpu_has_native_bf16(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "seconds": {}}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        report["seconds"][name] = {"train_step": round(train_step_seconds(config, dtype, args.repeats), 3),
                                   "teacher_generate": round(generate_seconds(target_dir, dtype, args.repeats), 2)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"native bf16: {report['native_bf16']} (capability {report['cpu_capability']}, {report['threads']} threads)")
        for name, row in report["seconds"].items():
            print(f"{name:9s} train step {row['train_step']:.3f} s   teacher generate {row['teacher_generate']:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
