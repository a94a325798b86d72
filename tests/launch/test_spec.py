import pytest

from goodspeed.launch.local import drafter_command, verifier_command
from goodspeed.launch.spec import DEFAULT_SPEC, SpecError, load_spec


def test_default_spec_is_valid_and_heterogeneous():
    spec = load_spec()
    assert spec.verifier.target == "demo:target"
    assert len(spec.drafters) >= 4 and len({d.draft for d in spec.drafters}) >= 3
    assert len({d.prompts for d in spec.drafters}) >= 4
    assert all(d.prompt_path().exists() for d in spec.drafters)


def write(tmp_path, text):
    path = tmp_path / "spec.toml"
    path.write_text(text)
    return path


def test_count_expands_to_distinct_processes(tmp_path):
    spec = load_spec(write(tmp_path, '[verifier]\ntarget="x"\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\ncount=3\n'))
    assert [d.name for d in spec.expanded_drafters()] == ["e-0", "e-1", "e-2"]
    assert [d.seed for d in spec.expanded_drafters()] == [0, 1, 2]
    cmd = drafter_command(spec.expanded_drafters()[0], "127.0.0.1:1", spec.drafters[0].prompt_path(), tmp_path / "o.jsonl")
    assert cmd[cmd.index("--verifier") + 1] == "127.0.0.1:1"
    assert verifier_command(spec.verifier)[verifier_command(spec.verifier).index("--port") + 1] == "0"
    fixed = load_spec(write(tmp_path, '[verifier]\ntarget="x"\nport=6100\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\n'))
    assert verifier_command(fixed.verifier)[verifier_command(fixed.verifier).index("--port") + 1] == "6100"


@pytest.mark.parametrize(
    "text,match",
    [
        ('[verifier]\nbudgt=3\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n', "unknown keys"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="nowhere"\n', "neither a shipped set"),
        ('[verifier]\n', "no \\[\\[drafters\\]\\]"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n', "unique"),
        ('[verifier]\n[[drafters]]\nname="a"\nprompts="code"\n', "draft"),
        ('[verifier\n', "spec.toml"),
        ('[extra]\n', "unknown tables"),
    ],
)
def test_bad_specs_name_the_problem(tmp_path, text, match):
    with pytest.raises(SpecError, match=match):
        load_spec(write(tmp_path, text))


def test_default_spec_file_ships_with_the_package():
    assert DEFAULT_SPEC.exists() and DEFAULT_SPEC.suffix == ".toml"


def test_every_shipped_spec_loads():
    from goodspeed.launch.experiment import SPECS_DIR, load_experiment

    shipped = sorted(SPECS_DIR.glob("*.toml"))
    assert len(shipped) >= 5
    for path in shipped:
        spec = load_experiment(path)[1] if "[experiment]" in path.read_text() else load_spec(path)
        assert spec.drafters, path
