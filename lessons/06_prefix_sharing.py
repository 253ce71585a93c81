"""Lesson 06 — prefix sharing: many requests, one copy of the shared system prompt.

Requests to a chat service mostly start alike: the same system prompt, the same instructions.
Their leading KV blocks are identical, so the prefix cache keeps one copy and points every
request's block table at it: the prompt is neither recomputed nor stored twice. We draw the block
tables of concurrent requests, count the prefill saved, and show the classic pitfall: a system
prompt with the current time in it is different for every request, so nothing is shared — until
the volatile part is moved out of the shared prefix.

    python lessons/06_prefix_sharing.py [--quick] [--out DIR]
"""

import datetime
from collections import Counter

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

SYSTEM = (
    "You are a support assistant for a library. Answer briefly and politely. Opening hours are 9 to 17 on "
    "weekdays and 10 to 14 on Saturdays. Members may borrow up to ten books for three weeks."
)
QUESTIONS = [
    "When do you open on Saturday?",
    "How many books can I borrow?",
    "How long can I keep a book?",
    "Are you open on Sunday?",
]


def draw_tables(memory, names):
    """The running sequences' block tables in a `MemorySnapshot`, a block marked where several hold it."""
    holders = Counter(block for seq in memory.sequences for block in seq.table)
    for seq in memory.running():
        cells = [f"[{b:>3}]{'*' if holders[b] > 1 else ' '}" for b in seq.table]
        console.print(f"{names[seq.request_id]:<34} " + "".join(cells))
    console.print(
        f"\\[n] = physical block, * = held by several requests now; "
        f"{memory.prefix_cache['cached_blocks']} blocks cached"
    )


def serve(model, tokenizer, prompts, title, new_tokens, draw=False):
    llm = LLM(model=model, tokenizer=tokenizer, prefix_caching=True, block_size=16)
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(prompts[0], params)  # the first request fills the cache ...
    while engine.has_unfinished_requests():
        engine.step()
    names = {
        engine.add_request(p, params): f"request {i}: {QUESTIONS[i % len(QUESTIONS)][:22]}"
        for i, p in enumerate(prompts)
        if i
    }  # ... the others arrive together
    engine.step()
    if draw:
        draw_tables(engine.snapshot(), names)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.snapshot().prefix_cache
    shared = max(m.shared_slots * m.bytes_per_slot for m in engine.stats.memory)
    return [
        title,
        sum(len(p) for p in prompts),
        engine.stats.tokens_computed - engine.stats.tokens_generated + len(prompts),
        stats["prefill_tokens_saved"],
        f"{stats['block_hit_rate']:.0%}",
        f"{shared / 2**20:.2f} MiB",
    ]


def chat(tokenizer, system, question):
    return tokenizer.encode_chat(
        [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def serve_timestamped(model, tokenizer, new_tokens: int) -> tuple[list, list]:
    """The same requests with a timestamp first in the system prompt, then moved into the turn."""
    start = datetime.datetime(2026, 11, 29, 9, 0, 0)
    stamped = [
        chat(tokenizer, f"Current time: {start + datetime.timedelta(seconds=7 * i)}. {SYSTEM}", q)
        for i, q in enumerate(QUESTIONS + QUESTIONS[:1])
    ]
    stamped_row = serve(model, tokenizer, stamped, "timestamp first", new_tokens)
    fixed = [
        chat(tokenizer, SYSTEM, f"(current time: {start + datetime.timedelta(seconds=7 * i)}) {q}")
        for i, q in enumerate(QUESTIONS + QUESTIONS[:1])
    ]
    fixed_row = serve(model, tokenizer, fixed, "timestamp in the turn", new_tokens)
    return stamped_row, fixed_row


def main():
    args = lesson_args(__doc__)
    new_tokens = 4 if args.quick else 12  # the prefill is the point; a few decode steps keep the tables alive
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    console.rule("1. Four requests, one system prompt: their block tables")
    same = [chat(tokenizer, SYSTEM, q) for q in QUESTIONS + QUESTIONS[:1]]
    shared_row = serve(model, tokenizer, same, "same system prompt", new_tokens, draw=True)

    console.rule("2. The pitfall: a timestamp at the start of the system prompt")
    stamped_row, fixed_row = serve_timestamped(model, tokenizer, new_tokens)
    table(
        "5 requests, the first alone, then 4 together",
        [
            "system prompt",
            "prompt tokens",
            "prefill computed",
            "prefill saved",
            "block hit rate",
            "KV shared (peak)",
        ],
        [shared_row, stamped_row, fixed_row],
    )
    save_numbers(
        args.out,
        "06_prefix_sharing.json",
        {
            "prompt_tokens": shared_row[1],
            "same_prompt_prefill_computed": shared_row[2],
            "same_prompt_prefill_saved": shared_row[3],
            "timestamp_first_prefill_computed": stamped_row[2],
            "timestamp_first_prefill_saved": stamped_row[3],
            "timestamp_in_turn_prefill_computed": fixed_row[2],
            "timestamp_in_turn_prefill_saved": fixed_row[3],
        },
    )
    plot([shared_row, stamped_row, fixed_row], args.out)
    console.print(f"\n[bold]What it means:[/bold] {meaning(shared_row, stamped_row, fixed_row)}")


def plot(rows: list[list], out_dir) -> None:
    """Each system prompt's prefill: tokens computed and tokens the prefix cache saved, stacked
    (together: the prompts' tokens)."""
    names = [row[0] for row in rows]
    computed, saved = [row[2] for row in rows], [row[3] for row in rows]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.bar(names, computed, color="tab:gray", label="prefill computed")
    ax.bar(names, saved, bottom=computed, color="tab:green", label="prefill saved by the prefix cache")
    for x, (done, kept) in enumerate(zip(computed, saved)):
        ax.text(x, done + kept, f"{kept / (done + kept):.0%} saved", ha="center", va="bottom")
    best = names[saved.index(max(saved))]
    ax.set(ylabel="prompt tokens", title=f"5 requests' prefill: most saved with '{best}'")
    ax.set_ylim(0, 1.45 * max(c + s for c, s in zip(computed, saved)))
    ax.legend(loc="upper left", fontsize=8)
    save_plot(fig, out_dir, "06_prefix_sharing.png")


def meaning(shared_row: list, stamped_row: list, fixed_row: list) -> str:
    """The closing sentence, each claim read off the three runs' prefill saved (column 3)."""
    saved, stamped, fixed = shared_row[3], stamped_row[3], fixed_row[3]
    if saved == 0:
        return "the shared system prompt saved no prefill here: its blocks were not found again."
    said = (
        f"a shared prefix is computed once and stored once ({saved} of {shared_row[1]} prompt tokens "
        "not recomputed here); "
    )
    if stamped < saved:
        said += f"one changing byte near the start breaks the hash chain after it (saved: {stamped})"
    else:
        said += f"a timestamp at the start cost nothing here (saved: {stamped})"
    if fixed > stamped:
        return said + f", so keep volatile text out of the shared prefix (saved again: {fixed})."
    return said + f"; moving it into the turn saved no more (saved: {fixed})."


if __name__ == "__main__":
    main()
