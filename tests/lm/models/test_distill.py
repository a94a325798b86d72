"""Draft distillation on a toy target: the candidate softmax is the full one when it covers the
vocabulary, and a build writes a loadable draft on the target's tokenizer with its measurements."""

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from goodspeed.lm.models import distill
from goodspeed.lm.models.loading import load_causal_lm
from modelkit import save_models, tiny_llama

VOCAB = 300
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
TOY = distill.DraftRecipe(hidden=16, layers=1, head_dim=8, kv_heads=1, pretrain_steps=6, distill_steps=4, teacher_windows=8, batch=4,
                          seq_len=16, negatives=32, top_k=4, code_prompts=8, code_prompt_chars=40, new_tokens=6, corpus_bytes=60_000)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = save_models(root, {"target": tiny_llama(0, vocab=VOCAB, dtype=torch.float32)}, VOCAB)
    tok = AutoTokenizer.from_pretrained(paths["target"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(paths["target"])
    return paths["target"]


def test_candidate_softmax_equals_the_full_softmax_over_the_whole_vocabulary():
    draft = tiny_llama(1, vocab=VOCAB, dtype=torch.float32)
    draft.config.tie_word_embeddings = True
    draft.lm_head.weight = draft.model.embed_tokens.weight
    x = torch.randint(0, VOCAB, (2, 9))
    full = torch.log_softmax(draft(input_ids=x).logits[:, :-1].float(), -1)
    logp, cand = distill._candidate_log_probs(draft, x, torch.arange(VOCAB), negatives=0, rng=np.random.default_rng(0))
    assert cand.tolist() == list(range(VOCAB))
    torch.testing.assert_close(logp, full, atol=1e-5, rtol=0)
    logp, _ = distill._candidate_log_probs(draft, x, torch.arange(VOCAB), negatives=0, rng=np.random.default_rng(0),
                                           dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = torch.log_softmax(draft(input_ids=x).logits[:, :-1].float(), -1)
    torch.testing.assert_close(logp, full, atol=2e-2, rtol=0)  # both through bf16 autocast


def test_chat_requests_are_deterministic_and_varied():
    a, b = distill.chat_requests(0), distill.chat_requests(0)
    assert a == b and len(set(a)) == len(a) > 80
    assert distill.chat_requests(1) != a


def test_build_writes_a_draft_on_the_targets_tokenizer(target_dir, tmp_path):
    out = tmp_path / "draft"
    report = distill.build_draft(target_dir, out, TOY, progress=False, log=lambda *_: None)
    assert not (tmp_path / "draft.partial").exists()
    draft, target = load_causal_lm(str(out)), load_causal_lm(str(target_dir))
    assert draft.fingerprint == target.fingerprint
    assert draft.model.config.num_hidden_layers == 1 and draft.model.config.hidden_size == 16
    assert report["draft_params"] == draft.num_params and report["target_params"] == target.num_params
    for key in ("greedy_acceptance", "acceptance_t08", "acceptance", "chat_greedy_acceptance", "chat_acceptance_t08", "chat_acceptance"):
        assert 0.0 <= report["acceptance"][key] <= 1.0, key
    assert distill.recipe_digest(TOY) != distill.recipe_digest(distill.DRAFT_RECIPE)
    assert report["precision"] == str(distill.build_precision()).removeprefix("torch.")


def test_held_out_acceptance_counts_generated_positions_only():
    target = tiny_llama(0, vocab=VOCAB, dtype=torch.float32)
    ids = np.arange(10, dtype=np.int64)
    same = distill.held_out_acceptance(target, target, [(4, ids)])
    assert same == {"greedy": 1.0, "t0.8": 1.0, "t1": 1.0}
    other = distill.held_out_acceptance(target, tiny_llama(5, vocab=VOCAB, dtype=torch.float32), [(4, ids)])
    assert other["t1"] < 1.0
