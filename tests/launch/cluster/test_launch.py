import json
import os
import subprocess
import sys

import pytest

from goodspeed.launch.cli import main


@pytest.mark.slow
def test_default_launch_finishes_and_prints_its_summary(tmp_path, capsys):
    """The embedded default: builds the demo models if missing (~3 min), then ~1 min of serving."""
    assert main(["launch", "--out", str(tmp_path), "--no-live"]) == 0
    out = capsys.readouterr().out
    assert "tokens in" in out and "rounds" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["drafters"]) == 4
    for name, row in summary["drafters"].items():
        assert row["exit_code"] == 0 and row["requests"] > 0, name
        records = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert {"id", "prompt_ids", "token_ids", "text", "rounds", "drafted_tokens", "accepted_tokens", "wall_s"} <= set(records[0])


def test_live_table_rows_and_the_ray_backends_node_column():
    from goodspeed.launch.cluster.local import ClusterView, render_table

    class Proc:
        def __init__(self, returncode):
            self.returncode = returncode

        def poll(self):
            return self.returncode

    from goodspeed.launch.cluster.local import apply_line
    from goodspeed.verifier.records import DrafterRound, RoundRecord

    def record(ts, acceptance, goodput, next_len, gained):
        row = DrafterRound("a#1", "a", 3, 2, gained, acceptance, goodput, next_len, False, 0.01)
        return RoundRecord(0, 0.01, 0.02, 0.015, 0.001, 1, 8, (row,), ts=ts).to_json()

    view = ClusterView()
    apply_line(view, record(10.0, 0.5, 2.0, 4, 3))
    apply_line(view, record(12.0, 0.6, 2.5, 5, 3))
    procs = {"a": Proc(None), "b": Proc(1)}
    lines = render_table(view, procs, 5.0)
    assert lines[0] == "goodspeed launch:    5.0 s, 2 rounds" and "node" not in lines[1]
    assert lines[2].split() == ["a", "running", "0.600", "2.50", "5", "6", "3.0"]  # 6 tokens over ts 10 .. 12
    assert lines[3].split()[:3] == ["b", "exit", "1"]
    placed = render_table(view, procs, 5.0, {"a": {"node": "edge-1"}, "b": {"node": "edge-2"}})
    assert placed[1].endswith(" node") and placed[2].endswith(" edge-1") and placed[3].endswith(" edge-2")
    # A renamed field is an error the table shows, not a blank.
    apply_line(view, record(13.0, 0.6, 2.5, 5, 3).replace('"gained"', '"x"'))
    assert view.rounds == 2 and "missing ['gained']" in render_table(view, procs, 6.0)[-1]


