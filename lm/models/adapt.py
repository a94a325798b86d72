"""An edge draft that learns its own device's traffic from the verdicts (``goodspeed drafter --adapt``).

Every verdict carries the target's own tokens for exactly the text this device's users send. The
node keeps the committed text of its recent finished requests (bounded in requests and tokens; it
never leaves the device), and every ``every`` requests fine-tunes a copy of its draft on them in
the background: next-token cross-entropy on the requests' generated tokens (the target's answers),
the prompt only as context. This is online distillation on the live query distribution, as in
"Online Speculative Decoding" (Liu et al., ICML 2024, arXiv 2310.07177), here on an edge device
with the committed tokens as labels.

**The guard.** One request in four (by arrival) is held back from training. A candidate's greedy
acceptance on the held-back requests — the share of their generated positions where the draft's
most likely token is the committed one, which under greedy decoding is the target's own — is
compared with the live weights' and the shipped weights'; the best of the three is live next (a
tie keeps the live weights). So a candidate worse than the weights in use is refused, and weights
that have fallen behind the shipped ones are reverted to them. Under sampling the committed tokens
are the target's samples, and agreement with them ranks drafts by the same measure.

**Lossless by construction.** The verifier verifies whatever the draft proposes, with the draft's
own ``q``; weights change only between requests (:meth:`DraftAdapter.swap` runs when no request
holds a draft KV slot, and the node holds new requests back while a swap waits), so no request's
KV cache sees two versions of the weights.

**Bounded.** Training runs on its own thread with one optimiser step at a time, pausing between
steps so that it takes at most ``cpu_share`` of the wall time while it runs; memory is the kept
text, two copies of the draft's weights (the shipped ones, on the host, and the one being trained)
and its optimiser's state. With ``dir`` the adopted weights and their
history persist across restarts (loaded only onto the same shipped weights).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from goodspeed.lm.models.adapt_config import HELD_BACK_EVERY, AdaptConfig
from goodspeed.lm.models.draft_head import off_head_to_ignore


@dataclass
class Update:
    """One fine-tune and what the guard made of it."""

    version: int  # the live weights' version after it
    outcome: str  # "adopted" (the candidate), "reverted" (to the shipped weights) or "kept"
    before: float  # held-back greedy acceptance of the live weights
    candidate: float
    shipped: float
    after: float  # of the weights live after it
    requests: int  # recorded requests (training, held back) when it ran
    held_back: int
    seconds: float  # training and judging


@dataclass
class _Recent:
    prompt_len: int
    ids: np.ndarray
    held_back: bool


class DraftAdapter:
    """Learns one draft model's traffic (the module docstring). ``record`` and ``fine_tune`` may run
    on any thread; ``swap`` on the thread that drafts with ``model``."""

    def __init__(self, model: torch.nn.Module, config: AdaptConfig = AdaptConfig(), log=None) -> None:
        self.model, self.config, self.log = model, config, log or (lambda message: None)
        self.shipped = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self.base = _digest(self.shipped)
        self.version = 0
        self.updates: list[Update] = []
        self.pending: dict[str, torch.Tensor] | None = None  # weights waiting for a moment with no request
        self.seconds = 0.0  # spent fine-tuning and judging
        self._recent: deque[_Recent] = deque()
        self._tokens = 0
        self._recorded = 0
        self._since = 0
        self._lock = threading.Lock()
        self._rng = np.random.default_rng(config.seed)
        self.stopping = threading.Event()  # set: a fine-tune in progress ends at its next step, adopting nothing
        if config.dir is not None:
            self._restore(Path(config.dir))

    # ------------------------------------------------------------------ traffic

    def record(self, prompt_len: int, committed: Sequence[int]) -> bool:
        """Keep a finished request's text (``committed``: prompt + generated; the first
        ``prompt_len`` are prompt). True when a fine-tune is due."""
        ids = np.asarray(committed, dtype=np.int64)
        if ids.size <= prompt_len or prompt_len < 1:
            return False
        with self._lock:
            self._recent.append(_Recent(prompt_len, ids, self._recorded % HELD_BACK_EVERY == HELD_BACK_EVERY - 1))
            self._recorded += 1
            self._tokens += ids.size
            while len(self._recent) > self.config.keep or self._tokens > self.config.keep_tokens:
                self._tokens -= self._recent.popleft().ids.size
            self._since += 1
            due = self._since >= self.config.every and self.pending is None
            if due:
                self._since = 0
            return due

    @property
    def kept_tokens(self) -> int:
        return self._tokens

    @property
    def kept_requests(self) -> int:
        return len(self._recent)

    # ------------------------------------------------------------------ learning

    def fine_tune(self) -> Update | None:
        """Train a candidate on the kept training requests and judge it (the guard); leaves the
        weights to go live in :attr:`pending` unless the live ones stay. None when there is not
        yet a request of each kind."""
        with self._lock:
            recent = list(self._recent)
        train = [r for r in recent if not r.held_back]
        held = [r for r in recent if r.held_back]
        if not train or not held:
            return None
        started = time.perf_counter()
        work = copy.deepcopy(self.model).float().train()
        device = next(work.parameters()).device
        optimiser = torch.optim.AdamW(work.parameters(), lr=self.config.lr, weight_decay=0.0)
        for _ in range(self.config.steps):
            if self.stopping.is_set():
                return None
            step_started = time.perf_counter()
            x, labels = (t.to(device) for t in self._batch(train))
            labels = off_head_to_ignore(work, labels)  # a pruned head cannot learn tokens off it
            loss = F.cross_entropy(work(input_ids=x).logits[:, :-1].reshape(-1, work.config.vocab_size),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
            spent = time.perf_counter() - step_started
            time.sleep(spent * (1 - self.config.cpu_share) / self.config.cpu_share)
        work.eval()
        candidate = {k: v.detach().clone() for k, v in work.state_dict().items()}
        live = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        scores = {name: acceptance(work, weights, held) for name, weights in
                  (("before", live), ("shipped", self.shipped), ("candidate", candidate))}
        best = max(("before", "candidate", "shipped"), key=lambda k: (scores[k], k == "before"))  # a tie keeps live
        outcome = {"before": "kept", "candidate": "adopted", "shipped": "reverted"}[best]
        seconds = time.perf_counter() - started
        with self._lock:
            self.seconds += seconds
            if outcome != "kept":
                self.pending = candidate if outcome == "adopted" else self.shipped
        update = Update(self.version + (outcome != "kept"), outcome, scores["before"], scores["candidate"], scores["shipped"],
                        scores[best], len(recent), len(held), round(seconds, 3))
        self.updates.append(update)
        self.log(f"adapt: {outcome} (held-back greedy acceptance: live {update.before:.3f}, candidate "
                 f"{update.candidate:.3f}, shipped {update.shipped:.3f}) in {seconds:.1f} s")
        return update

    def _batch(self, train: list[_Recent]) -> tuple[torch.Tensor, torch.Tensor]:
        """Windows of at most ``seq_len`` tokens ending in each sampled request's generated text,
        right-padded; labels are the generated tokens (-100 elsewhere)."""
        rows = []
        for i in self._rng.integers(0, len(train), self.config.batch):
            r = train[int(i)]
            end = int(self._rng.integers(r.prompt_len + 1, r.ids.size + 1))  # the window holds at least one generated token
            start = max(0, end - self.config.seq_len)
            labels = r.ids[start:end].copy()
            labels[: max(0, r.prompt_len - start)] = -100
            rows.append((r.ids[start:end], labels))
        width = max(len(x) for x, _ in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long)
        y = torch.full((len(rows), width), -100, dtype=torch.long)
        for j, (ids, labels) in enumerate(rows):
            x[j, : len(ids)], y[j, : len(ids)] = torch.from_numpy(ids), torch.from_numpy(labels)
        return x, y

    def swap(self) -> bool:
        """Put :attr:`pending` live (in place: the drafting structures keep their tensors); call it
        on the drafting thread when no request holds a draft KV slot. True if it did."""
        with self._lock:
            weights, self.pending = self.pending, None
        if weights is None:
            return False
        self.model.load_state_dict(weights)  # copies into the live tensors, in their dtype
        self.version += 1
        if self.config.dir is not None:
            self._persist(Path(self.config.dir), weights)
        return True

    # ------------------------------------------------------------------ persistence

    def _persist(self, where: Path, weights: dict[str, torch.Tensor]) -> None:
        where.mkdir(parents=True, exist_ok=True)
        tmp = where / "adapted.pt.tmp"
        torch.save(weights, tmp)
        os.replace(tmp, where / "adapted.pt")
        manifest = {"base": self.base, "version": self.version, "updates": [asdict(u) for u in self.updates]}
        (where / "adapted.json.tmp").write_text(json.dumps(manifest, indent=1))
        os.replace(where / "adapted.json.tmp", where / "adapted.json")

    def _restore(self, where: Path) -> None:
        try:
            manifest = json.loads((where / "adapted.json").read_text())
        except FileNotFoundError:
            return
        if manifest.get("base") != self.base:
            self.log(f"adapt: {where} holds weights adapted from another draft; starting from the shipped weights")
            return
        self.model.load_state_dict(torch.load(where / "adapted.pt", map_location="cpu", weights_only=True))
        self.version = int(manifest["version"])
        self.updates = [Update(**u) for u in manifest.get("updates", [])]
        self.log(f"adapt: restored version {self.version} from {where}")


@torch.inference_mode()
def acceptance(model: torch.nn.Module, weights: dict[str, torch.Tensor] | None, requests: Sequence[_Recent]) -> float:
    """Greedy acceptance of ``model`` (with ``weights`` loaded, if given) on ``requests``: the share
    of their generated positions where its most likely token is the committed one."""
    if weights is not None:
        model.load_state_dict(weights)
    hits, total, device = 0, 0, next(model.parameters()).device
    for r in requests:
        x = torch.from_numpy(r.ids)[None].to(device)
        guess = model(input_ids=x).logits[0, r.prompt_len - 1 : -1].argmax(-1)
        hits += int((guess == x[0, r.prompt_len :]).sum())
        total += r.ids.size - r.prompt_len
    return round(hits / total, 4) if total else 0.0


def _digest(weights: dict[str, torch.Tensor]) -> str:
    """A fingerprint of a draft's weights (which adapted weights may be loaded onto)."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].float().numpy().tobytes())
    return h.hexdigest()

