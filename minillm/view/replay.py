"""A recorded run as frames: a trace file (`--trace`) replayed, one frame per engine step.

The page that draws a live server draws a trace the same way: a `ViewState` (`frames.py`) walks
the run's events in order and keeps a frame after its `Snapshot` and after every `Step`. Each
frame is kept encoded (the page asks for them one at a time, as its scrubber moves); what the
charts need over the whole run, the counters of every frame, comes in one `summary`.
"""

from __future__ import annotations

import json

from minillm.memory.events import Event, Snapshot, Step
from minillm.view.frames import TooLargeToDraw, ViewState

MAX_BYTES = 1 << 28  # a replay's frames, encoded, at most: a small file may claim a huge pool x many steps


class Replay:
    """One run's frames. `events`: the run as `read_trace` gives it, [(step, seconds, event)];
    `progress(done)` is told each event walked (for a progress bar)."""

    def __init__(self, events: list[tuple[int, float, Event]], progress=lambda done: None):
        view = ViewState()
        self._frames: list[str] = []  # each frame as JSON
        self._steps: list[int] = []
        self._seconds: list[float] = []
        self._counters: list[dict] = []
        self._bytes = 0  # of every frame kept, encoded
        for done, (step, seconds, event) in enumerate(events, 1):
            try:
                view.apply(step, seconds, event)
                if isinstance(event, (Snapshot, Step)):
                    self._keep(view.frame())
            except TooLargeToDraw:
                raise
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:  # a damaged file
                raise ValueError(
                    f"Event {done} of this run ({type(event).__name__}) does not follow from the ones before "
                    f"it ({type(err).__name__}: {str(err)[:80]}); was the file written by --trace, and whole?"
                ) from None
            progress(done)

    def _keep(self, frame: dict) -> None:
        encoded = json.dumps(frame, separators=(",", ":"))
        self._bytes += len(encoded)
        if self._bytes > MAX_BYTES:
            raise TooLargeToDraw(
                f"This run's frames pass {MAX_BYTES >> 20:,} MiB by step {frame['step']:,} "
                f"({frame['device'] + frame['host']:,} blocks a frame); replay a shorter run (--run N)."
            )
        self._frames.append(encoded)
        self._steps.append(frame["step"])
        self._seconds.append(frame["t"])
        self._counters.append(frame["counters"])

    def __len__(self) -> int:
        return len(self._frames)

    def frame(self, index: int) -> str:
        """Frame `index` (0 is the state the run started from), as JSON."""
        if not 0 <= index < len(self._frames):
            raise IndexError(f"This run has frames 0 to {len(self._frames) - 1}, not {index}.")
        return self._frames[index]

    def summary(self) -> dict:
        """What the page needs before any frame: how many, each one's step and time, every
        frame's counters (the charts over the whole run)."""
        return {"frames": len(self), "steps": self._steps, "t": self._seconds, "counters": self._counters}
