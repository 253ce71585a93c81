"""Lesson 15 — the life of a block: the memory system's data-flow picture, drawn from the run itself.

Before optimizing memory, draw its data flow: where each piece of data comes from, where it goes,
how long it lives, who reads it. A snapshot of the pool (lesson 13) shows where blocks are; it
cannot show time. The memory system tells every change of a block's life as an event
(`minillm/memory/events.py`: allocated, filled, registered, hit, copied, swapped, spilled,
evicted, freed, reused), `--trace FILE` writes them down, and `minillm trace show FILE` draws
them. This lesson:
  (a) traces one busy run with the real model: chat requests sharing a system prompt, long
      documents that share nothing, a device pool too small for all of them and a host tier to
      swap and spill to; arrivals spread over the run;
  (b) draws the picture (blocks x steps coloured by state, one lane per request coloured by where
      its KV lives) and reads off what it reveals: how many requests each prefix block served,
      blocks spilled and never read again, swapped sequences' round trips, how long blocks live,
      the bytes each request reads per step; and the same traffic again spilling only the blocks a
      prompt read again (`spill="reused"`) against the default, every cached block ("all"): what
      each copied, and what came back (this trace is one the rule was chosen on; `minillm bench
      tiers` reports it on others);
  (c) the classic prefix-cache failure: a timestamp at the top of the system prompt makes every
      prompt different from its first block on, and the cache silently stops hitting. The
      explainer (`PrefixMiss`, chat's /why) names the token where the prompt parted from the
      cached one; the fix is to normalize the prompt (what changes per request goes last).

    python lessons/15_life_of_a_block.py [--quick] [--out DIR]

The same run in a browser, block by block and step by step: `minillm trace serve` on the trace
it writes (docs/memory-page.md); a server under load draws it live at /memory.
"""

import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm import trace  # noqa: E402
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.evaluation import read_text  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.tracing import read_trace, tracing  # noqa: E402
from minillm.weights import load_model  # noqa: E402

BLOCK = 16
SETTINGS = {
    "default": {
        "chats": 24,
        "documents": 8,
        "document_tokens": 200,
        "max_tokens": 40,
        "device_blocks": 48,
        "host_blocks": 48,
        "arrive_every": 4,  # steps between arrivals
        "trap_requests": 6,
    },
    "quick": {
        "chats": 6,
        "documents": 2,
        "document_tokens": 120,
        "max_tokens": 12,
        "device_blocks": 16,
        "host_blocks": 24,
        "arrive_every": 2,
        "trap_requests": 3,
    },
}
SYSTEM = (
    "You are the help desk of a public library. Answer in two sentences, plainly, and say when you "
    "do not know. The library opens at nine and closes at six, lends books for three weeks, and "
    "renews a loan twice unless someone else has asked for the book. Members may borrow ten items "
    "at once; children's cards have the same rights. Lost books are replaced at the price printed "
    "inside their cover. The reading room is quiet; the ground floor is not."
)
QUESTIONS = [
    "How long can I keep a book?",
    "Can my daughter borrow books too?",
    "What happens if I lose a book?",
    "When does the library close?",
    "Can I renew a loan three times?",
    "Where can I read in silence?",
    "How many books may I take home?",
    "Is the library open at eight?",
]


