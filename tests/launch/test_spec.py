from pathlib import Path

import pytest

from goodspeed.launch.spec import DEFAULT_SPEC, SpecError
from goodspeed.launch.spec_files import load_spec


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


def test_count_expands_to_distinct_processes(tmp_path, launched, launched_drafter):
    spec = load_spec(write(tmp_path, '[verifier]\ntarget="x"\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\ncount=3\n'))
    assert [d.name for d in spec.expanded_drafters()] == ["e-0", "e-1", "e-2"]
    assert [d.seed for d in spec.expanded_drafters()] == [None] * 3  # streams differ by name, not by seed
    node, args = launched_drafter(spec.expanded_drafters()[0])
    assert (node.name, args.verifier) == ("e-0", "127.0.0.1:1")
    assert launched(spec.verifier).port == 0  # a free one, read back from the log
    fixed = load_spec(write(tmp_path, '[verifier]\ntarget="x"\nport=6100\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\n'))
    assert launched(fixed.verifier).port == 6100


@pytest.mark.parametrize(
    "text,match",
    [
        ('[verifier]\nbudgt=3\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n', "unknown keys \\['budgt'\\] \\(did you mean 'budget'\\?\\)"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\nxyzzy=1\n', "unknown keys \\['xyzzy'\\]; known"),
        ('[experiment]\npolicies=["goodspeeed"]\n[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n',
         "unknown policies \\['goodspeeed'\\]"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="nowhere"\n', "neither a shipped set"),
        ('[verifier]\n[[drafters]]\nname="a b"\ndraft="d"\nprompts="code"\n', "drafter name 'a b' must be 1-64 characters"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\ntemperature=-1\n', "temperature must be finite and >= 0"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\ntemperature=1.0\ntop_p=0\n', "top_p must lie in"),
        ('[verifier]\n', "no \\[\\[drafters\\]\\]"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\n', "unique"),
        ('[verifier]\n[[drafters]]\nname="a"\nprompts="code"\n', "draft"),
        ('[verifier\n', "spec.toml"),
        ('[extra]\n', "unknown tables"),
        ('[verifier]\n[[drafters]]\nname="a"\ndraft="d"\nprompts="code"\nproposal_top_k=-1\n', "proposal_top_k must be"),
    ],
)
def test_bad_specs_name_the_problem(tmp_path, text, match):
    from goodspeed.launch.experiments.experiment import load_experiment

    with pytest.raises(SpecError, match=match):
        (load_experiment if text.startswith("[experiment]") else load_spec)(write(tmp_path, text))


def test_default_spec_file_ships_with_the_package():
    assert DEFAULT_SPEC.exists() and DEFAULT_SPEC.suffix == ".toml"


def test_every_shipped_spec_loads():
    from goodspeed.launch.experiments.experiment import SPECS_DIR, load_experiment

    shipped = sorted(SPECS_DIR.glob("*.toml"))
    assert len(shipped) >= 5
    for path in shipped:
        spec = load_experiment(path)[1] if "[experiment]" in path.read_text() else load_spec(path)
        assert spec.drafters, path


def test_one_root_seed_per_run(tmp_path, launched):
    """A spec's top-level seed is every process's root unless one sets its own; without one, the
    run draws a fresh root and passes it to all (so the summary can name it)."""
    text = '[verifier]\ntarget="x"\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\ncount=2\n[[drafters]]\nname="f"\ndraft="d"\nprompts="code"\nseed=9\n'
    seeded = load_spec(write(tmp_path, "seed = 42\n" + text)).seeded()
    assert seeded.seed == 42 and seeded.verifier.seed == 42
    assert [d.seed for d in seeded.expanded_drafters()] == [42, 42, 9]
    assert launched(seeded.verifier).seed == 42
    fresh = [load_spec(write(tmp_path, text)).seeded() for _ in range(2)]
    assert fresh[0].seed != fresh[1].seed and fresh[0].verifier.seed == fresh[0].seed
    assert launched(load_spec(write(tmp_path, text)).verifier).seed is None  # unresolved: the process draws its own
    with pytest.raises(SpecError, match="seed"):
        load_spec(write(tmp_path, "seed = -1\n" + text))


def test_the_metrics_endpoint_stays_on_loopback_unless_told(tmp_path, launched):
    spec = load_spec(write(tmp_path, '[verifier]\ntarget="x"\nhost="0.0.0.0"\nmetrics_port=9400\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\n'))
    assert launched(spec.verifier).metrics_host == "127.0.0.1"
    opened = load_spec(write(tmp_path, '[verifier]\ntarget="x"\nmetrics_port=9400\nmetrics_host="0.0.0.0"\n[[drafters]]\nname="e"\ndraft="d"\nprompts="code"\n'))
    assert launched(opened.verifier).metrics_host == "0.0.0.0"


def test_shipped_specs_are_named_by_stem(tmp_path, monkeypatch):
    from goodspeed.launch.spec import SPECS_DIR, spec_path

    assert spec_path("real-smollm2") == SPECS_DIR / "real-smollm2.toml"
    assert spec_path(None) is None
    with pytest.raises(SpecError, match="no-such-spec: neither a spec file nor a shipped spec \\(shipped: default, "):
        spec_path("no-such-spec")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real-smollm2").write_text("")  # a file of that name in the working directory wins
    assert spec_path("real-smollm2") == Path("real-smollm2")
    spec = load_spec(SPECS_DIR / "real-smollm2.toml")
    assert spec.verifier.target == "real:smollm2-135m" and {d.draft for d in spec.drafters} == {"real:smollm2-135m-draft"}
