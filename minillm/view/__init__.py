"""The memory view: the KV memory system drawn live in a browser, or replayed from a trace.

A picture of the data flow is the most useful tool for memory work: where each block's content
comes from, who holds it, how long it lives, where it goes under pressure. `minillm trace show`
draws it after the fact; this package draws it while it happens. A server's page (`/memory` of
`minillm serve`) follows the engine's KV events; `minillm trace serve FILE` replays a recorded
run in the same page, with a scrubber.

frames.py   ViewState: the events followed into frames (block states, tables, the queue, copies,
            preemptions, counters): what the page draws, computed in Python from the events alone
replay.py   Replay: a trace file's run as one frame per engine step
static/     the page itself: memory.html, memory.js, memory.css (no build step, no CDN)

The routes that serve them are `serve/memory_page.py`'s.
"""

from minillm.view.frames import TooLargeToDraw, ViewState
from minillm.view.replay import Replay

__all__ = ["Replay", "TooLargeToDraw", "ViewState"]