# ---------------------------------------------------------------------------- (a) one busy run, traced
def busy_run(model, tokenizer, settings: dict, path, spill: str = "all") -> dict:
    """Chats sharing the system prompt and documents sharing nothing arrive every few steps on a
    pool too small for them all (swap to a host tier, spill cached blocks there: those the `spill`
    rule takes); traced."""
    rng = random.Random(0)
    words = read_text().split()
    prompts = [
        tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in (QUESTIONS * 4)[: settings["chats"]]
    ]
    for _ in range(settings["documents"]):
        start = rng.randrange(len(words) - 2000)
        ids = tokenizer.encode(" ".join(words[start : start + 1000]))[: settings["document_tokens"]]
        prompts.insert(rng.randrange(len(prompts) + 1), ids)
    bytes_per_block = BLOCK * model.config.kv_bytes_per_token(model.dtype)
    with tracing(path):
        llm = LLM(
            model=model,
            tokenizer=tokenizer,
            block_size=BLOCK,
            prefix_caching=True,
            kv_cache_bytes=settings["device_blocks"] * bytes_per_block,
            host_cache_bytes=settings["host_blocks"] * bytes_per_block,
            preemption="swap",
            max_num_seqs=8,
            spill=spill,
        )
        engine, params = llm.engine, SamplingParams(max_tokens=settings["max_tokens"], ignore_eos=True)
        start, arrivals = time.perf_counter(), list(prompts)
        while arrivals or engine.has_unfinished_requests():
            if arrivals and engine.num_steps % settings["arrive_every"] == 0:
                engine.add_request(arrivals.pop(0), params)
            engine.step()
    hit_rate = engine.snapshot().prefix_cache["block_hit_rate"]
    seconds = time.perf_counter() - start
    return {
        "requests": len(prompts),
        "steps": engine.num_steps,
        "seconds": seconds,
        "block_hit_rate": hit_rate,
    }


# ---------------------------------------------------------------------------- (c) the timestamp trap
def timestamp_trap(model, tokenizer, settings: dict) -> dict:
    """The same questions one after another, the time of asking at the top of the system prompt
    (trapped) or at the end of the user's turn (normalized): what the prefix cache gave each,
    and what the explainer says about the second."""
    results = {}
    for name in ("trapped", "normalized"):
        llm = LLM(model=model, tokenizer=tokenizer, block_size=BLOCK, prefix_caching=True)
        outs = []
        for i, question in enumerate(QUESTIONS[: settings["trap_requests"]]):
            now = f"Current time: 2026-12-02 10:{14 + i // 60:02d}:{(7 + 13 * i) % 60:02d}."
            system, user = (
                (f"{now} {SYSTEM}", question) if name == "trapped" else (SYSTEM, f"{question} ({now})")
            )
            prompt = tokenizer.encode_chat(
                [{"role": "system", "content": system}, {"role": "user", "content": user}]
            )
            outs.append(llm.generate([prompt], SamplingParams(max_tokens=4))[0])
        later = outs[1:]
        miss = later[0].prefix_miss_report()
        results[name] = {
            "prompt_tokens": sum(len(out.prompt_token_ids) for out in later),
            "cached_tokens": sum(out.prefix_miss.cached_tokens for out in later),
            "ttft_ms": 1000 * sum(out.ttft for out in later) / len(later),
            "cause": miss["cause"],
            "diverged_at": miss["diverged_at"],
            "why": miss["summary"],
        }
    return results


def show_trap(trap: dict) -> None:
    rows = [
        [name, r["prompt_tokens"], r["cached_tokens"], f"{r['ttft_ms']:.0f}", r["cause"], r["diverged_at"]]
        for name, r in trap.items()
    ]
    columns = ["system prompt", "prompt tokens", "from the cache", "TTFT ms", "explainer", "parted at"]
    table("the timestamp trap: every request after the first", columns, rows)
    console.print(f"[bold]/why, trapped:[/bold] {trap['trapped']['why']}", highlight=False)
    console.print(f"[bold]/why, normalized:[/bold] {trap['normalized']['why']}", highlight=False)


# ---------------------------------------------------------------------------- (b) the picture
def read_back(path, out) -> tuple[dict, str | None]:
    """The run's events read back from the trace file, summarized and drawn (`minillm trace show`)."""
    (events,) = read_trace(path).values()
    view = trace.walk(events)
    summary = trace.summarize(view)
    cell = trace.draw(view, out / "15_life_of_a_block.png", "lesson 15 (b): one busy run, every block's life")
    return summary, cell


