"""Lesson 02 — why a KV cache: naive decoding is O(n^2), cached decoding is O(n).

The naive decoder recomputes the whole sequence for every new token: step t runs the model over
t tokens. The cached decoder keeps each token's keys and values, so step t runs the model over
one token and only attention reads the t cached positions. We time every step of both, on the
same prompt, and check that they produce the very same tokens.

    python lessons/02_naive_vs_cached.py [--tokens 200] [--quick] [--out DIR]
"""

import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _common import console, lesson_args, require_model, save_numbers, save_plot, table  # noqa: E402

from minillm.decoding import stream  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402
from minillm.tokenizer import Tokenizer  # noqa: E402
from minillm.weights import load_model  # noqa: E402


def step_times(model, prompt_ids, new_tokens, decoder):
    """Seconds spent producing each new token (the first one includes the prompt's prefill)."""
    tokens, times = [], []
    last = time.perf_counter()
    for token, _ in stream(
        model, prompt_ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True), decoder
    ):
        now = time.perf_counter()
        tokens.append(token)
        times.append(now - last)
        last = now
    return tokens, times


def growth(times: list[float]) -> float:
    """Median step of the last quarter over the first quarter (prefill step excluded)."""
    quarter = max(1, (len(times) - 1) // 4)
    return statistics.median(times[-quarter:]) / statistics.median(times[1 : 1 + quarter])


def show_steps(positions: list[int], naive: list[float], cached: list[float]):
    """Milliseconds per new token at a few positions, and the totals."""
    tokens = len(positions)
    marks = sorted({1, tokens // 4, tokens // 2, 3 * tokens // 4, tokens - 1})
    table(
        "milliseconds per new token",
        ["position", "naive", "cached", "naive / cached"],
        [
            [positions[i], f"{naive[i] * 1e3:.0f}", f"{cached[i] * 1e3:.0f}", f"{naive[i] / cached[i]:.1f}x"]
            for i in marks
        ],
    )
    console.print(
        f"total: naive {sum(naive):.1f} s, cached {sum(cached):.1f} s "
        f"({sum(naive) / sum(cached):.1f}x) for {tokens} tokens"
    )


def running_median(values: list[float], width: int = 9) -> list[float]:
    """Each value's median with its neighbours: one step slowed by other work on the machine
    no longer hides the trend."""
    half = width // 2
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def plot_steps(positions: list[int], naive: list[float], cached: list[float], out):
    fig, ax = plt.subplots(figsize=(7, 4))
    for times, label in ((naive, "naive (recompute all)"), (cached, "cached (one token + KV cache)")):
        ms = [t * 1e3 for t in times[1:]]  # the first step includes the prefill
        (line,) = ax.plot(positions[1:], ms, alpha=0.3, linewidth=0.8)
        ax.plot(positions[1:], running_median(ms), color=line.get_color(), label=f"{label}, median of 9")
    ax.set(
        xlabel="position of the new token",
        ylabel="ms per token",
        title=f"Decode cost per token: the naive step grew {growth(naive):.1f}x, "
        f"the cached {growth(cached):.1f}x\n(median of the last quarter over the first; faint: every step)",
    )
    ax.title.set_fontsize(10)
    ax.legend()
    save_plot(fig, out, "02_naive_vs_cached.png")


def main():
    args = lesson_args(
        __doc__,
        lambda parser: parser.add_argument(
            "--tokens", type=int, default=200, help="new tokens to generate (default: 200)"
        ),
        quick={"tokens": 24},
    )

    model_dir = require_model()
    model, tokenizer = load_model(model_dir), Tokenizer(model_dir)
    prompt_ids = tokenizer.encode_chat(
        [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
    )
    console.print(
        f"prompt: {len(prompt_ids)} tokens; generating {args.tokens} greedy tokens with each decoder"
    )

    step_times(model, prompt_ids, 4, "cached")  # warm-up
    cached_tokens, cached = step_times(model, prompt_ids, args.tokens, "cached")
    naive_tokens, naive = step_times(model, prompt_ids, args.tokens, "naive")
    same = naive_tokens == cached_tokens
    console.print(f"identical tokens: [bold]{same}[/bold]")

    positions = [len(prompt_ids) + i for i in range(args.tokens)]
    show_steps(positions, naive, cached)

    plot_steps(positions, naive, cached, args.out)
    save_numbers(
        args.out,
        "02_naive_vs_cached.json",
        {
            "tokens": args.tokens,
            "identical_tokens": same,
            "naive_seconds": sum(naive),
            "cached_seconds": sum(cached),
            "naive_step_growth": growth(naive),
            "cached_step_growth": growth(cached),
        },
    )
    console.print(
        f"\n[bold]What it means:[/bold] the naive step grows with the sequence ({growth(naive):.1f}x "
        f"from the first to the last quarter here, so a whole generation is quadratic), the cached "
        f"step stays nearly flat ({growth(cached):.1f}x) — {sum(naive) / sum(cached):.1f}x faster "
        f"in total for the same tokens, bought with the memory of lesson 01."
    )
    if not same:
        raise SystemExit("naive and cached decoding disagree — that is a bug")


if __name__ == "__main__":
    main()
