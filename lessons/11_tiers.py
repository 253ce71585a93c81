"""Lesson 11 — tiers: hot KV in the device pool, warm KV in host memory, cold KV in a file.

The device pool is the memory attention reads every step, and it is small. A chat that goes
idle keeps blocks there that nobody reads until its user comes back — or loses them to the
prefix cache's LRU, and then its whole history is prefilled again. Three ways to keep KV
further away, each measured here with the real model:
  (a) warm: with a host tier, a cached prefix block pushed out of the device pool spills to host
      memory instead of being dropped, and a returning conversation copies it back instead of
      recomputing it (SGLang's HiCache). Many interleaved chats with idle gaps, with and
      without the host tier: how many turns find their whole history, how much prefill is saved.
  (b) hiding the copy: the swapped-out sequence that runs next is copied back one step early,
      on a background thread, while the current forward pass runs (prefetch). How much of that
      copying did the engine never wait for?
  (c) cold: a finished conversation parked in one file (`save_session`) and loaded by a fresh
      engine, which then prefills only the new turn. Its time to first token against
      recomputing the history.

    python lessons/11_tiers.py [--quick] [--out DIR]
"""

import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.benchmarks.stats import mib  # noqa: E402
from minillm.benchmarks.tiers.preemption import preemption_run  # noqa: E402
from minillm.benchmarks.tiers.sessions import bench_resume  # noqa: E402
from minillm.benchmarks.workload import (  # noqa: E402
    Prose,
    assistant_header,
    chat_message,
    next_turn_prompt,
    pool_bytes,
    uniform_trace,
)
from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

BLOCK = 16
# per mode: (a) chats, and the device and host pools in blocks; (b) a swap-heavy trace; (c) the parked chat
SETTINGS = {
    "default": {
        "conversations": 10,
        "turns": 3,
        "message_tokens": 40,
        "reply_tokens": 4,
        "device_blocks": 24,
        "host_blocks": 160,
        "swap_requests": 8,
        "swap_prompt_lens": (24, 48),
        "swap_max_tokens": 48,
        "swap_device_tokens": 192,
        "history_tokens": 512,
    },
    "quick": {
        "conversations": 4,
        "turns": 2,
        "message_tokens": 32,
        "reply_tokens": 2,
        "device_blocks": 6,
        "host_blocks": 32,
        "swap_requests": 5,
        "swap_prompt_lens": (16, 40),
        "swap_max_tokens": 20,
        "swap_device_tokens": 128,
        "history_tokens": 256,
    },
}


def user_turn(tokenizer, message_ids: list[int]) -> list[int]:
    """One ChatML user turn and the assistant's header (`workload`'s conversations)."""
    return [*chat_message(tokenizer, "user", message_ids), *assistant_header(tokenizer)]


# ---------------------------------------------------------------- (a) warm: idle chats and the host tier
def chat_messages(tokenizer, settings: dict) -> list[list[list[int]]]:
    """conversation -> its users' messages (token ids), each a different stretch of Alice."""
    prose, rng = Prose(tokenizer), random.Random(1)
    turns = range(settings["turns"])
    return [
        [prose.cut(settings["message_tokens"], rng) for _ in turns] for _ in range(settings["conversations"])
    ]


def interleaving(settings: dict) -> list[int]:
    """The order turns arrive: every conversation `turns` times, shuffled (a conversation's own
    turns stay in order), so idle gaps vary from none to most of the trace."""
    order = [c for c in range(settings["conversations"]) for _ in range(settings["turns"])]
    random.Random(2).shuffle(order)
    return order


