import json

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
    from goodspeed.launch.local import ClusterView, render_table

    class Proc:
        def __init__(self, returncode):
            self.returncode = returncode

        def poll(self):
            return self.returncode

    view = ClusterView()
    view.apply({"event": "round", "ts": 10.0, "drafters": [{"name": "a", "alpha_hat": 0.5, "X": 2.0, "S_next": 4, "x": 3}]})
    view.apply({"event": "round", "ts": 12.0, "drafters": [{"name": "a", "alpha_hat": 0.6, "X": 2.5, "S_next": 5, "x": 3}]})
    procs = {"a": Proc(None), "b": Proc(1)}
    lines = render_table(view, procs, 5.0)
    assert lines[0] == "goodspeed launch:    5.0 s, 2 rounds" and "node" not in lines[1]
    assert lines[2].split() == ["a", "running", "0.600", "2.50", "5", "6", "3.0"]  # 6 tokens over ts 10 .. 12
    assert lines[3].split()[:3] == ["b", "exit", "1"]
    placed = render_table(view, procs, 5.0, {"a": {"node": "edge-1"}, "b": {"node": "edge-2"}})
    assert placed[1].endswith(" node") and placed[2].endswith(" edge-1") and placed[3].endswith(" edge-2")


def test_local_dry_run_prints_the_processes_and_address_needs_ray(capsys, tmp_path):
    assert main(["launch", "--dry-run", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("every process runs on this machine:") and "verifier --target demo:target" in out
    assert out.count("drafter --verifier VERIFIER_ADDRESS") == 4 and not (tmp_path / "run").exists()
    assert main(["launch", "--address", "10.0.0.1:6379"]) == 2
    assert "--address is for --backend ray" in capsys.readouterr().err
