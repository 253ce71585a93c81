"""The lessons run to the end: the quick ones as a user runs them, the perplexity ones (07, 08)
on a short stretch of text (their defaults take minutes and are run by hand)."""

import subprocess
import sys
from pathlib import Path

import pytest

LESSONS = Path(__file__).parent.parent / "lessons"
SHORT_TEXT = ["--segments", "1", "--segment-len", "40"]


@pytest.mark.parametrize("lesson, args", [
    ("01_kv_cache_math.py", []), ("04_fragmentation.py", []), ("06_prefix_sharing.py", []), ("12_kernel.py", []),
    ("07_kv_quantization.py", SHORT_TEXT), ("08_eviction.py", SHORT_TEXT),
])
def test_lesson_runs_and_saves_its_plot(lesson, args, real_dir):
    result = subprocess.run([sys.executable, str(LESSONS / lesson), *args], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "What it means" in result.stdout
    if lesson not in ("06_prefix_sharing.py", "12_kernel.py"):  # these print tables only
        assert (LESSONS / "out" / lesson.replace(".py", ".png")).is_file()
