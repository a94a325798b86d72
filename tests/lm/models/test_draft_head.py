"""A draft's pruned output head (goodspeed.lm.models.draft_head): on its tokens it computes the full
head's logits, elsewhere a constant that a softmax turns into exactly zero, so q is a distribution
over the whole vocabulary; it trains, follows in-place weight updates, saves as an ordinary model
(any other loader gets the full head back) and loads pruned through the project; greedy
speculation with it is the target's own greedy decoding."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from goodspeed.drafter.runner import DraftRunner
from goodspeed.launch.cluster.inprocess import InProcessDrafter, run_inprocess
from goodspeed.lm.decoding.params import SamplingParams
from goodspeed.lm.models.draft_head import (HEAD_FILE, OFF_HEAD_LOGIT, PrunedHead, apply_head_file, head_tokens, off_head_to_ignore,
                                           prune_head, write_head_file)
from goodspeed.lm.models.loading import load_causal_lm
from goodspeed.verifier.engine import EngineConfig, VerificationEngine
from modelkit import copy_of, greedy_reference, perturbed, save_models, tiny_llama

VOCAB = 48
KEEP = list(range(0, VOCAB, 2)) + [5, 7]


def test_the_head_computes_its_tokens_exactly_and_nothing_else():
    full = tiny_llama(0, vocab=VOCAB, dtype=torch.float32)
    pruned = prune_head(copy_of(full), KEEP)
    x = torch.randint(0, VOCAB, (2, 7))
    with torch.inference_mode():
        a, b = full(input_ids=x).logits, pruned(input_ids=x).logits
    keep = torch.tensor(sorted(KEEP))
    assert isinstance(pruned.lm_head, PrunedHead) and torch.equal(head_tokens(pruned), keep)
    torch.testing.assert_close(b[..., keep], a[..., keep], rtol=0, atol=1e-6)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[keep] = False
    assert (b[..., off] == OFF_HEAD_LOGIT).all()
    q = torch.softmax(b.double() / 0.7, -1)  # a distribution over the whole vocabulary, zero off the head
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 7, dtype=torch.float64))
    assert (q[..., off] == 0).all() and (q[..., keep] > 0).all()
    # A grammar that allows only tokens off the head (its mask: -inf elsewhere): q is uniform over them
    allowed = torch.nonzero(off).flatten()[:3]
    masked = torch.full_like(b, -torch.inf)
    masked[..., allowed] = b[..., allowed]
    torch.testing.assert_close(torch.softmax(masked.double(), -1)[..., allowed], torch.full((2, 7, 3), 1 / 3, dtype=torch.float64))
    assert set(pruned.state_dict()) == set(full.state_dict())  # the weight keeps its name: state dicts interchange


def test_it_trains_and_follows_in_place_weight_updates():
    model = prune_head(tiny_llama(1, vocab=VOCAB, dtype=torch.float32), KEEP)
    x = torch.randint(0, VOCAB, (1, 5))
    with torch.inference_mode():
        before = model(input_ids=x).logits.clone()
    cached = model.lm_head._cache.data_ptr()
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(new)  # what an adopted fine-tune does (DraftAdapter.swap): the cached rows must follow
    assert model.lm_head._cache.data_ptr() == cached  # refreshed in place: a captured CUDA graph reads the new rows
    torch.testing.assert_close(model.lm_head._cache, new["lm_head.weight"][sorted(set(KEEP))])
    with torch.inference_mode():
        after = model(input_ids=x).logits
    reference = prune_head(tiny_llama(1, vocab=VOCAB, dtype=torch.float32), KEEP)
    reference.load_state_dict(new)
    with torch.inference_mode():
        torch.testing.assert_close(after, reference(input_ids=x).logits)
    assert not torch.equal(after, before)
    model.train()
    model(input_ids=x).logits[..., KEEP].sum().backward()
    grad = model.lm_head.weight.grad
    assert grad[KEEP].abs().sum() > 0 and grad[[1, 3]].abs().sum() == 0  # rows off the head get no gradient


def test_labels_off_the_head_are_ignored_by_a_fine_tune():
    model = prune_head(tiny_llama(1, vocab=VOCAB, dtype=torch.float32), KEEP)
    labels = torch.tensor([[0, 1, 2, -100, 5, 9]])
    assert off_head_to_ignore(model, labels).tolist() == [[0, -100, 2, -100, 5, -100]]
    assert off_head_to_ignore(tiny_llama(1, vocab=VOCAB), labels) is labels  # a full head: unchanged


def test_tokens_must_lie_in_the_vocabulary():
    with pytest.raises(ValueError, match="must lie in"):
        prune_head(tiny_llama(1, vocab=VOCAB), [3, VOCAB])
    with pytest.raises(ValueError, match="must lie in"):
        prune_head(tiny_llama(1, vocab=VOCAB), [])


def test_saved_with_its_file_it_loads_pruned_here_and_full_elsewhere(tmp_path):
    paths = save_models(tmp_path, {"draft": tiny_llama(2, vocab=VOCAB, dtype=torch.float32)}, VOCAB)
    assert not apply_head_file(tiny_llama(2, vocab=VOCAB), paths["draft"])  # no file: nothing to do
    write_head_file(paths["draft"], KEEP, coverage={"chat": 0.9})
    assert json.loads((tmp_path / "draft" / HEAD_FILE).read_text())["tokens"] == sorted(set(KEEP))
    loaded = load_causal_lm(str(paths["draft"]))
    assert torch.equal(head_tokens(loaded.model), torch.tensor(sorted(set(KEEP))))
    plain = AutoModelForCausalLM.from_pretrained(paths["draft"])  # the fallback: the whole vocabulary's head
    assert head_tokens(plain) is None
    x = torch.randint(0, VOCAB, (1, 6))
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(input_ids=x).logits[..., KEEP], plain(input_ids=x).logits[..., KEEP])


def test_greedy_speculation_with_a_pruned_draft_is_the_targets_greedy_decoding():
    target = tiny_llama(3, vocab=VOCAB)
    draft = prune_head(perturbed(target, 0.3, 4), KEEP)  # the target's greedy path leaves the head at times
    prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10]]
    engine = VerificationEngine(target, EngineConfig(budget=12, max_draft_len=4))
    drafters = [InProcessDrafter(f"d{i}", DraftRunner(draft), [p], SamplingParams(temperature=0.0), max_new_tokens=24)
                for i, p in enumerate(prompts)]
    results = run_inprocess(engine, drafters)
    for d, p in zip(drafters, prompts):
        assert d.outputs == [greedy_reference(target, p, 24)]
    reference = [t for p in prompts for t in greedy_reference(target, p, 24)]
    assert any(t not in KEEP for t in reference)  # the draft could not propose every token: the verifier supplied them
    assert sum(v.num_accepted for r in results for v in r.verdicts.values()) > 0