def serve_chats(model, tokenizer, messages, order, settings: dict, host_blocks: int) -> dict:
    """Serve the turns one after another on a small device pool (and a host tier of `host_blocks`).
    For every returning turn, log its idle gap (tokens other chats computed since its last turn)
    and how much of its history the prefix cache still held."""
    llm = LLM(
        model=model,
        tokenizer=tokenizer,
        block_size=BLOCK,
        prefix_caching=True,
        kv_cache_bytes=pool_bytes(model, settings["device_blocks"] * BLOCK),
        host_cache_bytes=pool_bytes(model, host_blocks * BLOCK),
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=settings["reply_tokens"], ignore_eos=True)
    history = {}  # conversation -> its last prompt and the answer it got
    turn_of, last_seen, traffic, returns = {c: 0 for c in range(len(messages))}, {}, 0, []
    start = time.perf_counter()
    for conv in order:
        message = user_turn(tokenizer, messages[conv][turn_of[conv]])
        prompt = next_turn_prompt(tokenizer, *history[conv], message) if conv in history else message
        hits_before = engine.prefix_hit_tokens()
        out = llm.generate([prompt], params)[0]
        if conv in history:
            findable = max(1, (len(prompt) - len(message) - 1) // BLOCK)  # full blocks the history can supply
            found = (engine.prefix_hit_tokens() - hits_before) // BLOCK
            returns.append({"gap": traffic - last_seen[conv], "found": found / findable, "ttft": out.ttft})
        history[conv] = (prompt, out.token_ids)
        turn_of[conv] += 1
        traffic += len(prompt)
        last_seen[conv] = traffic
    memory = engine.snapshot()
    stats, counters = memory.prefix_cache, memory.counters
    return {
        "host_blocks": host_blocks,
        "seconds": time.perf_counter() - start,
        "returns": returns,
        "resumed_turns": sum(r["found"] == 1 for r in returns),
        "returning_turns": len(returns),
        "prompt_tokens": stats["prompt_tokens"],
        "prefill_saved": stats["prefill_tokens_saved"],
        "token_hit_rate": stats["token_hit_rate"],
        "spilled": counters["spilled"],
        "spill_hits": counters["spill_hits"],
        "bytes_host_to_device": memory.stats.bytes_moved.get("host->device", 0),
    }


def show_chats(runs: dict, settings: dict) -> None:
    rows = [
        [label, *[fmt(run) for run in runs.values()]]
        for label, fmt in (
            (
                "returning turns that found their whole history",
                lambda r: f"{r['resumed_turns']} / {r['returning_turns']}",
            ),
            ("prompt tokens", lambda r: r["prompt_tokens"]),
            ("...prefilled", lambda r: r["prompt_tokens"] - r["prefill_saved"]),
            ("...found in the prefix cache", lambda r: r["prefill_saved"]),
            ("prefix-cache hit rate (tokens)", lambda r: f"{r['token_hit_rate']:.0%}"),
            ("cached blocks spilled to host", lambda r: r["spilled"]),
            ("...copied back for a later prompt", lambda r: r["spill_hits"]),
            (
                "mean TTFT of returning turns, ms",
                lambda r: f"{sum(x['ttft'] for x in r['returns']) / len(r['returns']) * 1e3:.0f}",
            ),
            ("seconds", lambda r: f"{r['seconds']:.1f}"),
        )
    ]
    table(
        f"(a) {settings['conversations']} chats x {settings['turns']} turns, interleaved; device pool "
        f"{settings['device_blocks'] * BLOCK} tokens, host tier {settings['host_blocks'] * BLOCK}",
        ["", *runs],
        rows,
    )


# ---------------------------------------------------------------- (b) prefetch: copies behind compute
def serve_swapping(model, tokenizer, settings: dict) -> dict:
    """Requests that crowd each other out of a small device pool, all at t=0, preempted by swap:
    `bench tiers`' own run (`preemption_run`) on a trace of the lesson's sizes."""
    lengths = (settings["swap_max_tokens"], settings["swap_max_tokens"])
    trace = uniform_trace(tokenizer, settings["swap_requests"], settings["swap_prompt_lens"], lengths)
    roomy = sum(len(r.prompt_ids) + r.output_len + BLOCK for r in trace)
    pools = (pool_bytes(model, settings["swap_device_tokens"]), pool_bytes(model, roomy))
    row, _, _ = preemption_run(model, tokenizer, trace, "swap", pools, {})
    return {
        "seconds": row["elapsed_s"],
        "swapped_out": row["swapped_out"],
        "swapped_in": row["swapped_in"],
        "prefetched": row["prefetched"],
        "prefetch_seconds": row["prefetch_copy_s"],
        "prefetch_waited": row["prefetch_waited_s"],
        "hidden_share": row["prefetch_hidden"] or 0.0,
    }


def show_swapping(run: dict, settings: dict) -> None:
    table(
        f"(b) {settings['swap_requests']} requests on a {settings['swap_device_tokens']}-token device pool, "
        "preemption by swap",
        ["swapped out", "swapped in", "of them prefetched", "prefetch copy ms", "engine waited ms", "hidden"],
        [
            [
                run["swapped_out"],
                run["swapped_in"],
                run["prefetched"],
                f"{run['prefetch_seconds'] * 1e3:.1f}",
                f"{run['prefetch_waited'] * 1e3:.1f}",
                f"{run['hidden_share']:.0%}",
            ]
        ],
    )


# ---------------------------------------------------------------- (c) cold: a session in a file
def park_and_resume(model, tokenizer, settings: dict) -> dict:
    """A conversation's next turn answered by a fresh engine twice: recomputing the history, and
    from the session file the first engine parked it in: `bench tiers`' own part (`bench_resume`)."""
    run = bench_resume(model, tokenizer, settings["history_tokens"], {})
    return {
        "history_tokens": run["history_tokens"],
        "prompt_tokens": run["prompt_tokens"],
        "session_tokens": run["session_tokens"],
        "file_bytes": run["session_file_bytes"],
        "save_seconds": run["save_s"],
        "load_seconds": run["load_s"],
        "resumed_ttft": run["load_s"] + run["resume"]["ttft_s"],
        "resumed_computed": run["resume"]["prefill_tokens_computed"],
        "recomputed_ttft": run["recompute"]["ttft_s"],
        "recomputed_computed": run["recompute"]["prefill_tokens_computed"],
    }


def show_session(run: dict) -> None:
    table(
        f"(c) the next turn of a {run['history_tokens']}-token conversation, in a fresh engine "
        f"(session file {mib(run['file_bytes'])} MiB, {run['session_tokens']} tokens, "
        f"saved in {run['save_seconds'] * 1e3:.0f} ms)",
        ["start from", "tokens prefilled", "time to first token ms"],
        [
            [
                f"the session file (load {run['load_seconds'] * 1e3:.0f} ms included)",
                run["resumed_computed"],
                f"{run['resumed_ttft'] * 1e3:.0f}",
            ],
            [
                "nothing: recompute the history",
                run["recomputed_computed"],
                f"{run['recomputed_ttft'] * 1e3:.0f}",
            ],
        ],
    )


# ---------------------------------------------------------------- the story
def plot(chats: dict, swapping: dict, session: dict, settings: dict, out) -> None:
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4), gridspec_kw={"width_ratios": [2, 1, 1]})
    for (name, run), marker in zip(chats.items(), ("x", "o")):
        left.scatter(
            [r["gap"] for r in run["returns"]],
            [r["found"] * 100 for r in run["returns"]],
            marker=marker,
            label=f"{name}: {run['resumed_turns']} of {run['returning_turns']} found it all",
            alpha=0.8,
        )
    device, host = settings["device_blocks"] * BLOCK, settings["host_blocks"] * BLOCK
    left.axvline(device, color="tab:blue", linestyle=":", label=f"device pool ({device} tokens)")
    left.axvline(
        device + host, color="tab:orange", linestyle=":", label=f"device + host ({device + host} tokens)"
    )
    left.set(
        xlabel="idle gap: prompt tokens of other chats since its last turn",
        ylabel="% of history found",
        title="(a) Does a returning chat find its KV?",
    )
    left.legend(fontsize=8)
    waited = swapping["prefetch_waited"] * 1e3
    hidden = swapping["prefetch_seconds"] * 1e3 - waited
    middle.bar(["prefetch copies"], [hidden], label="hidden behind compute", color="tab:green")
    middle.bar(["prefetch copies"], [waited], bottom=[hidden], label="waited for", color="tab:red")
    said = f"{swapping['hidden_share']:.0%} hidden" if swapping["prefetched"] else "none in this run"
    middle.set(ylabel="copy time (ms)", title=f"(b) Prefetch: {said}")
    middle.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    resumed, recomputed = session["resumed_ttft"] * 1e3, session["recomputed_ttft"] * 1e3
    right.bar(
        ["resume\nfrom file", "recompute\nhistory"], [resumed, recomputed], color=["tab:blue", "tab:gray"]
    )
    faster = f"{recomputed / resumed:.1f}x faster" if resumed < recomputed else "no faster"
    right.set(
        ylabel="time to first token (ms)",
        title=f"(c) A {session['history_tokens']}-token chat, cold:\nfrom the file {faster}",
    )
    fig.tight_layout()
    save_plot(fig, out, "11_tiers.png")