def test_local_dry_run_prints_the_processes_and_address_needs_ray(capsys, tmp_path):
    assert main(["launch", "--dry-run", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("every process runs on this machine:") and "verifier --spec OUT/verifier.toml" in out
    assert 'target = "demo:target"' in out  # the file it would be handed
    assert out.count("drafter --spec OUT/") == out.count("--verifier VERIFIER_ADDRESS") == 4 and not (tmp_path / "run").exists()
    assert out.count("[[drafters]]") == 4  # each the file it would be handed
    assert main(["launch", "--address", "10.0.0.1:6379"]) == 2
    assert "--address is for --backend ray" in capsys.readouterr().err


def test_a_launch_makes_its_own_credentials(tmp_path, launched, launched_drafter):
    """Secure by default: a CA, server and client certificates (mutual TLS) and one token per
    [[drafters]] entry, hashes only in the verifier's file, each token in a 0600 file named on
    that drafter's command line."""
    import stat
    from dataclasses import replace
    from pathlib import Path

    from goodspeed.launch.cluster.local import with_run_credentials
    from goodspeed.launch.spec_files import load_spec
    from goodspeed.verifier.auth import TokenAuth

    secured = with_run_credentials(load_spec(), tmp_path)
    tokens_file = tmp_path / "auth" / "tokens.json"
    assert secured.verifier.auth_tokens == str(tokens_file)
    assert stat.S_IMODE((tmp_path / "auth").stat().st_mode) == 0o700
    served = launched(secured.verifier)
    assert served.auth_tokens == str(tokens_file)
    assert served.eta is None  # unset: the verifier uses the policy's own smoothing
    assert launched(replace(secured.verifier, eta=0.3)).eta == 0.3
    auth = TokenAuth.from_file(tokens_file)
    for d in secured.drafters:
        assert d.token_file == str(tmp_path / "auth" / f"{d.name}.token")
        assert stat.S_IMODE(Path(d.token_file).stat().st_mode) == 0o600
        token = Path(d.token_file).read_text().strip()
        assert token not in tokens_file.read_text()
        assert auth.identify((("authorization", f"Bearer {token}"),)).name == d.name
    for d in secured.expanded_drafters():  # count = n copies share their entry's token
        assert launched_drafter(d)[0].token_file == d.token_file
    assert with_run_credentials(secured, tmp_path / "other") == secured  # a spec that names its own keeps them
    plain = load_spec()
    plain = with_run_credentials(replace(plain, verifier=replace(plain.verifier, insecure=True)), tmp_path / "plain")
    assert plain.verifier.tls_cert is None and all(d.tls_ca is None for d in plain.drafters)  # insecure opts out of TLS only
    assert plain.verifier.auth_tokens and all(d.token_file for d in plain.drafters)
    assert secured.verifier.tls_client_ca == str(tmp_path / "auth" / "ca.pem")
    assert all(d.tls_server_name == "localhost" and d.tls_cert == str(tmp_path / "auth" / f"{d.name}.pem") for d in secured.drafters)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity needs Linux")
def test_pinned_children_get_their_cpus_and_parent_death_signal_without_a_preexec_fn():
    """The launcher pins a child (and, under Ray, asks the kernel to SIGTERM it when its parent
    dies) by a short Python that sets both up and execs the command, never a preexec_fn."""
    from goodspeed.launch.cluster.local import _pinned

    probe = [sys.executable, "-c", "import ctypes, os; v = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(v)); "
             "print(sorted(os.sched_getaffinity(0)), v.value, os.environ['OMP_NUM_THREADS'])"]  # 2: PR_GET_PDEATHSIG
    cmd, kwargs = _pinned(probe, (0,), die_with_parent=True)
    assert "preexec_fn" not in kwargs and cmd[-len(probe):] == probe
    assert subprocess.run(cmd, capture_output=True, text=True, check=True, **kwargs).stdout.split() == ["[0]", "15", "1"]
    cmd, kwargs = _pinned(probe, None, threads=3)  # nothing to set up: the command as it is
    assert cmd == probe and subprocess.run(cmd, capture_output=True, text=True, check=True, **kwargs).stdout.split()[-2:] == ["0", "3"]


def test_the_summary_says_why_a_drafter_failed(tmp_path):
    """A drafter that exits non-zero gets a line with its own last error and where its log is."""
    from goodspeed.launch.cluster.local import _last_error, print_summary

    log = tmp_path / "a.log"
    log.write_text("drafter a: root seed 5\ngoodspeed drafter: error: join refused: FAILED_PRECONDITION: tokenizer mismatch\n")
    assert _last_error(log) == "goodspeed drafter: error: join refused: FAILED_PRECONDITION: tokenizer mismatch"
    assert _last_error(tmp_path / "b.log") == f"(no log at {tmp_path / 'b.log'})"
    row = dict(exit_code=1, requests=0, tokens=0, rounds=0, acceptance=0.0, alpha_hat=0.0, X=0.0, tok_per_s=0.0,
               receive_ms_median=None)
    summary = {"drafters": {"a": {**row, "error": _last_error(log)}, "b": {**row, "exit_code": 0, "error": None}},
               "rounds": 0, "wall_s": 1.0, "tokens": 0, "out_dir": str(tmp_path)}
    lines = []
    print_summary(summary, log=lines.append)
    said = [line for line in lines if line.startswith("drafter ") and "exited" in line]
    assert said == [f"drafter a exited with 1: goodspeed drafter: error: join refused: FAILED_PRECONDITION: tokenizer "
                    f"mismatch (log: {tmp_path / 'a.log'})"]
