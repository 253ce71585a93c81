"""One progress bar for everything that takes a while: requests, scoring, dequantizing, downloads.

    with progress_bar("requests", total=len(prompts)) as advance:
        ...
        advance()          # one more done (advance(n) for n bytes of a download)

It is transient (gone when the work is) and drawn on stderr, so `--json` output on stdout stays
one clean object; `enabled=False` yields a no-op, so callers need no second code path.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def progress_bar(
    description: str, total: int | None, enabled: bool = True, download: bool = False
) -> Iterator[Callable[..., None]]:
    """Yields `advance(n=1)`. `download=True` shows bytes and time left; `total=None` means unknown."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = [TextColumn("{task.description}"), BarColumn()]
    columns += (
        [DownloadColumn(), TimeRemainingColumn()]
        if download
        else [TextColumn("{task.completed}/{task.total}")]
    )
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)