def show_picture(run: dict, summary: dict, cell: str | None) -> None:
    reuse, spills, swaps = summary["reuse"], summary["spills"], summary["swaps"]
    device = summary["lifetimes"]["device"]
    reads = summary["reads"]
    rows = [
        ["requests, steps, events", f"{run['requests']}, {summary['steps']}, {summary['events']:,}"],
        [
            "prefix blocks registered / hit / never hit",
            f"{reuse['registered']} / {reuse['hit']} / {reuse['never_hit']}",
        ],
        ["requests per hit prefix block: median, max", _median_max(reuse["requests_per_hit_block"])],
        [
            "steps from a block's release to its next hit: median, max",
            _median_max(reuse["distance_steps"]),
        ],
        [
            "blocks spilled to host / brought back / never read again",
            f"{spills['spilled']} / {spills['brought_back']} / {_unread(spills)}",
        ],
        [
            "swap round trips / blocks out / steps away (median)",
            f"{swaps['round_trips']} / {swaps['blocks_out']} / {_median(swaps['steps_away'])}",
        ],
        [
            "device block contents / steps held (median, max)",
            f"{device['contents']} / {_median_max(device['held_steps'])}",
        ],
        ["steps a freed block waited cached: median, max", _median_max(device["cached_steps"])],
        ["KV MB read per step: median, max", _median_max(reads["bytes_per_step"], 1e-6)],
    ]
    table("what the trace says", ["", "measured"], rows)
    if cell:
        console.print(f"timeline saved ({cell})")


def spill_rules(model, tokenizer, settings: dict, run: dict, summary: dict, out) -> dict:
    """The same traffic spilling only reused blocks, against the traced run (every block spilled)."""
    path = out / "15_trace_spill_reused.jsonl"
    reused = busy_run(model, tokenizer, settings, path, spill="reused")
    (events,) = read_trace(path).values()
    reused_summary = trace.summarize(trace.walk(events))
    return {
        rule: {
            "spilled": s["spills"]["spilled"],
            "brought_back": s["spills"]["brought_back"],
            "never_read": _unread(s["spills"]),
            "block_hit_rate": r["block_hit_rate"],
        }
        for rule, r, s in (("all", run, summary), ("reused", reused, reused_summary))
    }


def show_spill_rules(rules: dict) -> None:
    rows = [
        [rule, r["spilled"], r["brought_back"], r["never_read"], f"{r['block_hit_rate']:.1%}"]
        for rule, r in rules.items()
    ]
    columns = ["spill rule", "spilled", "brought back", "never read again", "block hit rate"]
    table("the same traffic, two spill rules", columns, rows)


