"""Frames: the memory system as the page draws it, followed from its KV events.

A browser should not have to know how a block manager works to draw one. `ViewState` follows the
events (`memory/events.py`) with a `Replayer` (`memory/replay.py`: tables, refcounts, the prefix
cache) and keeps what a picture needs beside it: when each block's content began, which blocks are
still being written, who waits in the queue, the copies between tiers, the preemptions and why.
`frame()` turns that into one JSON-ready dict, the same for a live server (`serve/memory_page.py`,
a few frames a second) and for a recorded trace (`replay.py`, one frame per step):

    states   one character per block, device ids first, then the host tier's, then each disk block:
             .  free         h  held by one sequence      w  held, its last slots still empty
             s  shared (several tables, or one and findable by content)
             c  cached (free, findable by content: the first to go under pressure)
             o  swapped out (a table's block in the host or disk tier)
             p  spilled (a cached block in the host tier)
    born     the step each block's content began (-1: free), in the same order
    keys     block -> its prefix-cache key, as hex
    sequences  the running batch, then the queue in its order: each one's table, prefix hits,
             preemptions, and whether it ran in this step
    moves    the copies since the previous frame: (kind, source, destination), kind one of out, in
             (a swap), spill, back (a spilled block a prompt hit) and cow (copy on write)
    log      the last preemptions, each with its cause
    counters utilization, prefix hit rate, tokens/s, preemptions, bytes moved between tiers

Everything is computed from the events alone, so a live server and a trace file draw the same (a
live frame adds `ts`, when the step it shows ended, from which the page tells its own lag).
"""

from __future__ import annotations

from collections import Counter, deque

from minillm.memory import events as ev
from minillm.memory.replay import Replayer

LOG_LINES = 50  # preemptions a frame carries, newest last
MAX_BLOCKS = 1 << 18  # device and host blocks a view draws at most (a trace file may claim any number)
MAX_BLOCK_BYTES = 1 << 40  # a block's KV bytes, at most (the same: a file's claim)
RATE_STEPS = 16  # tokens/s is over the last this many steps


class TooLargeToDraw(ValueError):
    """A run whose pool, or whose frames in all, the view will not hold (a trace file is hostile)."""


