"""The chat's memory view: the KV pool as a block map, drawn live while a reply streams.

Every physical block is one cell, and its glyph says what the block holds right now:

    #  this conversation: held by the reply being computed, and by nobody else
    ~  filling (quantized pools): the conversation's last block, its keys kept in full precision
       until it fills, then quantized with one scale per channel
    =  shared: held by the conversation and findable in the prefix cache (or held twice)
    +  cached (for later): nobody holds it, but a later prompt that starts alike finds it
    .  free

The device pool that attention reads is drawn first; when the engine has them, a row for the host
pool (#/= swapped out, + spilled there by the prefix cache) and one for the block files on disk
follow. Quantization is a property of the whole pool (every block stores the same format), so the
panel's title names the format, and its bytes per token include the scales. Beside the map:
bytes per token and in total, the prompt tokens the prefix cache saved, time to first token and
decode speed.

The states come from the engine's snapshot (`LLMEngine.snapshot`, `memory/accounting.py`), taken
once per drawing, so the map's counts are the engine's own accounting. Drawing costs time the
reply does not get, so the live panel is redrawn at most four times a second, not on every token.
Without a terminal (a pipe, CI) there is no live panel: the same numbers come as plain lines after
each reply.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

# state -> (glyph, colour, what the legend calls it), in the order of the legend
STATES = {
    "private": ("#", "green", "this conversation"),
    "filling": ("~", "magenta", "filling"),
    "shared": ("=", "cyan", "shared"),
    "cached": ("+", "yellow", "cached"),
    "free": (".", "bright_black", "free"),
}
MAP_WIDTH = 76  # cells per row: an 80-column terminal less the panel's borders and padding
# rows of the device map in the live panel (fewer in a short terminal); more blocks share a cell
LIVE_ROWS = 10
TIER_ROWS = 1  # rows of the host map, and of the disk's, in the live panel
FULL_ROWS = 40  # rows of a tier's map in /memory
REDRAW_SECONDS = 0.25


@dataclass
class ReplyMeter:
    """Time to first token and decode speed of the reply being streamed, by the wall clock."""

    start: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    tokens: int = 0
    reused_tokens: int = 0  # prompt tokens the prefix cache saved this reply

    def count_token(self) -> None:
        self.last_token_time = time.perf_counter()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time
        self.tokens += 1

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.start

    @property
    def tok_s(self) -> float | None:
        """Decode tokens per second after the first token (None until there are two)."""
        if self.tokens < 2:
            return None
        return (self.tokens - 1) / (self.last_token_time - self.first_token_time)


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.2f} MiB"


def state_counts(states: list[str]) -> dict[str, int]:
    return {state: states.count(state) for state in STATES}


def shown(counts: dict[str, int]) -> list[str]:
    """The states a legend names: all but "filling", which only quantized pools have."""
    return [state for state in STATES if state != "filling" or counts["filling"]]


def block_map(states: list[str], rows: int, width: int = MAP_WIDTH) -> tuple[Text, int]:
    """The blocks as rows of glyphs, and how many blocks one cell stands for: 1, unless `rows`
    cannot hold them all; then a cell shows the busiest state among its blocks."""
    per_cell = max(1, math.ceil(len(states) / (rows * width)))
    rank = list(STATES)  # private first: a cell shows what matters most
    cells = [min(states[i : i + per_cell], key=rank.index) for i in range(0, len(states), per_cell)]
    picture = Text()
    for start in range(0, len(cells), width):
        if start:
            picture.append("\n")
        row = cells[start : start + width]
        run = 0
        for i in range(1, len(row) + 1):  # one styled run per stretch of equal cells
            if i == len(row) or row[i] != row[run]:
                glyph, colour, _ = STATES[row[run]]
                picture.append(glyph * (i - run), style=colour)
                run = i
    return picture, per_cell


def legend(counts: dict[str, int]) -> Text:
    line = Text()
    for state in shown(counts):
        glyph, colour, name = STATES[state]
        line.append(f"{glyph} ", style=colour)
        line.append(f"{name} {counts[state]:,}  ")
    return line


def pool_title(config, memory) -> str:
    """`config`: the EngineConfig; `memory`: the engine's MemorySnapshot."""
    stored = (
        config.dtype
        if config.kv_dtype == "auto"
        else f"{config.kv_dtype} (scales per {config.kv_key_scales})"
    )
    return f"KV pool: {memory.num_blocks:,} blocks x {memory.block_size} tokens, {stored}"


