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


def draw_arena(arena: ContiguousArena, width: int = 48) -> str:
    """One character per SLOTS/width slots: a letter per reservation, '.' where free."""
    cells = ["."] * width
    for seq_id, (start, length) in arena.reservations.items():
        for cell in range(start * width // SLOTS, (start + length) * width // SLOTS):
            cells[cell] = chr(ord("A") + seq_id % 26)
    return "".join(cells)


def part1_refusal() -> dict:
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
    fits = paged.can_grow(99, new_request)
    console.print(
        f"  paged ({BLOCK}-slot blocks, {paged.num_free_blocks} free): "
        f"{'[green]fits[/green]' if fits else 'refused'} in {paged.blocks_for(new_request)} blocks, "
        "wherever they are"
    )
    return {
        "new_request_slots": new_request,
        "free_slots": arena.num_free_slots,
        "largest_hole": arena.largest_hole,
        "arena_fits": arena.can_allocate(new_request),
        "paged_fits": fits,
    }


def plot_utilization(arena_util: list[float], paged_util: list[float], out_dir):
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(arena_util, label="contiguous arena")
    ax.plot(paged_util, label=f"paged, block {BLOCK}")
    ax.set(
        xlabel="step", ylabel="live / reserved", ylim=(0, 1.05), title="KV memory utilization on one trace"
    )
    ax.legend()
    save_plot(fig, out_dir, "04_fragmentation.png")


def part2_trace(out_dir, seed: int = 0, steps: int = 400) -> dict:
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
    plot_utilization(arena_util, paged_util, out_dir)
    return {
        "arena_utilization": sum(arena_util) / steps,
        "paged_utilization": sum(paged_util) / steps,
        "arena_refused": refused["arena"],
        "paged_refused": refused["paged"],
    }


def main():
    args = lesson_args(__doc__)  # no model here: the whole lesson takes a second, --quick changes nothing
    refusal = part1_refusal()
    trace = part2_trace(args.out)
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
