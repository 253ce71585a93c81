"""`minillm bench chat-view`: what the chat's live memory panel costs in decode speed.

The chat answers one question again and again, each time through `Chat.reply` as a user would
get it: once with the live panel drawn into a terminal (ANSI colours, 80 columns, redrawn at most
four times a second, `chat_view.py`), once as plain text without a terminal. The two alternate,
round after round, and who goes first alternates too, so that a machine's drift hits both alike.
Each reply decodes the same number of tokens (EOS ignored) and reuses the question's cached
blocks the same way, so decode tokens/s differ only by the drawing. The terminal is /dev/null:
this measures the process's own cost (building and rendering the panel), not the terminal
emulator's, which runs elsewhere.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from rich.console import Console

from minillm.benchmarks.decode import summarize
from minillm.report import print_table

QUESTION = "Explain in a few paragraphs how a KV cache makes text generation faster."


def bench_chat_view(model_dir: Path, rounds: int = 5, max_tokens: int = 128, dtype: str = "float32") -> dict:
    from minillm.chat import Chat
    from minillm.chat.view import ReplyMeter, memory_panel
    from minillm.engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, prefix_caching=True)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    with open(os.devnull, "w") as null:
        consoles = {
            "live": Console(file=null, force_terminal=True, width=80, height=40),
            "plain": Console(file=null, width=80),
        }
        # warm up; the question is cached now
        Chat(llm, params, None, console=consoles["plain"]).reply(QUESTION)
        speeds: dict[str, list[float]] = {"live": [], "plain": []}
        for round_index in range(rounds):
            for view in ("live", "plain") if round_index % 2 == 0 else ("plain", "live"):
                chat = Chat(llm, params, None, console=consoles[view], live=view == "live")
                chat.reply(QUESTION)
                speeds[view].append(chat.last[1].tok_s)
        draw_ms = []
        for _ in range(20):
            start = time.perf_counter()
            consoles["live"].print(memory_panel(llm.engine, ReplyMeter()))
            draw_ms.append((time.perf_counter() - start) * 1000)
    live, plain = summarize(speeds["live"]), summarize(speeds["plain"])
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "blocks": llm.engine.snapshot().num_blocks,
        "live": live,
        "plain": plain,
        "slowdown": 1 - live["tok_s"] / plain["tok_s"],
        "panel_draw_ms": statistics.median(draw_ms),
    }


def print_chat_view_report(report: dict, console) -> None:
    print_table(
        console,
        f"chat decode speed, live panel vs plain text: {report['rounds']} interleaved rounds of "
        f"{report['max_tokens']} tokens ({report['blocks']:,} blocks in the map)",
        ["view", "tok/s median", "best", "spread"],
        [
            [
                name,
                f"{report[name]['tok_s']:.1f}",
                f"{report[name]['best_tok_s']:.1f}",
                f"{report[name]['spread']:.0%}",
            ]
            for name in ("plain", "live")
        ],
    )
    console.print(
        f"the live panel costs {report['slowdown']:.1%} of decode speed (target: under 5%); "
        f"one drawing takes {report['panel_draw_ms']:.1f} ms, at most 4 a second"
    )
