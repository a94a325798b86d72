"""Draft distillation on a toy target: the candidate softmax is the full one when it covers the
vocabulary; a build writes a loadable draft on the target's tokenizer with its measurements, with
a pruned head where the recipe asks for one; an interrupted build resumes from its finished stages
and ends with the draft an uninterrupted one writes; the default recipe's digest stays put."""

import dataclasses
import json

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
    assert report["device"] == distill.build_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_held_out_acceptance_counts_generated_positions_only():
    target = tiny_llama(0, vocab=VOCAB, dtype=torch.float32)
    ids = np.arange(10, dtype=np.int64)
    same = distill.held_out_acceptance(target, target, [(4, ids)])
    assert same == {"greedy": 1.0, "t0.8": 1.0, "t1": 1.0}
    other = distill.held_out_acceptance(target, tiny_llama(5, vocab=VOCAB, dtype=torch.float32), [(4, ids)])
    assert other["t1"] < 1.0


def test_the_default_recipes_digest_is_the_one_built_drafts_recorded():
    # Fields added later (head_tokens, ...) at their defaults leave it alone, so no cache rebuilds for them.
    assert distill.recipe_digest(distill.DRAFT_RECIPE) == "3837b4004f8a99e3d44ff25b939bfbb5978b86d9caf7d7b2f22f3304be5794ac"
    assert distill.recipe_digest(dataclasses.replace(distill.DRAFT_RECIPE, head_tokens=8)) != distill.recipe_digest(distill.DRAFT_RECIPE)


def test_a_recipe_with_a_head_writes_a_pruned_draft(target_dir, tmp_path):
    from goodspeed.lm.models.draft_head import HEAD_FILE, head_tokens

    recipe = dataclasses.replace(TOY, head_tokens=64)
    report = distill.build_draft(target_dir, tmp_path / "draft", recipe, progress=False, log=lambda *_: None)
    head = json.loads((tmp_path / "draft" / HEAD_FILE).read_text())
    tok = AutoTokenizer.from_pretrained(target_dir)
    assert 64 <= len(head["tokens"]) <= 64 + len(tok.all_special_ids) and set(tok.all_special_ids) <= set(head["tokens"])
    assert report["head"]["tokens"] == len(head["tokens"]) and head["coverage"] == report["head"]["coverage"]
    assert set(report["head"]["coverage"]) == {"chat", "code"} and all(0 < c <= 1 for c in report["head"]["coverage"].values())
    loaded = load_causal_lm(str(tmp_path / "draft"))
    assert head_tokens(loaded.model).tolist() == head["tokens"]
    assert [p.name for p in (tmp_path / "draft.build").iterdir()] == ["transcripts"]  # kept for a recipe changing its training only


def test_frequent_tokens_are_the_transcripts_first_and_the_special_ones():
    generated = np.array([5, 5, 5, 7, 7, 9])
    corpus = np.array([1] * 100)
    assert distill.frequent_tokens(generated, corpus, 12, 2, always=[0]) == [0, 5, 7]  # 1's corpus weight is a quarter
    assert distill.frequent_tokens(generated, corpus, 12, 3, always=[]) == [1, 5, 7]


def test_an_interrupted_build_resumes_and_writes_the_same_draft(target_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    recipe = dataclasses.replace(TOY, head_tokens=64)
    monkeypatch.setattr(distill, "CHECKPOINT_EVERY", 2)
    quiet = dict(progress=False, log=lambda *_: None)
    whole = distill.build_draft(target_dir, tmp_path / "whole", recipe, **quiet)

    sample, calls = distill._Windows.sample, []

    def killed_at_the_fourth_batch(self, rows):
        calls.append(rows)
        if len(calls) == 4:
            raise KeyboardInterrupt  # as a kill would, in the next-token phase's fourth step
        return sample(self, rows)

    monkeypatch.setattr(distill._Windows, "sample", killed_at_the_fourth_batch)
    with pytest.raises(KeyboardInterrupt):
        distill.build_draft(target_dir, tmp_path / "resumed", recipe, **quiet)
    work = tmp_path / "resumed.build"
    assert torch.load(work / "pretrain.pt", weights_only=False)["step"] == 2 and not (tmp_path / "resumed").exists()
    assert list((work / "transcripts").glob("*.npz"))

    again = []
    monkeypatch.setattr(distill._Windows, "sample", lambda self, rows: again.append(rows) or sample(self, rows))
    monkeypatch.setattr(distill, "target_transcripts", lambda *a, **k: pytest.fail("the transcripts were written again"))
    logged = []
    resumed = distill.build_draft(target_dir, tmp_path / "resumed", recipe, progress=False, log=logged.append)
    assert any("resuming" in line for line in logged) and [p.name for p in work.iterdir()] == ["transcripts"]
    assert again == [recipe.batch] * (recipe.pretrain_steps - 2) + [recipe.teacher_windows]  # steps 3 to 6, then the labels' windows
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed["acceptance"] == whole["acceptance"]


def test_stages_of_another_recipe_are_not_reused_and_its_transcripts_only_where_they_match(target_dir, tmp_path, monkeypatch):
    work = tmp_path / "draft.build"
    (work / "transcripts").mkdir(parents=True)
    (work / "recipe").write_text("another recipe's digest")
    (work / "transcripts" / "00000.npz").write_bytes(b"not an npz file")  # reusing it would fail the build
    torch.save({"model": {}, "step": 3}, work / "pretrain.pt")  # another recipe's checkpoint: loading it would fail
    quiet = dict(progress=False, log=lambda *_: None)
    distill.build_draft(target_dir, tmp_path / "draft", TOY, **quiet)
    assert (tmp_path / "draft" / "config.json").exists()
    # A recipe that changes its training only reuses the transcripts; one that changes them writes them again
    monkeypatch.setattr(distill, "target_transcripts", lambda *a, **k: pytest.fail("the transcripts were written again"))
    distill.build_draft(target_dir, tmp_path / "draft", dataclasses.replace(TOY, distill_steps=6), **quiet)
    with pytest.raises(pytest.fail.Exception, match="written again"):
        distill.build_draft(target_dir, tmp_path / "draft", dataclasses.replace(TOY, new_tokens=7), **quiet)