def main():
    args = lesson_args(__doc__)
    settings = SETTINGS["quick" if args.quick else "default"]
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)

    console.rule("(a) Warm: idle chats, with and without a host tier")
    messages, order = chat_messages(tokenizer, settings), interleaving(settings)
    chats = {
        "device only": serve_chats(model, tokenizer, messages, order, settings, host_blocks=0),
        "device + host": serve_chats(model, tokenizer, messages, order, settings, settings["host_blocks"]),
    }
    show_chats(chats, settings)

    console.rule("(b) Prefetch: swap-ins copied behind the forward pass")
    swapping = serve_swapping(model, tokenizer, settings)
    show_swapping(swapping, settings)

    console.rule("(c) Cold: a conversation parked in a file, resumed by a fresh engine")
    session = park_and_resume(model, tokenizer, settings)
    show_session(session)
    plot(chats, swapping, session, settings, args.out)

    none, host = chats["device only"], chats["device + host"]
    numbers = {
        "conversations": settings["conversations"],
        "turns": settings["turns"],
        "device_tokens": settings["device_blocks"] * BLOCK,
        "host_tokens": settings["host_blocks"] * BLOCK,
        **{
            f"{key}_{name}": run[name]
            for key, run in (("none", none), ("host", host))
            for name in (
                "resumed_turns",
                "returning_turns",
                "prompt_tokens",
                "prefill_saved",
                "token_hit_rate",
                "spilled",
                "spill_hits",
                "bytes_host_to_device",
                "seconds",
            )
        },
        **{f"swap_{name}": value for name, value in swapping.items()},
        **{f"session_{name}": value for name, value in session.items()},
    }
    save_numbers(args.out, "11_tiers.json", numbers)

    console.print(f"\n[bold]What it means:[/bold] {meaning(chats, swapping, session, settings)}")