def bytes_line(memory, counts: dict[str, int]) -> str:
    """Bytes per token, what the conversation holds (its blocks and the shared ones), the pool."""
    per_token = memory.bytes_per_token
    held = (counts["private"] + counts["filling"] + counts["shared"]) * memory.block_size * per_token
    staged = memory.staged_bytes
    staging = f" + {staged / 2**10:,.0f} KiB keys staging" if staged else ""
    return f"{per_token:,} B/token; held {mib(held)}{staging}; pool {mib(memory.pool_bytes)}"


def reply_line(meter: ReplyMeter) -> str:
    ttft = f"{meter.ttft * 1000:,.0f} ms" if meter.ttft is not None else "..."
    speed = f"{meter.tok_s:,.1f} tok/s" if meter.tok_s is not None else "... tok/s"
    return (
        f"prefix reused {meter.reused_tokens:,} tokens; first token {ttft}; {speed}; {meter.tokens:,} tokens"
    )


def tier_lines(tiers: dict[str, tuple[str, ...]]) -> list[str]:
    """One line for the host pool and one for disk, when the engine has them."""
    lines = []
    if "host" in tiers:
        counts = state_counts(tiers["host"])
        lines.append(
            f"host: {counts['private'] + counts['shared']:,} swapped out, {counts['cached']:,} spilled "
            f"(cached), {counts['free']:,} free of {len(tiers['host']):,} blocks"
        )
    if "disk" in tiers:
        lines.append(f"disk: {len(tiers['disk']):,} block files")
    return lines


def memory_panel(engine, meter: ReplyMeter, rows: int = LIVE_ROWS, width: int = MAP_WIDTH) -> Panel:
    """The panel: the device map, its legend, the other tiers, bytes, and the reply's speed;
    `width` cells a row (the panel is 4 columns wider)."""
    memory = engine.snapshot()
    tiers = memory.blocks
    picture, per_cell = block_map(tiers["device"], rows, width)
    counts = state_counts(tiers["device"])
    scale = f" (1 cell = {per_cell} blocks)" if per_cell > 1 else ""
    body = [picture, legend(counts)]
    for tier, line in zip([tier for tier in tiers if tier != "device"], tier_lines(tiers)):
        if tiers[tier]:
            body.append(block_map(tiers[tier], TIER_ROWS, width)[0])
        body.append(Text(line))
    body += [Text(bytes_line(memory, counts)), Text(reply_line(meter))]
    title = pool_title(engine.config, memory) + scale
    return Panel(Group(*body), title=title, title_align="left", width=width + 4)


def summary_lines(engine, meter: ReplyMeter) -> list[str]:
    """The panel's numbers as plain lines: what a pipe gets after each reply, and the terminal too."""
    memory = engine.snapshot()
    tiers = memory.blocks
    counts = state_counts(tiers["device"])
    blocks = ", ".join(f"{counts[state]:,} {STATES[state][2]}" for state in shown(counts))
    return [
        f"blocks: {blocks} of {len(tiers['device']):,}",
        *tier_lines(tiers),
        bytes_line(memory, counts),
        reply_line(meter),
    ]


def stats_line(memory, out, meter: ReplyMeter) -> str:
    """`/stats`: the last reply (`out`, a RequestOutput) and the KV it held, in one line."""
    per_token = memory.bytes_per_token
    held = len(out.prompt_token_ids) + len(out.token_ids)
    decode = f"{1 / out.tpot:.1f} tok/s" if out.tpot else "n/a"
    cached = memory.prefix_cache["cached_blocks"] if memory.prefix_cache else 0
    return (
        f"prompt {len(out.prompt_token_ids)} tokens ({meter.reused_tokens} reused from the prefix cache), "
        f"reply {len(out.token_ids)} tokens | first token {out.ttft * 1000:.0f} ms | decode {decode} | "
        f"KV cache {per_token:,} B/token x {held} tokens = {per_token * held / 2**20:.1f} MiB; "
        f"{cached} blocks cached, {memory.num_free_blocks} of {memory.num_blocks} blocks free"
    )


