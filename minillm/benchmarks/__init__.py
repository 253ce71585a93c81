"""Benchmarks behind `minillm bench ...`: each measures side by side in one run and returns a
dict (printed as JSON with --json) so numbers can be compared across commits."""

from pathlib import Path

GPL_TEXT = Path("/usr/share/common-licenses/GPL-3")  # real prose from outside the project (Debian base-files)
