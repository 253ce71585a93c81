"""The quick lessons run to the end (the model-heavy ones take minutes and are run by hand)."""

import subprocess
import sys
from pathlib import Path

import pytest

LESSONS = Path(__file__).parent.parent / "lessons"


@pytest.mark.parametrize("lesson", ["01_kv_cache_math.py", "04_fragmentation.py", "06_prefix_sharing.py", "12_kernel.py"])
def test_lesson_runs_and_saves_its_plot(lesson, real_dir):
    result = subprocess.run([sys.executable, str(LESSONS / lesson)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "What it means" in result.stdout
    if lesson not in ("06_prefix_sharing.py", "12_kernel.py"):  # these print tables only
        assert (LESSONS / "out" / lesson.replace(".py", ".png")).is_file()
