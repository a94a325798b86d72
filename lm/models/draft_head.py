"""A draft's output head over the target's most frequent tokens, in the style of FR-Spec
("FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative
Sampling", arXiv 2502.14856).

A small draft on a 49,152-token vocabulary spends most of its arithmetic in the output layer
(hidden x vocabulary per token). A pruned head computes logits for the ``K`` tokens the target
writes most often and gives every other token the logit :data:`OFF_HEAD_LOGIT`, so the draft's q
is still a distribution over the whole vocabulary: after a softmax, exactly zero off the head (it
never proposes those tokens; rejection sampling's residual ``max(p - q, 0)`` gives them all their
target mass, so verification stays lossless), and where a grammar masks every head token out, q
is uniform over the allowed tokens off the head rather than undefined.

The weights on disk stay a complete model: the head is the tied embedding's rows, and the list of
kept tokens is a file beside them (:data:`HEAD_FILE`). Loading through the project applies it;
any other loader (transformers' own ``from_pretrained``) reads the same directory as an ordinary
model with the full-vocabulary head, which is the fallback.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

HEAD_FILE = "draft_head.json"
OFF_HEAD_LOGIT = -1.0e4  # exp(-1e4 - max) underflows to exactly 0 in every float dtype; finite, so no inf - inf


class PrunedHead(torch.nn.Linear):
    """``nn.Linear`` over the full vocabulary (its weight, tied or not, keeps its name and shape, so
    state dicts and ``save_pretrained`` are unchanged) that computes only the rows in ``keep``."""

    keep: torch.Tensor

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = self._rows()
        out = hidden.new_full((*hidden.shape[:-1], self.out_features), OFF_HEAD_LOGIT)
        return out.index_copy_(-1, self.keep, F.linear(hidden, rows))

    def _rows(self) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return self.weight[self.keep]  # training (a fine-tune on the device): gradients reach the weight
        key = self._key()
        if key is None:
            return self.weight[self.keep]
        if self._cache_key != key:
            self.refresh()
        return self._cache

    def _key(self) -> tuple | None:
        """What the cached rows were gathered from; None for an inference tensor (no version counter)."""
        w = self.weight
        try:
            return (w.data_ptr(), w._version, w.dtype, w.device)
        except RuntimeError:
            return None

    def refresh(self) -> None:
        """Gather the kept rows again, into the same tensor where it still fits (a CUDA graph that
        captured the head reads that memory: it sees new weights after a load without a capture)."""
        with torch.inference_mode(False), torch.no_grad():
            rows = self.weight[self.keep]
            cache = getattr(self, "_cache", None)
            if cache is not None and cache.shape == rows.shape and cache.dtype == rows.dtype and cache.device == rows.device:
                cache.copy_(rows)
            else:
                self._cache = rows
        self._cache_key = self._key()


def prune_head(model: torch.nn.Module, tokens: list[int] | torch.Tensor) -> torch.nn.Module:
    """Restrict ``model``'s output head (``lm_head``) to ``tokens`` in place; returns the model."""
    head = model.lm_head
    keep = torch.as_tensor(tokens, dtype=torch.long).unique()  # sorted, no repeats
    if keep.numel() == 0 or int(keep[0]) < 0 or int(keep[-1]) >= head.out_features:
        raise ValueError(f"a pruned head's tokens must lie in [0, {head.out_features}); got {keep.numel()} tokens "
                         f"from {int(keep[0]) if keep.numel() else None} to {int(keep[-1]) if keep.numel() else None}")
    head.__class__ = PrunedHead
    head.register_buffer("keep", keep.to(head.weight.device), persistent=False)
    head._cache, head._cache_key = None, None
    # Loading weights (an adopted fine-tune: DraftAdapter.swap) refreshes the kept rows in place at once.
    head.register_load_state_dict_post_hook(lambda module, _keys: module.refresh())
    return model


def head_tokens(model: torch.nn.Module) -> torch.Tensor | None:
    """The tokens ``model``'s pruned head computes (sorted), or None for a full head."""
    head = getattr(model, "lm_head", None)
    return head.keep if isinstance(head, PrunedHead) else None


def off_head_to_ignore(model: torch.nn.Module, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``labels`` with every token the head cannot produce set to ``ignore_index`` (a copy), so a
    fine-tune's cross-entropy never chases an off-head token's constant logit."""
    keep = head_tokens(model)
    if keep is None:
        return labels
    inside = torch.isin(labels, keep.to(labels.device))
    return torch.where(inside | (labels == ignore_index), labels, torch.full_like(labels, ignore_index))


def write_head_file(directory: Path, tokens: list[int], **about) -> None:
    (Path(directory) / HEAD_FILE).write_text(json.dumps({"tokens": sorted(set(int(t) for t in tokens)), **about}))


def apply_head_file(model: torch.nn.Module, directory: str | Path) -> bool:
    """Prune ``model``'s head as ``directory``'s :data:`HEAD_FILE` says; False when it has none."""
    path = Path(directory) / HEAD_FILE
    if not path.is_file():
        return False
    prune_head(model, json.loads(path.read_text())["tokens"])
    return True
