"""A draft that learns the traffic it drafts for (goodspeed.lm.models.adapt), on a toy pair whose
draft handles that traffic poorly: fine-tuning on the committed text raises held-back acceptance;
the guard refuses a worse candidate and reverts to the shipped weights when they are better; kept
traffic stays bounded; adopted weights persist onto the same draft only."""

import pytest
import torch

from goodspeed.lm.decoding.draft_source import draft_model
from goodspeed.lm.decoding.lookup import LookupDraft
from goodspeed.lm.models.adapt import DraftAdapter, acceptance
from goodspeed.lm.models.adapt_config import AdaptConfig
from goodspeed.lm.runtime.batch_draft import BatchDraftModel
from modelkit import copy_of, domain_traffic, far_pair, perturbed

VOCAB, NEW = 48, 16


@pytest.fixture(scope="module")
def pair():
    return far_pair()


def test_fine_tuning_on_the_traffic_raises_held_back_acceptance(pair):
    target, shipped = pair
    draft = copy_of(shipped)
    adapter = DraftAdapter(draft, AdaptConfig(every=16, steps=30, lr=3e-3, cpu_share=1.0))
    due = [adapter.record(p, ids) for p, ids in domain_traffic(target, 32, NEW)]
    assert due.count(True) == 2 and due[15] and due[31]  # every 16 requests
    update = adapter.fine_tune()
    assert update.outcome == "adopted" and update.candidate > update.before + 0.15, update
    assert update.before == update.shipped and adapter.version == 0 and adapter.pending is not None
    assert adapter.swap() and adapter.version == 1 and adapter.pending is None
    held = [r for r in adapter._recent if r.held_back]
    assert acceptance(draft, None, held) == pytest.approx(update.candidate, abs=0.02)  # the live draft is the candidate now
    assert len(held) == 8  # one request in four judges


def test_a_draft_with_a_pruned_head_adapts_and_stays_pruned(pair):
    """A draft with a pruned head (goodspeed.lm.models.draft_head), one token of the traffic off it,
    still learns the traffic, and after the swap the live draft keeps its head and its constant
    logit off it (that labels off the head leave the loss: test_draft_head)."""
    from goodspeed.lm.models.draft_head import head_tokens, prune_head

    target, shipped = pair
    traffic = domain_traffic(target, 32, NEW)
    seen = sorted({t for p, ids in traffic for t in ids[p:]})
    keep = [t for t in range(VOCAB) if t != seen[0]]  # one token the target writes is off the head
    draft = prune_head(copy_of(shipped), keep)
    adapter = DraftAdapter(draft, AdaptConfig(every=16, steps=30, lr=3e-3, cpu_share=1.0))
    for p, ids in traffic:
        adapter.record(p, ids)
    update = adapter.fine_tune()
    assert update.outcome == "adopted" and update.candidate > update.before + 0.1, update
    assert adapter.swap() and head_tokens(draft).tolist() == keep
    with torch.inference_mode():
        logits = draft(input_ids=torch.tensor([traffic[0][1]])).logits
    assert torch.isfinite(logits).all() and (logits[..., seen[0]] == logits[..., seen[0]].min()).all()


def test_the_guard_refuses_a_worse_candidate_and_reverts_to_better_shipped_weights(pair):
    target = pair[0]
    shipped = perturbed(target, 0.05, 7)  # a good draft: a wild fine-tune can only lose
    draft = copy_of(shipped)
    wild = DraftAdapter(draft, AdaptConfig(every=8, steps=20, lr=5.0, cpu_share=1.0))  # a learning rate that ruins it
    for p, ids in domain_traffic(target, 8, NEW):
        wild.record(p, ids)
    update = wild.fine_tune()
    assert update.outcome == "kept" and update.candidate < update.before and wild.pending is None
    assert all(torch.equal(v, shipped.state_dict()[k]) for k, v in draft.state_dict().items())  # untouched
    # Live weights worse than the shipped ones (here: ruined by hand) are reverted to them
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 3 * p.std())
    update = wild.fine_tune()
    assert update.outcome == "reverted" and update.after == update.shipped > update.before
    assert wild.swap() and all(torch.equal(v, shipped.state_dict()[k]) for k, v in draft.state_dict().items())


def test_kept_traffic_is_bounded(pair):
    target, shipped = pair
    adapter = DraftAdapter(copy_of(shipped), AdaptConfig(every=1, keep=8, keep_tokens=100))
    for p, ids in domain_traffic(target, 20, NEW):
        adapter.record(p, ids)
    assert adapter.kept_requests <= 8 and adapter.kept_tokens <= 100
    assert not adapter.record(6, list(range(6)))  # a request with no generated token teaches nothing


def test_adopted_weights_persist_onto_the_same_draft_only(pair, tmp_path):
    target, shipped = pair
    draft = copy_of(shipped)
    adapter = DraftAdapter(draft, AdaptConfig(every=16, steps=30, lr=3e-3, cpu_share=1.0, dir=str(tmp_path)))
    for p, ids in domain_traffic(target, 16, NEW):
        adapter.record(p, ids)
    assert adapter.fine_tune().outcome == "adopted" and adapter.swap()
    again = copy_of(shipped)
    restored = DraftAdapter(again, AdaptConfig(dir=str(tmp_path)))
    assert restored.version == 1 and len(restored.updates) == 1
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in again.state_dict().items())
    told = []
    other = copy_of(perturbed(target, 1.0, 8))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    assert DraftAdapter(other, AdaptConfig(dir=str(tmp_path)), log=told.append).version == 0
    assert "another draft" in told[0] and all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_settings_are_checked_and_a_lookup_alone_cannot_adapt(pair):
    with pytest.raises(ValueError, match="cpu_share"):
        AdaptConfig(cpu_share=0)
    with pytest.raises(ValueError, match="keep"):
        AdaptConfig(keep=2)
    with pytest.raises(ValueError, match="a lookup alone has no draft model"):
        draft_model(LookupDraft(VOCAB))
    model = copy_of(pair[1])
    assert draft_model(BatchDraftModel(model)) is model
