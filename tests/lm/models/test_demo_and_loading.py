import json

import pytest
import torch

from goodspeed.launch.cli import main
from goodspeed.lm.models import demo
from goodspeed.lm.models.corpus import load_corpus, stdlib_files
from goodspeed.lm.models.fingerprint import tokenizer_fingerprint
from goodspeed.lm.models.loading import ModelLoadError, load_causal_lm
from goodspeed.lm.models.train import ModelRecipe

TOY = (
    ModelRecipe("target", "target", layers=1, hidden=32, steps=3, seed=1, batch=2, seq_len=32),
    ModelRecipe("draft-a", "draft", layers=1, hidden=16, steps=2, seed=2, batch=2, seq_len=32),
    ModelRecipe("draft-b", "draft", layers=1, hidden=32, steps=2, seed=3, batch=2, seq_len=32, distill=True),
)


@pytest.fixture
def toy_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GOODSPEED_CACHE", str(tmp_path))
    manifest = demo.build_demo(progress=False, log=lambda *_: None, recipes=TOY, max_corpus_bytes=300_000)
    return tmp_path, manifest


def test_corpus_skips_tests_and_is_deterministic():
    files = stdlib_files()
    assert files and not any("test" in p.parts for p in files)
    a, b = load_corpus(200_000), load_corpus(200_000)
    assert a.digest == b.digest and a.heldout_text and a.train_text  # tiny corpora still hold one file out
    full = load_corpus()
    assert 0.01 < len(full.heldout_text) / len(full.train_text) < 0.15  # every 20th file


def test_toy_build_lists_loads_and_is_reused(toy_cache, capsys):
    root, manifest = toy_cache
    listed = demo.list_models()
    assert [m["name"] for m in listed] == ["target", "draft-a", "draft-b"]
    assert all({"name", "path", "params", "role"} <= set(m) for m in listed)
    assert 0 <= listed[1]["acceptance"] <= 1
    loaded = load_causal_lm("demo:draft-b", dtype="float64")
    target = load_causal_lm("demo:target")
    assert loaded.model.dtype == torch.float64 and loaded.fingerprint == target.fingerprint
    assert loaded.num_params == listed[2]["params"]
    ids = target.tokenizer("def f(x):\n    return x")["input_ids"]
    assert target.tokenizer.decode(ids) == "def f(x):\n    return x"
    # Current cache: reused, not rebuilt.
    assert demo.build_demo(progress=False, log=lambda *_: None, recipes=TOY, max_corpus_bytes=300_000) == manifest
    assert main(["models", "list", "--json"]) == 0
    assert [m["name"] for m in json.loads(capsys.readouterr().out)] == ["target", "draft-a", "draft-b"]


def test_different_corpus_or_recipes_trigger_rebuild(toy_cache):
    _, manifest = toy_cache
    other_corpus = demo.build_demo(progress=False, log=lambda *_: None, recipes=TOY, max_corpus_bytes=50_000)
    assert other_corpus["corpus_digest"] != manifest["corpus_digest"]
    other_recipes = demo.build_demo(progress=False, log=lambda *_: None, recipes=TOY[:2], max_corpus_bytes=50_000)
    assert other_recipes["corpus_digest"] == other_corpus["corpus_digest"]
    assert other_recipes["recipes_digest"] != other_corpus["recipes_digest"]
    assert [m["name"] for m in demo.list_models()] == ["target", "draft-a"]


def test_missing_demo_and_bad_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("GOODSPEED_CACHE", str(tmp_path))
    with pytest.raises(demo.DemoNotBuiltError, match="build-demo"):
        load_causal_lm("demo:target")
    with pytest.raises(ModelLoadError):
        load_causal_lm(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="dtype"):
        load_causal_lm("demo:target", dtype="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="CUDA"):
            load_causal_lm("demo:target", device="cuda")
    from goodspeed.lm.models.loading import ensure_models

    built = []  # a typo in a demo name fails before the (minutes-long) demo build is even started
    monkeypatch.setattr(demo, "build_demo", lambda **kw: built.append(kw))
    with pytest.raises(ModelLoadError, match="no demo model 'draft-huge' \\(known: target, draft-tiny"):
        ensure_models(["demo:target", "demo:draft-huge"])
    assert built == []


def test_awq_checkpoint_without_backend_names_the_extra(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    config.quantization_config = {"quant_method": "awq", "bits": 4}
    config.save_pretrained(tmp_path)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"goodspeed\[awq\]"):
        load_causal_lm(str(tmp_path))


def test_fingerprint_tells_tokenizers_apart(toy_cache):
    tok = load_causal_lm("demo:target").tokenizer
    other = demo.train_tokenizer("completely different text " * 200, vocab_size=300)
    assert tokenizer_fingerprint(tok) == tokenizer_fingerprint(tok)
    assert tokenizer_fingerprint(tok) != tokenizer_fingerprint(other)