class ViewState:
    """One memory system's picture, kept up to date: `apply` each (step, seconds, event) in order,
    then `frame()` whenever a picture is wanted."""

    def __init__(self):
        self._pool = Replayer()
        self._born: dict[int, int] = {}  # block -> the step its content began
        self._writing: set[int] = set()  # held blocks whose last slots are still empty
        self._requests: dict[int, str] = {}  # seq_id -> its request's id (Step events tell)
        self._hits: dict[int, int] = {}  # seq_id -> blocks its last lookup took from the cache
        self._preemptions: Counter[int] = Counter()  # seq_id -> times it left the device
        self._ran: set[int] = set()  # the sequences in the last step's forward pass
        self._queue: list[int] = []  # the waiting sequences, in order
        self._moves: list[tuple[str, int, int]] = []  # copies since the last frame
        self._log: deque[tuple[int, str]] = deque(maxlen=LOG_LINES)
        self._recent: deque[tuple[int, float]] = deque(maxlen=RATE_STEPS)  # (tokens, seconds) per step
        self._taken = self._hit = self._preempted = self._bytes_moved = 0
        self.step, self.seconds = 0, 0.0

    # ---------------------------------------------------------------- following the events
    def apply(self, step: int, seconds: float, event: ev.Event) -> None:
        """One event of engine step `step`, `seconds` into the run."""
        self.step, self.seconds = step, seconds
        if isinstance(event, ev.Snapshot):
            self._check_size(event)
        self._pool.apply(event)
        handler = getattr(self, "_" + type(event).__name__, None)
        if handler is not None:
            handler(step, event)

    def _block_bytes(self) -> int:
        return self._pool.bytes_per_token * self._pool.block_size

    def _moved(self, kind: str, source: int, destination: int) -> None:
        """A block's content copied to another tier (or another block): it keeps its age."""
        self._born[destination] = self._born.pop(source, self.step)
        if source in self._writing:
            self._writing.discard(source)
            self._writing.add(destination)
        self._moves.append((kind, source, destination))
        self._bytes_moved += self._block_bytes()

    @staticmethod
    def _check_size(e: ev.Snapshot) -> None:
        """A pool a frame can hold, before anything is sized by it (a trace file is hostile)."""
        if min(e.num_blocks, e.host_blocks) < 0 or e.num_blocks + e.host_blocks > MAX_BLOCKS:
            raise TooLargeToDraw(
                f"This run claims a pool of {e.num_blocks:,} device and {e.host_blocks:,} host blocks; "
                f"the memory view draws at most {MAX_BLOCKS:,} in all. Is the trace file damaged?"
            )
        if e.block_size < 1 or not 0 <= e.bytes_per_token * e.block_size <= MAX_BLOCK_BYTES:
            raise TooLargeToDraw(
                f"This run claims blocks of {e.block_size:,} tokens of {e.bytes_per_token:,} bytes; "
                "no engine writes those. Is the trace file damaged?"
            )

    def _Snapshot(self, step: int, e: ev.Snapshot) -> None:
        held = {block for table in e.tables.values() for block in table}
        self._born = dict.fromkeys(held | {block for block, *_ in e.cached}, step)
        self._writing.clear()

    def _Allocated(self, step: int, e: ev.Allocated) -> None:
        self._born[e.block] = step
        self._writing.add(e.block)
        self._taken += 1

    def _Filled(self, step: int, e: ev.Filled) -> None:
        self._writing.discard(e.block)

    def _Hit(self, step: int, e: ev.Hit) -> None:
        self._hits[e.seq_id] = len(e.blocks)
        self._taken += len(e.blocks)
        self._hit += len(e.blocks)

    def _CopiedOnWrite(self, step: int, e: ev.CopiedOnWrite) -> None:
        self._born[e.block] = step
        if e.source in self._writing:
            self._writing.add(e.block)
        self._moves.append(("cow", e.source, e.block))

    def _SwappedOut(self, step: int, e: ev.SwappedOut) -> None:
        for source, destination in e.moves:
            self._moved("out", source, destination)

    def _SwappedIn(self, step: int, e: ev.SwappedIn) -> None:
        for source, destination in e.moves:
            self._moved("in", source, destination)

    def _Spilled(self, step: int, e: ev.Spilled) -> None:
        self._moved("spill", e.block, e.host)

    def _BroughtBack(self, step: int, e: ev.BroughtBack) -> None:
        self._moved("back", e.host, e.block)

    def _Freed(self, step: int, e: ev.Freed) -> None:
        self._writing.difference_update(e.blocks)

    def _Preempted(self, step: int, e: ev.Preempted) -> None:
        self._preempted += len(e.seq_ids)
        self._preemptions.update(e.seq_ids)
        who = ", ".join(f"seq {seq_id} ({self._requests.get(seq_id, '?')})" for seq_id in e.seq_ids)
        if e.for_seq < 0:
            why = "room for the queue"
        elif e.for_seq in e.seq_ids:
            why = "no room to grow, and nobody else to take it from"
        else:
            why = f"room for seq {e.for_seq} to grow"
        self._log.append((step, f"{who} preempted by {e.how}: {why}"))

    def _Step(self, step: int, e: ev.Step) -> None:
        self._ran = {seq_id for seq_id, *_ in e.sequences}
        self._queue = [seq_id for seq_id, _ in e.waiting]
        self._requests.update((seq_id, request) for seq_id, request, *_ in e.sequences)
        self._requests.update(e.waiting)
        self._recent.append((sum(tokens for _, _, tokens, _ in e.sequences), e.seconds))
        known = set(self._pool.tables) | set(self._queue) | self._ran  # the finished are forgotten
        for by_seq in (self._requests, self._hits, self._preemptions):
            for seq_id in set(by_seq) - known:
                del by_seq[seq_id]

    # ---------------------------------------------------------------- the picture
    def frame(self) -> dict:
        """The picture now (see the module's docstring); the moves start over after it."""
        pool = self._pool
        order = self._block_order()
        states = [self._state(block) for block in order]
        frame = {
            "step": self.step,
            "t": round(self.seconds, 3),
            "block_size": pool.block_size,
            "block_bytes": self._block_bytes(),
            "device": pool.num_blocks,
            "host": pool.host_blocks,
            "disk": order[pool.num_blocks + pool.host_blocks :],
            "states": "".join(states),
            "born": [-1 if state == "." else self._born.get(b, -1) for b, state in zip(order, states)],
            "keys": {str(block): f"{key & 0xFFFFFFFFFFFF:012x}" for block, key in pool.cached.items()},
            "sequences": self._sequences(),
            "moves": self._moves,
            "log": list(self._log),
            "counters": self.counters(),
        }
        self._moves = []
        return frame

    def counters(self) -> dict:
        """The numbers the page charts over time."""
        pool = self._pool
        held = sum(1 for block in pool.refcounts if 0 <= block < pool.num_blocks)
        tokens = sum(count for count, _ in self._recent)
        seconds = sum(spent for _, spent in self._recent)
        return {
            "utilization": round(held / pool.num_blocks, 4) if pool.num_blocks else 0.0,
            "hit_rate": round(self._hit / self._taken, 4) if self._taken else 0.0,
            "tokens_per_s": round(tokens / seconds, 1) if seconds else 0.0,
            "preemptions": self._preempted,
            "bytes_moved": self._bytes_moved,
        }

    def _block_order(self) -> list[int]:
        """Device and host ids, then the disk blocks in use (their ids run on as needed)."""
        pool = self._pool
        first_disk = pool.num_blocks + pool.host_blocks
        disk = {block for block in pool.refcounts if block >= first_disk}
        disk |= {block for block in pool.cached if block >= first_disk}
        return [*range(first_disk), *sorted(disk)]

    def _state(self, block: int) -> str:
        pool = self._pool
        on_device = block < pool.num_blocks
        holders = pool.refcounts.get(block, 0)
        if holders == 0:
            if block not in pool.cached:
                return "."
            return "c" if on_device else "p"
        if not on_device:
            return "o"
        if holders > 1 or block in pool.cached:
            return "s"
        return "w" if block in self._writing else "h"

    def _sequences(self) -> list[dict]:
        """The running (every table not in the queue), then the queue in its order."""
        tables, queued = self._pool.tables, set(self._queue)
        running = [seq_id for seq_id in tables if seq_id not in queued and tables[seq_id]]
        return [self._sequence(seq_id, seq_id not in queued) for seq_id in running + self._queue]

    def _sequence(self, seq_id: int, running: bool) -> dict:
        table = self._pool.tables.get(seq_id, [])
        off_device = any(block >= self._pool.num_blocks for block in table)
        return {
            "seq": seq_id,
            "request": self._requests.get(seq_id, "?"),
            "status": "running" if running else "swapped" if off_device else "waiting",
            "blocks": list(table),
            "hit": self._hits.get(seq_id, 0),
            "preemptions": self._preemptions[seq_id],
            "ran": seq_id in self._ran,
        }
