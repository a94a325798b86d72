import pytest

from goodspeed.launch.demo import DemoConfig, run_demo


@pytest.mark.slow
def test_demo_runs_on_the_embedded_default_and_is_lossless():
    """Builds the real demo models if they are missing (~3 min), then runs the demo."""
    summary = run_demo(DemoConfig(max_new_tokens=16, prompts_per_drafter=1), log=lambda *_: None)
    assert summary["lossless"]
    assert len(summary["drafters"]) == 4 and all(r["tokens"] == 16 for r in summary["drafters"].values())
