"""Lesson 16 — the memory system across processes: a KV store engines share, a router that sends
each request where its prefix lives.

One engine's memory system stops at its process: device pool, host pool, disk. A fleet of engines
recomputes the same system prompts and conversation histories on whichever engine a request lands,
unless (1) the engines share their KV through a store (LMCache and SGLang's HiCache keep KV blocks
in Redis or Mooncake), or (2) a router sends each request to the engine that already holds its
prefix (NVIDIA Dynamo's KV router, llm-d), knowing who holds what from the engines' KV events.
minillm has both: `minillm serve --remote-kv redis://HOST:PORT` and `minillm route --engine URL ...`
(`minillm/memory/remote.py`, `minillm/route/`). This lesson starts them as a person would (a real
`redis-server`, engines in their own processes with one thread each, the router in front) and:
  (a) asks engine B for a long prefix engine A computed: TTFT when B recomputes it (no store),
      reads it from the store, or when the router sends the request home to A; the bytes that
      crossed; the greedy fp32 answers, which must be the same tokens;
  (b) sends `bench scheduling`'s traffic (questions, requests on shared system prompts, multi-turn
      chats, documents) to two engines, round-robin and through the KV-aware router: the fleet's
      prefix hit rate, goodput and TTFT;
  (c) draws, from each engine's KV events (`--trace`), which engine held which blocks over time,
      and how many of them the other engine held too: the same KV computed and kept twice.

    python lessons/16_memory_across_processes.py [--quick] [--out DIR]
"""

import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.benchmarks.fleet import SIZES, redis_server  # noqa: E402
from minillm.benchmarks.fleet.routing import POLICIES, fleet_run  # noqa: E402
from minillm.benchmarks.fleet.store import store_ttft  # noqa: E402
from minillm.route.index import BlockIndex  # noqa: E402
from minillm.serve.kv_events import VllmEvents  # noqa: E402
from minillm.tracing import read_trace  # noqa: E402

SETTINGS = {
    "default": {"prefix_tokens": 1000, "repeats": 2, "requests": 40, "rate": 2.0},
    "quick": {"prefix_tokens": 256, "repeats": 1, "requests": 12, "rate": 4.0},
}
SAMPLE_S = 0.25  # the picture's time step
NO_SLO = {
    "ttft_s": float("inf"),
    "tpot_s": float("inf"),
}  # latency is reported, not judged (`bench fleet` does)


# ---------------------------------------------------------------------------- (c) who held what, when
def holdings(trace_dir: Path, engines: int) -> dict:
    """Replay the engines' KV events in time order into one index (the router's own,
    `route/index.py`): every SAMPLE_S seconds, the blocks each engine held and how many of them
    the other held too. Each engine's clock starts when it did (they start together)."""
    events = []
    for engine in range(engines):
        translate = VllmEvents()
        for run in read_trace(trace_dir / f"engine-{engine}.jsonl").values():
            events += [(seconds, engine, translate(event)) for _, seconds, event in run]
    events.sort(key=lambda item: item[0])
    index, samples, next_sample = BlockIndex(), [], 0.0
    for seconds, engine, shaped in events:
        while seconds >= next_sample:
            samples.append(_sample(index, next_sample, engines))
            next_sample += SAMPLE_S
        index.apply(str(engine), shaped)
    samples.append(_sample(index, next_sample, engines))
    return {
        "seconds": [s[0] for s in samples],
        "held": [s[1] for s in samples],
        "shared": [s[2] for s in samples],
    }


def _sample(index: BlockIndex, seconds: float, engines: int) -> tuple:
    names = [str(engine) for engine in range(engines)]
    return seconds, [index.blocks_held(n) for n in names], [index.blocks_shared(n) for n in names]


def draw(pictures: dict, out: Path) -> Path:
    fig, axes = plt.subplots(1, len(pictures), figsize=(12, 4), sharey=True)
    for ax, (policy, picture) in zip(axes, pictures.items()):
        for engine, colour in zip(range(len(picture["held"][0])), ("tab:blue", "tab:orange")):
            held = [h[engine] for h in picture["held"]]
            shared = [s[engine] for s in picture["shared"]]
            ax.plot(picture["seconds"], held, color=colour, label=f"engine {engine}: blocks cached")
            ax.fill_between(
                picture["seconds"],
                shared,
                color=colour,
                alpha=0.3,
                label=f"engine {engine}: also on the other",
            )
        ax.set_title(f"{policy}: which engine held which prefix blocks")
        ax.set_xlabel("seconds since the engines started")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("cached KV blocks")
    return save_plot(fig, out, "16_memory_across_processes.png")


