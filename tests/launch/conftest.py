"""Shared fixtures of the launch tests."""

import json

import numpy as np
import pytest


@pytest.fixture
def fake_experiment():
    """Write an experiment directory like `goodspeed experiment` does, from known drafters:
    drafter ``i`` accepts each position with probability ``0.3 + 0.15 i``, ``S = 6`` every round."""
    from goodspeed.launch.experiments.report import policy_metrics

    def write(path, names, policies=("fixed",), rounds=300, seed=5):
        rng, report = np.random.default_rng(seed), {}
        for policy in policies:
            rows, alpha = [], dict.fromkeys(names, 0.5)
            for t in range(rounds):
                for i, name in enumerate(names):
                    s = 6
                    m = next((k for k in range(s) if rng.random() >= 0.3 + 0.15 * i), s)
                    alpha[name] = 0.8 * alpha[name] + 0.2 * m / s
                    rows.append({"policy": policy, "round": t, "ts": t * 0.01, "drafter": name, "S": s, "accepted": m,
                                 "x": m + 1, "alpha_hat": alpha[name], "X": 2.0, "S_next": s, "eta": 0.2,
                                 "drafter_receive_s": 0.01, "receive_s": 0.01, "verify_s": 0.005, "send_s": 0.0005})
            (path / policy).mkdir(parents=True)
            (path / policy / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            report[policy] = policy_metrics(rows)
        (path / "report.json").write_text(json.dumps(report))
        return path

    return write


@pytest.fixture
def launched(tmp_path):
    """The settings a verifier started by the launcher serves on: ``verifier_command`` writes its
    spec file, and the daemon's own argument handling (``cli.verifier_settings``) reads it back."""
    from goodspeed.launch.cli import verifier_settings
    from goodspeed.launch.cluster.local import CLI, verifier_command

    def read(spec, workdir=None):
        workdir = workdir or tmp_path / "verifier-spec"
        workdir.mkdir(parents=True, exist_ok=True)
        argv = verifier_command(spec, workdir)[len(CLI):]
        assert argv == ["verifier", "--spec", str(workdir / "verifier.toml")]
        return verifier_settings(argv[1:])

    return read


@pytest.fixture
def launched_drafter(tmp_path):
    """The settings a drafter started by the launcher runs on, and its parsed arguments:
    ``drafter_command`` writes its spec file, and the node's own argument handling
    (``cli.drafter_settings``) reads it back."""
    from goodspeed.launch.cli import drafter_settings
    from goodspeed.launch.cluster.local import CLI, drafter_command

    def read(spec, prompts=None, address="127.0.0.1:1"):
        workdir = tmp_path / "drafter-spec"
        workdir.mkdir(parents=True, exist_ok=True)
        argv = drafter_command(spec, address, prompts or spec.prompt_path(), workdir / "o.jsonl", workdir)[len(CLI):]
        assert argv[:3] == ["drafter", "--spec", str(workdir / f"{spec.name}.toml")]
        return drafter_settings(argv[1:])

    return read
