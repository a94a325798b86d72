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
