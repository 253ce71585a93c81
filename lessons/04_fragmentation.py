"""Lesson 04 — fragmentation: the contiguous arena refuses a request while enough memory is free.

A traditional server reserves, per request, one contiguous stretch of KV slots for
prompt + max_tokens. Requests finish in any order, leaving holes between live reservations.
Soon a new request is refused although the free slots add up to more than it needs: they are
just not *contiguous* (external fragmentation). And every reservation is mostly empty while its
output is still short (internal fragmentation).

Paging cuts the same memory into blocks; any free block serves any request, so the new request
fits, and each sequence wastes at most the tail of its last block.

    python lessons/04_fragmentation.py [--quick] [--out DIR]
"""

import random

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, save_numbers, save_plot, table  # noqa: E402

from minillm.memory.accounting import arena_stats, paged_stats  # noqa: E402
from minillm.memory.arena import ContiguousArena  # noqa: E402
from minillm.memory.block_manager import BlockManager  # noqa: E402

SLOTS = 1024  # token slots of KV memory, the same for both allocators
BLOCK = 16
NEW_ID = 99  # part 1's refused request


def draw_arena(arena: ContiguousArena, width: int = 48) -> str:
    """One character per SLOTS/width slots: a letter per reservation, '.' where free."""
    cells = ["."] * width
    for seq_id, (start, length) in arena.reservations.items():
        for cell in range(start * width // SLOTS, (start + length) * width // SLOTS):
            cells[cell] = chr(ord("A") + seq_id % 26)
    return "".join(cells)


def part1_refusal() -> tuple[dict, dict]:
    console.rule("1. The refusal")
    arena = ContiguousArena(SLOTS)
    paged = BlockManager(SLOTS // BLOCK, BLOCK)
    reservations = [192, 144, 256, 128, 176, 112]  # prompt + max_tokens of six requests (whole blocks)
    for seq_id, length in enumerate(reservations):
        arena.allocate(seq_id, length)
        paged.grow(seq_id, length)
    console.print(f"6 requests, {sum(reservations)}/{SLOTS} slots: {draw_arena(arena)}")
    for seq_id in (1, 3):
        arena.free(seq_id)
        paged.free(seq_id)
    console.print(f"B and D finished:          {draw_arena(arena)}")
    new_request = 260
    console.print(
        f"a new request needs {new_request} slots. Free: {arena.num_free_slots} in total, "
        f"largest contiguous hole {arena.largest_hole}."
    )
    console.print(
        f"  contiguous arena: {'fits' if arena.can_allocate(new_request) else '[red]REFUSED[/red]'}"
    )
    fits = paged.can_grow(NEW_ID, new_request)
    console.print(
        f"  paged ({BLOCK}-slot blocks, {paged.num_free_blocks} free): "
        f"{'[green]fits[/green]' if fits else 'refused'} in {paged.blocks_for(new_request)} blocks, "
        "wherever they are"
    )
    numbers = {
        "new_request_slots": new_request,
        "free_slots": arena.num_free_slots,
        "largest_hole": arena.largest_hole,
        "arena_fits": arena.can_allocate(new_request),
        "paged_fits": fits,
    }
    if fits:  # for the picture: where the paged request's blocks went
        paged.grow(NEW_ID, new_request)
    tables = {seq_id: paged.table(seq_id) for seq_id in (0, 2, 4, 5, NEW_ID) if paged.has_table(seq_id)}
    return numbers, {"reservations": dict(arena.reservations), "tables": tables}


def plot(refusal: dict, picture: dict, arena_util: list[float], paged_util: list[float], out_dir):
    fig, (layout, trace) = plt.subplots(2, 1, figsize=(9, 6.5), gridspec_kw={"height_ratios": [1, 1.3]})
    draw_refusal(layout, refusal, picture)
    trace.plot(arena_util, label=f"contiguous arena (mean {sum(arena_util) / len(arena_util):.0%})")
    trace.plot(paged_util, label=f"paged, block {BLOCK} (mean {sum(paged_util) / len(paged_util):.0%})")
    trace.set(
        xlabel="step",
        ylabel="live tokens / reserved slots",
        ylim=(0, 1.05),
        title="2. KV memory utilization on one trace",
    )
    trace.legend(loc="lower right")
    fig.tight_layout()
    save_plot(fig, out_dir, "04_fragmentation.png")


def draw_refusal(ax, refusal: dict, picture: dict) -> None:
    """Part 1 along the slot axis: the arena's reservations and holes, the new request beside them,
    and the paged pool's blocks with the new request's blocks wherever they were free."""
    colour = {seq_id: f"C{seq_id}" for seq_id in picture["reservations"]} | {NEW_ID: "black"}
    for seq_id, (start, length) in picture["reservations"].items():
        ax.broken_barh([(start, length)], (2.6, 0.8), color=colour[seq_id])
        ax.text(start + length / 2, 3, chr(ord("A") + seq_id), ha="center", va="center", color="white")
    new = refusal["new_request_slots"]
    ax.broken_barh([(0, new)], (1.6, 0.8), facecolor="none", edgecolor="black", hatch="//")
    for seq_id, blocks in picture["tables"].items():
        ax.broken_barh(
            [(block * BLOCK, BLOCK) for block in blocks],
            (0.6, 0.8),
            color=colour[seq_id],
            edgecolor="white",
            linewidth=0.5,
        )
    ax.set_yticks(
        [3, 2, 1],
        [
            "contiguous arena",
            f"new request ({new} slots)",
            f"paged ({BLOCK}-slot blocks;\nnew request black)",
        ],
    )
    ax.set(xlim=(0, SLOTS), ylim=(0.4, 3.6), xlabel="KV slot (token position in the pool)")
    arena, paged = ("fits" if refusal[key] else "refused" for key in ("arena_fits", "paged_fits"))
    ax.set_title(
        f"1. B and D finished: {refusal['free_slots']} slots free, largest hole {refusal['largest_hole']}; "
        f"a {new}-slot request: arena {arena}, paged {paged}"
    )
    ax.title.set_fontsize(10)


def part2_trace(seed: int = 0, steps: int = 400) -> tuple[dict, list[float], list[float]]:
    console.rule("2. A trace: the same requests, both allocators")
    rng = random.Random(seed)
    arena, paged = ContiguousArena(SLOTS), BlockManager(SLOTS // BLOCK, BLOCK)
    live: dict[int, list[int]] = {}  # seq_id -> [tokens now, final length, max_len]
    arena_util, paged_util, refused = [], [], {"arena": 0, "paged": 0}
    next_id = 0
    for _ in range(steps):
        if rng.random() < 0.3:  # a request arrives: prompt 16..128, max_tokens 64..256, real output shorter
            prompt, max_tokens = rng.randint(16, 128), rng.randint(64, 256)
            final = prompt + rng.randint(1, max_tokens)
            arena_ok, paged_ok = arena.can_allocate(prompt + max_tokens), paged.can_grow(next_id, prompt)
            refused["arena"] += not arena_ok
            refused["paged"] += not paged_ok
            if arena_ok and paged_ok:  # admit only what both can hold, so they serve the same requests
                arena.allocate(next_id, prompt + max_tokens)
                paged.grow(next_id, prompt)
                live[next_id] = [prompt, final]
            next_id += 1
        for seq_id, state in list(live.items()):  # every running request decodes one token
            if state[0] == state[1] or not paged.can_grow(seq_id, state[0] + 1):
                arena.free(seq_id)
                paged.free(seq_id)
                del live[seq_id]
                continue
            state[0] += 1
            paged.grow(seq_id, state[0])
        tokens = {seq_id: state[0] for seq_id, state in live.items()}
        arena_util.append(arena_stats(arena, tokens, 1).utilization)
        paged_util.append(paged_stats(paged, tokens, 1).utilization)
    table(
        "utilization = live tokens / reserved slots, mean over the trace",
        ["allocator", "utilization", "arrivals refused"],
        [
            ["contiguous (max length)", f"{sum(arena_util) / steps:.1%}", refused["arena"]],
            [f"paged ({BLOCK}-slot blocks)", f"{sum(paged_util) / steps:.1%}", refused["paged"]],
        ],
    )
    numbers = {
        "arena_utilization": sum(arena_util) / steps,
        "paged_utilization": sum(paged_util) / steps,
        "arena_refused": refused["arena"],
        "paged_refused": refused["paged"],
    }
    return numbers, arena_util, paged_util


def main():
    args = lesson_args(__doc__)  # no model here: the whole lesson takes a second, --quick changes nothing
    refusal, picture = part1_refusal()
    trace, arena_util, paged_util = part2_trace()
    plot(refusal, picture, arena_util, paged_util, args.out)
    save_numbers(args.out, "04_fragmentation.json", refusal | trace)
    console.print(
        f"\n[bold]What it means:[/bold] reserving for the worst case wastes much of the memory "
        f"(the arena's slots held {trace['arena_utilization']:.0%} live tokens on average, the blocks "
        f"{trace['paged_utilization']:.0%}) and scatters the rest into unusable holes (a request for "
        f"{refusal['new_request_slots']} slots refused with {refusal['free_slots']} free). "
        f"{blocks_verdict(trace)}"
    )


def blocks_verdict(trace: dict) -> str:
    """What the blocks did on this trace, said as it came out."""
    held_more = trace["paged_utilization"] > trace["arena_utilization"]
    refused_fewer = trace["paged_refused"] < trace["arena_refused"]
    refusals = f"{trace['paged_refused']} arrivals refused against the arena's {trace['arena_refused']}"
    if held_more and refused_fewer:
        return f"Blocks remove both: the same budget holds more live tokens and refuses fewer ({refusals})."
    if held_more:
        return f"Blocks hold more live tokens in the same budget, but turned away no fewer here ({refusals})."
    return f"On this trace blocks did not hold more live tokens than the arena ({refusals})."


if __name__ == "__main__":
    main()