def full_map(engine, console: Console) -> None:
    """`/memory`: every block a cell, per tier, and the engine's accounting."""
    from minillm.report import print_table

    memory = engine.snapshot()
    console.print(f"[bold]{pool_title(engine.config, memory)}[/bold]")
    for tier, states in memory.blocks.items():
        if states:
            picture, per_cell = block_map(states, FULL_ROWS)
            shared_cells = (
                f" (1 cell = {per_cell} blocks, the busiest state among them)" if per_cell > 1 else ""
            )
            console.print(f"{tier}:{shared_cells}")
            console.print(picture)
    console.print(legend(state_counts(memory.blocks["device"])))
    for line in tier_lines(memory.blocks):
        console.print(line)
    print_table(console, "accounting (memory/accounting.py)", ["", "now"], _accounting_rows(memory))


def _accounting_rows(memory) -> list[list[str]]:
    """/memory's table: the snapshot's bytes, slots, prefix-cache hits and copies between tiers."""
    stats, per_token = memory.stats, memory.bytes_per_token
    rows = [
        ["bytes per token", f"{per_token:,} (K and V, all layers, scales)"],
        [
            "reserved (blocks held)",
            f"{stats.reserved_slots:,} tokens, {mib(stats.reserved_slots * per_token)}",
        ],
        ["live (tokens stored)", f"{stats.live_slots:,} tokens, {mib(stats.live_slots * per_token)}"],
        ["saved by sharing", f"{stats.shared_slots:,} tokens"],
        ["pool", f"{stats.total_slots:,} tokens, {mib(memory.pool_bytes)}"],
        ["keys staging", f"{memory.staged_bytes / 2**10:,.1f} KiB in full precision"],
    ]
    cache = memory.prefix_cache
    if cache is not None:
        rows += [
            [
                "prefix cache",
                f"{cache['cached_blocks']:,} blocks, {cache['hit_rate']:.0%} hit, "
                f"{cache['prefill_tokens_saved']:,} tokens saved",
            ]
        ]
    if "host" in memory.blocks:
        rows += [["host pool", f"{stats.host_reserved_slots:,} of {stats.host_total_slots:,} tokens held"]]
    rows += [[f"moved {direction}", mib(moved)] for direction, moved in stats.bytes_moved.items()]
    return rows


class LiveView:
    """The reply's text, its last lines, above the memory panel, redrawn in place while it streams
    (rich's Live); when the reply ends the drawing goes, and the caller prints the reply for good."""

    def __init__(self, console: Console, engine, meter: ReplyMeter):
        self.console, self.engine, self.meter = console, engine, meter
        self.text = ""
        self.drawn_at = 0.0
        self.live = Live(console=console, auto_refresh=False, transient=True)

    def __enter__(self) -> "LiveView":
        self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.live.stop()

    def feed(self, piece: str) -> None:
        self.text += piece
        if time.perf_counter() - self.drawn_at >= REDRAW_SECONDS:
            self.draw()

    def draw(self) -> None:
        width = min(self.console.width, MAP_WIDTH + 4)  # 80 columns, or what a narrower terminal has
        rows = max(2, min(LIVE_ROWS, self.console.height - 18))  # leave a few lines for the reply
        panel = memory_panel(self.engine, self.meter, rows, width - 4)
        room = max(1, self.console.height - rows - 10)  # lines left above the panel
        lines = (Text("smol> ", style="bold blue") + Text(self.text)).wrap(self.console, width)
        self.live.update(Group(*lines[-room:], panel), refresh=True)
        self.drawn_at = time.perf_counter()
