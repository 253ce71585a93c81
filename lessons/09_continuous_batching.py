"""Lesson 09 — continuous batching: finished sequences leave and waiting ones join every step.

Static batching runs a batch until its longest member is done; the others sit finished in their
slots, and the queue waits. Continuous (iteration-level) batching refills a slot the moment it
frees. Same engine, same requests, same batch size — only the scheduling policy differs.

    python lessons/09_continuous_batching.py [--quick] [--out DIR]
"""

import random
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.engine import LLM, SamplingParams  # noqa: E402
from minillm.evaluation import read_text  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402

BATCH = 4


def run(model, tokenizer, policy, prompts, params):
    llm = LLM(model=model, tokenizer=tokenizer, scheduling=policy, max_num_seqs=BATCH)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return llm.engine.stats, outputs, elapsed


def start_steps(stats) -> dict[str, int]:
    """The engine step at which each request was first scheduled (its prefill)."""
    first = {}
    for step, batch in enumerate(stats.batches):
        for request_id, _ in batch:
            first.setdefault(request_id, step)
    return first


def timeline(ax, stats, title, num_requests):
    for step, batch in enumerate(stats.batches):
        for request_id, num_tokens in batch:
            color = "tab:orange" if num_tokens > 1 else "tab:blue"
            ax.broken_barh([(step, 1)], (int(request_id) - 0.4, 0.8), color=color)
    ax.set(title=title, ylabel="request", yticks=range(num_requests))


def mixed_requests(tokenizer, num_requests: int, lengths: list[int]) -> tuple[list, list]:
    """Prompts of 16..64 tokens cut from Alice, each with an output length drawn from `lengths`."""
    rng = random.Random(0)
    text = tokenizer.encode(read_text())
    prompts, params = [], []
    for _ in range(num_requests):
        length = rng.randint(16, 64)
        start = int(rng.random() * (len(text) - length))  # one draw at any text length: the mix stays put
        prompts.append(text[start : start + length])
        # some short, some long
        params.append(SamplingParams(max_tokens=rng.choice(lengths), ignore_eos=True))
    return prompts, params


def show_comparison(results: dict) -> dict:
    """One table row per policy; returns the numbers the JSON keeps."""
    rows, numbers = [], {}
    for policy, (stats, outputs, elapsed) in results.items():
        ttft = sum(o.ttft for o in outputs) / len(outputs)
        start_step = sum(start_steps(stats).values()) / len(outputs)
        rows.append(
            [
                policy,
                stats.steps,
                f"{stats.tokens_generated / elapsed:.1f}",
                f"{ttft:.2f} s",
                f"{start_step:.1f}",
                f"{sum(len(b) for b in stats.batches) / stats.steps:.1f}",
            ]
        )
        numbers |= {
            f"{policy}_steps": stats.steps,
            f"{policy}_mean_start_step": start_step,
            f"{policy}_mean_ttft_s": ttft,
            f"{policy}_tokens_per_s": stats.tokens_generated / elapsed,
        }
    table(
        "same requests, same engine",
        ["scheduling", "steps", "output tok/s", "mean TTFT", "mean start step", "sequences per step"],
        rows,
    )
    return numbers


def main():
    args = lesson_args(__doc__)
    num_requests, lengths = (8, [2, 4, 16]) if args.quick else (12, [4, 8, 48])
    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    prompts, params = mixed_requests(tokenizer, num_requests, lengths)
    console.print(
        f"{num_requests} requests, batch size {BATCH}, outputs of {lengths[0]}, {lengths[1]} or "
        f"{lengths[2]} tokens"
    )

    results = {policy: run(model, tokenizer, policy, prompts, params) for policy in ("static", "continuous")}
    numbers = show_comparison(results)
    same = [o.token_ids for o in results["static"][1]] == [o.token_ids for o in results["continuous"][1]]
    console.print(f"identical outputs under both policies: [bold]{same}[/bold]")
    if not same:  # the batching policy changes when a request runs, never what it says
        raise SystemExit("static and continuous batching gave different tokens: a bug")

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for ax, policy in zip(axes, ("static", "continuous")):
        said = (
            f"{numbers[f'{policy}_steps']} steps, mean start step {numbers[f'{policy}_mean_start_step']:.1f}"
        )
        timeline(
            ax, results[policy][0], f"{policy} batching: {said} (orange: prefill, blue: decode)", len(prompts)
        )
    axes[-1].set_xlabel("engine step")
    fig.tight_layout()
    save_plot(fig, args.out, "09_continuous_batching.png")
    save_numbers(
        args.out,
        "09_continuous_batching.json",
        {"requests": num_requests, "identical_outputs": same, **numbers},
    )
    console.print(
        f"\n[bold]What it means:[/bold] under static batching short requests finish and leave "
        f"empty slots until the longest one ends; continuous batching fills them at once. "
        f"{steps_verdict(numbers)}, with the very same outputs."
    )


def steps_verdict(numbers: dict) -> str:
    """Steps and start times of the two policies, said as they came out."""
    steps = f"{numbers['continuous_steps']} steps against {numbers['static_steps']}"
    starts = (
        f"waiting requests started at step {numbers['continuous_mean_start_step']:.1f} on average "
        f"against {numbers['static_mean_start_step']:.1f}"
    )
    if numbers["continuous_steps"] < numbers["static_steps"]:
        return f"Here the same work took fewer steps ({steps}) and {starts}"
    return f"Here that saved no steps ({steps}; the longest request set the pace) and {starts}"


if __name__ == "__main__":
    main()
