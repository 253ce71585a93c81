"""Drawing the data flow of KV memory from the run itself: a trace of KV events, read back.

Before optimizing memory, draw its data flow: where each block's content comes from, how long it
lives, who reads it again and how soon, what a spill or a swap bought. A pool snapshot shows none
of that; the events a run wrote (`--trace FILE`, `tracing.py`) show all of it. This package walks
one run's events once, in order, with a `Replayer` (`memory/replay.py`) rebuilding the pool
beside it, and keeps what the questions need:

    lifetimes   each content a block gets (allocated, copied on write, brought back, swapped to
                a new block): the steps some table held it, then the steps it waited cached
                (free, but findable) until a hit took it again, its block was reused, or it was
                forgotten
    reuse       each prefix-cache entry: the distinct requests that hit it, the steps from its
                last release to each hit, and how many were registered and never hit
    spills      cached blocks moved to the host tier: brought back by a hit, or never read again
    swaps       per sequence, the round trips swap-out -> swap-in: blocks moved, steps away
    reads       KV bytes attention read per step (entries read x bytes per token), per request
    places      per step, per request: where its KV lives (device, host, disk, mixed), or
                waiting with none between its first block and its last free

and draws the timeline: every block x every step coloured by its state, and one lane per request
coloured by where its KV lives. `minillm trace show FILE` prints it (`cli/trace.py`).

records.py   what is kept: Life, PrefixEntry, Spill, Trip; the state and place codes
run_view.py  the walk: RunView replays each event and updates the records; walk(events)
timeline.py  the pictures' grids, filled at the end from the changes each step recorded
summary.py   the numbers: describe_runs, busiest, summarize (one JSON-ready dict)
picture.py   the drawing: draw writes the timeline PNG (matplotlib optional)
"""

from minillm.trace.picture import aggregate, draw, plural
from minillm.trace.records import BLOCK_STATES, PLACES
from minillm.trace.run_view import RunView, walk
from minillm.trace.summary import busiest, describe_runs, summarize
from minillm.trace.timeline import request_rows

__all__ = [
    "BLOCK_STATES",
    "PLACES",
    "RunView",
    "aggregate",
    "busiest",
    "describe_runs",
    "draw",
    "plural",
    "request_rows",
    "summarize",
    "walk",
]
