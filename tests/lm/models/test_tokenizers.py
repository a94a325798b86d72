"""A tokenizer without its model (goodspeed.lm.models.tokenizers.load_tokenizer): the class the
directory's tokenizer_config.json names, which is the one AutoTokenizer picks, so a node drafting
by lookup alone tokenizes as the verifier does; a path that holds no tokenizer is a clear error."""

import json

import pytest
from transformers import AutoTokenizer

from goodspeed.lm.models.model_dirs import ModelLoadError
from goodspeed.lm.models.tokenizers import load_tokenizer, named_class
from goodspeed.lm.models.fingerprint import tokenizer_fingerprint
from modelkit import chat_pair

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):\n    return {'a': x}"}]


def test_the_tokenizer_loads_as_autotokenizer_loads_it(tmp_path):
    chat_pair()[2].save_pretrained(tmp_path)
    named = json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"]
    light, fingerprint = load_tokenizer(str(tmp_path))
    auto = AutoTokenizer.from_pretrained(tmp_path)
    assert type(light) is type(auto) and type(light).__name__ in (named, named.removesuffix("Fast"))
    assert fingerprint == tokenizer_fingerprint(auto)
    assert (light.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
            == auto.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    text = "x = {'key': [1, 2, 3]}  # déjà vu"
    assert light(text)["input_ids"] == auto(text)["input_ids"] and light.decode(auto(text)["input_ids"]) == text


def test_a_directory_that_names_no_class_loads_through_autotokenizer(tmp_path):
    chat_pair()[2].save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["tokenizer_class"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert named_class(tmp_path) is None  # so load_tokenizer takes AutoTokenizer's path
    light, fingerprint = load_tokenizer(str(tmp_path))
    assert fingerprint == tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path))


def test_a_path_without_a_tokenizer_is_an_error_that_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer of"):
        load_tokenizer(str(tmp_path / "nothing-here"))


@pytest.mark.real
def test_the_real_targets_tokenizer_loads_as_autotokenizer_loads_it():
    from goodspeed.lm.models import real
    from goodspeed.lm.models.tokenizers import resolve_model_path

    if not real.is_built("smollm2-135m"):
        pytest.skip("needs the real model: goodspeed models get smollm2-135m")
    light, fingerprint = load_tokenizer("real:smollm2-135m")
    auto = AutoTokenizer.from_pretrained(resolve_model_path("real:smollm2-135m"))
    assert type(light) is type(auto) and fingerprint == tokenizer_fingerprint(auto)
    assert (light.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
            == auto.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])


def test_a_demo_models_directory_is_found_without_importing_torch(tmp_path):
    """``demo:<name>`` resolves (or is refused as not built) without the demo builder's imports,
    which reach torch: an edge node drafting by lookup with a demo tokenizer stays light. Checked
    in a fresh interpreter, where nothing else imported torch first."""
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom goodspeed.lm.models.tokenizers import resolve_model_path\n"
            "from goodspeed.lm.models.model_dirs import DemoNotBuiltError\n"
            "try:\n    resolve_model_path('demo:target')\nexcept DemoNotBuiltError as exc:\n    print('refused:', exc)\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GOODSPEED_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["refused: no demo model 'target' (run `goodspeed models build-demo` first)", "False"]