def meaning(chats: dict, swapping: dict, session: dict, settings: dict) -> str:
    """The closing paragraph, every claim in it read off this run's numbers."""
    none, host = chats["device only"], chats["device + host"]
    warm = (
        f"(a) With the device pool alone ({settings['device_blocks'] * BLOCK} tokens), "
        f"{none['resumed_turns']} of {none['returning_turns']} returning turns found their whole history; "
        f"with a host tier of {settings['host_blocks'] * BLOCK} tokens behind it, {host['resumed_turns']} "
        f"did ({host['spill_hits']} spilled blocks copied back instead of recomputed), and prefill fell from "
        f"{none['prompt_tokens'] - none['prefill_saved']} to {host['prompt_tokens'] - host['prefill_saved']} "
        f"tokens (prefix hit rate {none['token_hit_rate']:.0%} -> {host['token_hit_rate']:.0%})."
    )
    if swapping["prefetched"]:
        prefetch = (
            f"(b) Of {swapping['swapped_in']} swap-ins, {swapping['prefetched']} were prefetched; the "
            f"engine waited {swapping['prefetch_waited'] * 1e3:.1f} ms of their "
            f"{swapping['prefetch_seconds'] * 1e3:.1f} ms of copying, so {swapping['hidden_share']:.0%} ran "
            "behind the forward pass (on a CPU-only machine the copy thread shares the forward pass's cores "
            "and memory, so hidden is not free)."
        )
    else:
        prefetch = (
            f"(b) None of the {swapping['swapped_in']} swap-ins was prefetched in this run: nothing to hide."
        )
    cold = (
        f"(c) A fresh engine answered the next turn of a {session['history_tokens']}-token chat in "
        f"{session['resumed_ttft'] * 1e3:.0f} ms "
        f"from its {mib(session['file_bytes'])} MiB session file "
        f"(load included, {session['resumed_computed']} tokens prefilled), against "
        f"{session['recomputed_ttft'] * 1e3:.0f} ms recomputing all {session['recomputed_computed']}: "
        + (
            f"{session['recomputed_ttft'] / session['resumed_ttft']:.1f}x faster from the file."
            if session["resumed_ttft"] < session["recomputed_ttft"]
            else "reading the file cost more than recomputing here, so the session saved no time."
        )
    )
    return f"{warm} {prefetch} {cold}"


if __name__ == "__main__":
    main()
