"""Batch-invariant linear layers: a token's outputs the same bit for bit however many rows its
forward holds (``EngineConfig.batch_invariant``).

Greedy speculative decoding is lossless token for token only if the target scores a position the
same way in a verification step (the draft's tokens and other requests' rows beside it) as in a
one-token step of plain decoding. In float32 the rounding differences between batch shapes are
far below any logit gap measured here; in bf16 they are not: a last-bit difference in one layer
tips a near tie a few layers on, and the text parts from there. Two places make a token's result
depend on what else its forward holds:

* **Attention** summed a row's softmax over however many keys its call was given; packed forwards
  now read keys in whole runs of :data:`goodspeed.lm.runtime.packing.KEY_ALIGN`, which makes it
  exact, always on (a step's time unchanged within noise: docs/MEASUREMENTS.md, *Lossless in bf16*).
* **Linear layers.** On this project's CPU (oneDNN's bf16 matmul on AMX, one thread or two) a row's
  result is the same for every number of rows up to 32, and past 32 the library takes another
  blocking: over SmolLM2-135M's shapes, 1 or 2 rows of a call of 33-600 differ from the same row
  computed alone, and nearly every row of its 49,152-wide LM head. With ``batch_invariant`` every
  linear layer of the target runs its rows in runs of at most :data:`LINEAR_ROWS`
  (:func:`make_batch_invariant`), so every row takes the blocking a lone token takes.

The cost is the second's: a forward of more than 32 tokens (a batch's verification step, a prompt)
makes ``ceil(rows / 32)`` calls of each linear layer instead of one, and a call of a few rows costs
most of what one of 32 does (SmolLM2-135M on 2 cores: a forward of 33-64 tokens 1.34-1.39x, of 300
1.98x; docs/MEASUREMENTS.md, *Lossless in bf16*); a forward of up to 32 tokens costs nothing
more. Hence off by default: without it, greedy output in bf16 equals plain decoding's one request
at a time (each prompt prefilled in a forward of its own, every other
forward under 32 tokens: docs/DESIGN.md, *Lossless in bf16*), and may part from it in a last bit
where a forward holds more.

Measured on a CPU with AMX (``amx_bf16``) in bf16 only; the option refuses other devices, dtypes
and CPUs rather than promise what was not measured (a CPU without AMX runs bf16 matmuls through
other kernels; GPU kernels pick their blockings by other rules).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from goodspeed.lm.models.precision import cpu_flags

LINEAR_ROWS = 32  # the most rows one call of a linear layer takes under batch_invariant


def runs(rows: int) -> list[int]:
    """Where ``rows`` rows split into the fewest runs of at most :data:`LINEAR_ROWS`, as even as
    they go (a call of 1 row costs about what one of 32 does: the weights are read either way, so
    33 rows run as 17 + 16, not 32 + 1). Run starts, then ``rows``.

    >>> runs(32), runs(33), runs(70)
    ([0, 32], [0, 17, 33], [0, 24, 47, 70])
    """
    count = -(-rows // LINEAR_ROWS)
    return [rows * i // count + (1 if rows * i % count else 0) for i in range(count)] + [rows]


def _rows_in_runs(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` over ``x``'s rows in runs of at most :data:`LINEAR_ROWS` (:func:`runs`), concatenated."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows <= LINEAR_ROWS:
        return F.linear(x, self.weight, self.bias)
    flat = x.reshape(rows, x.shape[-1])
    bounds = runs(rows)
    out = torch.cat([F.linear(flat[a:b], self.weight, self.bias) for a, b in zip(bounds, bounds[1:])])
    return out.reshape(*x.shape[:-1], out.shape[-1])


def batch_invariance_missing(device: torch.device, dtype: torch.dtype, flags: set[str] | None = None) -> str | None:
    """Why ``batch_invariant`` cannot be promised for a target on ``device`` in ``dtype`` (None: it
    can); ``flags``: the CPU's (:func:`~goodspeed.lm.models.precision.cpu_flags`, read if None)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return f"it is measured for bf16 on a CPU only (this target: {dtype} on {device})"
    if "amx_bf16" not in (cpu_flags() if flags is None else flags):
        return "it is measured on CPUs with AMX (amx_bf16) only, which this one lacks"
    return None


def make_batch_invariant(model: torch.nn.Module) -> int:
    """Run every ``nn.Linear`` of ``model`` in runs of at most :data:`LINEAR_ROWS` rows; returns how
    many layers now do. In place (every engine on this model object sees it; the weights
    themselves are untouched) and idempotent."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(_rows_in_runs, module)
            count += 1
    return count