def main() -> None:
    args = lesson_args(__doc__)
    model_dir = require_model()
    settings = SETTINGS["quick" if args.quick else "default"]
    sizes = {**SIZES["quick"], "requests": settings["requests"]}

    console.print("(a) a shared prefix computed on engine A, asked of engine B")
    with redis_server() as store_url:
        store = store_ttft(model_dir, store_url, settings["prefix_tokens"], settings["repeats"], [])
    ms = {name: store[f"{name}_s"]["median"] * 1000 for name in ("recompute", "store", "home")}
    table(
        f"TTFT of a {store['prefix_tokens']}-token shared prefix + a question on a second engine",
        ["where its KV comes from", "TTFT ms (median)"],
        [
            ["B recomputes it (no store)", f"{ms['recompute']:.0f}"],
            ["B reads it from the store", f"{ms['store']:.0f}"],
            ["the router sends it home to A", f"{ms['home']:.0f}"],
        ],
    )
    console.print(
        f"{store['bytes_read'] / 2**20:.1f} MiB crossed from the store; the answers are "
        f"{'the same tokens' if store['identical'] else 'DIFFERENT'} either way."
    )

    console.print("\n(b) bench scheduling's traffic over two engines: round-robin, then the KV-aware router")
    runs, pictures = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for policy in POLICIES:
            trace_dir = Path(scratch) / policy
            trace_dir.mkdir()
            runs[policy] = fleet_run(
                model_dir, sizes, policy, False, 1, settings["rate"], NO_SLO, False, trace_dir
            )
            pictures[policy] = holdings(trace_dir, sizes["engines"])
    table(
        f"two engines, {runs['kv']['requests']} requests at {settings['rate']} requests/s",
        ["routing", "prefix hit rate", "TTFT p50 ms", "TTFT p99 ms", "blocks kept twice (peak)"],
        [
            [
                policy,
                f"{run['prefix_hit_rate']:.0%}",
                f"{run['ttft_p50_s'] * 1000:.0f}",
                f"{run['ttft_p99_s'] * 1000:.0f}",
                max(sum(s) for s in pictures[policy]["shared"]),
            ]
            for policy, run in runs.items()
        ],
    )
    plot = draw(pictures, args.out)

    numbers = {
        "store": store,
        "runs": {
            policy: {k: v for k, v in run.items() if k != "first_errors"} for policy, run in runs.items()
        },
        "pictures": pictures,
    }
    save_numbers(args.out, "16_memory_across_processes.json", numbers)
    console.print(
        f"\n[bold]What it means:[/bold] {meaning(ms, runs, pictures)} Plot: {plot}", highlight=False
    )


def meaning(ms: dict, runs: dict, pictures: dict) -> str:
    """The closing sentence, from this run's numbers."""
    speedup, home = ms["recompute"] / ms["store"], ms["recompute"] / ms["home"]
    rr, kv = runs["round-robin"]["prefix_hit_rate"], runs["kv"]["prefix_hit_rate"]
    twice = {policy: max(sum(s) for s in picture["shared"]) for policy, picture in pictures.items()}
    store = (
        f"reading a shared prefix from the store gave the first token {speedup:.1f}x sooner than computing "
        "it again"
        if speedup > 1
        else "reading a shared prefix from the store did not beat computing it here"
    )
    routed = (
        f"the router found {kv:.0%} of prompt tokens cached against round-robin's {rr:.0%}"
        if kv > rr
        else f"the router's hit rate ({kv:.0%}) did not beat round-robin's ({rr:.0%}) on this short trace"
    )
    return (
        f"Across processes, {store}, and sending the request home was {home:.1f}x sooner still; {routed}, "
        f"and kept at most {twice['kv']} blocks on both engines at once where round-robin kept "
        f"{twice['round-robin']}: a router saves the second copy, a store saves the second computation."
    )


if __name__ == "__main__":
    main()
