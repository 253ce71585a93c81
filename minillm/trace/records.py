"""What a walk over a run keeps: one record per block content, prefix entry, spill and swap trip.

A trace is read to answer questions about memory's data flow (`minillm/trace/__init__.py` lists
them). Each record here holds the answer to one: a block content's life (`Life`), a prefix-cache
registration and who hit it (`PrefixEntry`), a cached block's stay on the host tier (`Spill`), a
sequence's time away from the device (`Trip`). The walk (`run_view.py`) fills them event by
event; the summaries (`summary.py`) count them. The codes the pictures are drawn in live here too,
and `record_change`, which keeps a timeline row as the steps where its code changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLOCK_STATES = ("free", "cached", "private", "shared")  # codes 0..3; 0 is the background
PLACES = ("none", "waiting", "device", "host", "disk", "mixed")  # codes 0..5; 0: no request yet/any more
TIER_PLACE = {"device": 2, "host": 3, "disk": 4}
MIXED = 5


@dataclass(slots=True)
class Life:
    """One content of one block: from the event that wrote it until it is gone."""

    tier: str
    start: int  # the step it got this content
    held_steps: int = 0  # steps some table held it (a step it was taken and let go in counts once)
    cached_steps: int = 0  # steps it waited free but findable
    waited: bool = False  # did it ever wait cached?
    held_since: int | None = None
    cached_since: int | None = None
    end: str = ""  # reused, freed, uncached, open (still there when the trace ends)


@dataclass(slots=True)
class PrefixEntry:
    """One registration in the prefix cache (the key follows the content across spills)."""

    key: int
    registered: int  # step
    hit_seqs: list[int] = field(default_factory=list)  # the sequence of every hit, in order
    distances: list[int] = field(default_factory=list)  # steps from the last release to a hit
    hits_while_held: int = 0  # hits while another table still held it (no release in between)
    released_at: int | None = None


@dataclass(slots=True)
class Spill:
    step: int
    brought_back: int | None = None  # the step a hit brought it back to the device
    dropped: bool = False  # forgotten on the host without being read again


@dataclass(slots=True)
class Trip:
    """A sequence's time away from the device, from its swap-out until all its blocks are back."""

    seq_id: int
    out_step: int
    blocks_out: int
    blocks_in: int = 0
    back_step: int | None = None
    freed: bool = False  # its table was freed while away (aborted, or recomputed later)


def record_change(changes: list[tuple[int, int]], column: int, during: int, now: int) -> None:
    """A step's column shows the code `during` it; `now` (after it) holds from the next column on."""
    if (changes[-1][1] if changes else 0) != during:
        changes.append((column, during))
    if now != during:
        changes.append((column + 1, now))
