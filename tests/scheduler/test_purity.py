"""The scheduler must import without torch, grpc or transformers (STYLE.md: policies are pure)."""

import subprocess
import sys


def test_scheduler_imports_no_heavy_frameworks():
    code = (
        "import sys, goodspeed.scheduler\n"
        "import goodspeed.scheduler.adaserve, goodspeed.scheduler.nightjar, goodspeed.scheduler.turbospec\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'grpc', 'transformers'})\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_doctests_pass():
    import doctest

    import goodspeed.scheduler.adaserve as adaserve
    import goodspeed.scheduler.baselines as baselines
    import goodspeed.scheduler.goodspeed as goodspeed
    import goodspeed.scheduler.tetris as tetris

    for module in (adaserve, baselines, goodspeed, tetris):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