def plot_rules_and_trap(rules: dict, trap: dict, out) -> None:
    """The parts the timeline does not show: the two spill rules side by side, and the timestamp trap."""
    fig, (ax_rules, ax_trap) = plt.subplots(1, 2, figsize=(12, 4.2))
    kinds = [
        ("spilled", "spilled to host"),
        ("brought_back", "brought back"),
        ("never_read", "never read again"),
    ]
    for i, (key, label) in enumerate(kinds):
        bars = ax_rules.bar(
            [x + (i - 1) * 0.27 for x in range(len(rules))], [r[key] for r in rules.values()], 0.27
        )
        bars.set_label(label)
        ax_rules.bar_label(bars, fontsize=8)
    ax_rules.set_xticks(range(len(rules)), [f'spill="{rule}"' for rule in rules])
    ax_rules.set_ylabel("blocks")
    ax_rules.legend(fontsize=8)
    ax_rules.set_title(
        "(b) the same traffic, two spill rules; block hit rate "
        + ", ".join(f"{rule} {r['block_hit_rate']:.1%}" for rule, r in rules.items())
    )
    names = list(trap)
    cached = [trap[n]["cached_tokens"] for n in names]
    computed = [trap[n]["prompt_tokens"] - trap[n]["cached_tokens"] for n in names]
    ax_trap.bar(names, cached, label="from the prefix cache", color="tab:green")
    ax_trap.bar(names, computed, bottom=cached, label="prefilled again", color="tab:gray")
    for i, n in enumerate(names):
        ax_trap.text(
            i,
            trap[n]["prompt_tokens"],
            f"TTFT {trap[n]['ttft_ms']:.0f} ms\nparted at token {trap[n]['diverged_at']}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_trap.margins(y=0.2)
    ax_trap.set_ylabel("prompt tokens of the requests after the first")
    ax_trap.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    ax_trap.set_title(
        "(c) the timestamp trap, tokens from the cache: "
        + ", ".join(f"{n} {c}" for n, c in zip(names, cached))
    )
    for ax in (ax_rules, ax_trap):
        ax.title.set_fontsize(10)
    fig.tight_layout()
    save_plot(fig, out, "15_rules_and_trap.png")


def _unread(spills: dict) -> int:
    """Spilled blocks never brought back: dropped from the host, or still there at the end."""
    return spills["dropped_unread"] + spills["on_host_at_end"]


def _median(spread: dict, scale: float = 1.0) -> str:
    return "-" if not spread or spread.get("median") is None else f"{spread['median'] * scale:.3g}"


def _median_max(spread: dict, scale: float = 1.0) -> str:
    if not spread or spread.get("max") is None:
        return "-"
    return f"{spread['median'] * scale:.3g}, {spread['max'] * scale:.3g}"


def meaning(summary: dict, rules: dict, trap: dict) -> str:
    reuse, swaps = summary["reuse"], summary["swaps"]
    trapped, fixed = trap["trapped"], trap["normalized"]
    every, reused = rules["all"], rules["reused"]
    return (
        f"The picture shows time, which no snapshot can: the system prompt's blocks were registered "
        f"once and hit by up to {reuse['requests_per_hit_block']['max'] or 0} requests, while "
        f"{reuse['never_hit']} of {reuse['registered']} registered blocks (documents and answers) were "
        f"never read again. Spilling every cached block that leaves the device copied {every['spilled']} "
        f"blocks to the host, of which {every['brought_back']} came back and {every['never_read']} were "
        f"never read again; spilling only the blocks a prompt read again copied {reused['spilled']} "
        f"({reused['brought_back']} came back), at a block hit rate of {reused['block_hit_rate']:.1%} "
        f"against {every['block_hit_rate']:.1%}: {_rule_verdict(every, reused)} "
        f"{swaps['round_trips']} swap round trips moved sequences out and back. "
        "The timestamp trap: "
        f"with the time at the top of the system prompt the cache gave {trapped['cached_tokens']} of "
        f"{trapped['prompt_tokens']} prompt tokens (the explainer: parted at token "
        f"{trapped['diverged_at']}); with the time moved to the end of the user's turn, "
        f"{fixed['cached_tokens']} of {fixed['prompt_tokens']}, and the first token came in "
        f"{fixed['ttft_ms']:.0f} ms instead of {trapped['ttft_ms']:.0f}. The fix is in the prompt, not "
        "the engine: what changes per request goes last."
    )


def _rule_verdict(every: dict, reused: dict) -> str:
    if reused["block_hit_rate"] >= every["block_hit_rate"]:
        return (
            "fewer copies and no hit lost, since only the shared system prompt is asked for again and "
            "the host no longer fills with blocks nobody reads."
        )
    return (
        "fewer copies, but fewer hits: a block read once so far can still be asked for again (a "
        "system prompt's second request, a conversation's next turn) after it left the device "
        "(`minillm bench tiers` measures the trade on mixed traffic)."
    )


def main() -> None:
    args = lesson_args(__doc__)
    settings = SETTINGS["quick" if args.quick else "default"]
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)  # float32
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "15_trace.jsonl"

    console.rule("1. One busy run, traced")
    run = busy_run(model, tokenizer, settings, path)
    console.print(
        f"{run['requests']} requests in {run['steps']} steps ({run['seconds']:.1f} s); "
        f"the trace: {path} ({path.stat().st_size / 1e6:.1f} MB); `minillm trace show {path}` "
        f"prints what follows, and `minillm trace serve {path}` replays it in the browser, step by "
        "step (docs/memory-page.md)"
    )

    console.rule("2. The picture, and what it reveals")
    summary, cell = read_back(path, args.out)
    show_picture(run, summary, cell)
    rules = spill_rules(model, tokenizer, settings, run, summary, args.out)
    show_spill_rules(rules)

    console.rule("3. The timestamp trap, explained and fixed")
    trap = timestamp_trap(model, tokenizer, settings)
    show_trap(trap)

    plot_rules_and_trap(rules, trap, args.out)
    numbers = {"run": run, "summary": summary, "spill_rules": rules, "trap": trap}
    save_numbers(args.out, "15_life_of_a_block.json", numbers)
    console.print(f"\n[bold]What it means:[/bold] {meaning(summary, rules, trap)}", highlight=False)


if __name__ == "__main__":
    main()
