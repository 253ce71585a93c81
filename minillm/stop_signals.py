"""Stopping on a signal, whatever the process inherited.

Two signals stop a program. SIGINT is Ctrl-C; Python turns it into `KeyboardInterrupt` only if
the process started with SIGINT at its default, and a program started in the background by a
non-interactive shell (`cmd &` in a script, many CI runners) inherits it *ignored*: Ctrl-C, or a
test's SIGINT, then does nothing at all. SIGTERM is how `docker stop`, systemd, Kubernetes and
every supervisor stop a process; Python leaves it at its default, which kills the process on
the spot, halfway through whatever it was writing.

So a command that must stop in order (`minillm serve`, `minillm chat`) installs its own handler
for both, for as long as it runs, and decides what each means there. The handler runs in the
main thread, between two bytecodes of whatever that thread was doing: it should set a flag or
queue a command, not do the work itself; and it writes with `say`, since a buffered stream
(sys.stderr, a rich Console) may be in the middle of the write the signal interrupted.

The exit status says how the program ended: 130 (128 + 2) after SIGINT, the shell's convention
for "interrupted", which a script can test; 0 after SIGTERM, because a stop that a supervisor
asked for and that was carried out in order is a success (systemd and Kubernetes count 0 as a
clean stop and 143 as a failure; uvicorn and gunicorn exit 0 the same way).
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 0}


@contextlib.contextmanager
def handling_stop_signals(handler: Callable[[int, object], None]) -> Iterator[None]:
    """Run the body with `handler(signum, frame)` for SIGINT and SIGTERM, whatever they were
    before (ignored included); put back what they were after. Main thread only."""
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def say(line: str) -> None:
    """One line to stderr, safe inside a signal handler: one unbuffered write(2)."""
    os.write(2, (line + "\n").encode())
