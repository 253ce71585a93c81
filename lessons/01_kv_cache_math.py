"""Lesson 01 — how big is a KV cache?

Every generated token leaves behind, in every layer, one key and one value vector per KV head.
So the cache costs

    bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per number

and grows linearly with context length and batch size, while the weights stay fixed. This lesson
computes the formula for SmolLM2 and for 7B/70B-class configurations, shows what grouped-query
attention (GQA) saves, and checks the formula against tensors actually allocated in this process.
`--shape qwen3-0.6b` (or llama-3.2-1b, qwen2.5-1.5b) measures a 1B-class model's real config instead
of SmolLM2's, on random weights (a cache's size does not depend on the weights' values).

    python lessons/01_kv_cache_math.py [--quick] [--out DIR] [--shape NAME]
"""

import resource

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from _common import console, lesson_args, lesson_model, save_numbers, save_plot, shape_option, table  # noqa: E402

from minillm.config import ModelConfig  # noqa: E402
from minillm.decoding.cached import ContiguousKVCache  # noqa: E402
from minillm.weights import load_model  # noqa: E402

GiB = 2**30

# Architecture facts from each model's published config.json:
# (layers, query heads, kv heads, head_dim, params)
ARCHITECTURES = {
    "Llama-2-7B (MHA)": (32, 32, 32, 128, 6.7e9),
    "Llama-3-8B (GQA)": (32, 32, 8, 128, 8.0e9),
    "Llama-2-70B (GQA)": (80, 64, 8, 128, 69e9),
}


def kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_number):
    return 2 * layers * kv_heads * head_dim * bytes_per_number


def parameter_count(config: ModelConfig) -> int:
    """Weights of a Llama-shaped model: embeddings (twice when the head is not tied), then per
    layer the q, k, v, o projections and the three SwiGLU matrices (norms and biases are noise)."""
    attention = config.hidden_size * config.head_dim * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * config.hidden_size * config.intermediate_size
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * (attention + mlp)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def show_sizes(configs: dict) -> None:
    """Each architecture's KV bytes per token, at 4k tokens, at 4k x 32 sequences, and against its weights."""
    rows = []
    for name, (layers, heads, kv_heads, head_dim, params) in configs.items():
        per_token = kv_bytes_per_token(layers, kv_heads, head_dim, 2)
        rows.append(
            [
                name,
                layers,
                f"{heads}/{kv_heads}",
                head_dim,
                f"{per_token / 1024:.0f} KiB",
                f"{per_token * 4096 / GiB:.2f}",
                f"{per_token * 4096 * 32 / GiB:.1f}",
                f"{per_token * 4096 * 32 / (params * 2):.1f}x",
            ]
        )
    table(
        "KV cache size",
        [
            "model",
            "layers",
            "q/kv heads",
            "head_dim",
            "per token",
            "GiB @ 4k tokens",
            "GiB @ 4k x 32 seqs",
            "vs fp16 weights",
        ],
        rows,
    )


def measure_allocation(
    model_dir, ours: ModelConfig, name: str, quick: bool
) -> list[tuple[int, int, int, int]]:
    """(tokens, formula bytes, tensor bytes, bytes the process grew) of the model's fp32 caches
    allocated now."""
    model = load_model(model_dir)
    rows = []
    measured = []
    # large enough that the allocator asks the OS for fresh pages
    for tokens in (4096,) if quick else (4096, 16384):
        before = rss_bytes()
        cache = ContiguousKVCache(model, tokens)  # torch.zeros touches every page
        grown = rss_bytes() - before
        formula = ours.kv_bytes_per_token(torch.float32) * tokens
        rows.append([tokens, f"{formula:,}", f"{cache.nbytes:,}", f"{grown:,}", f"{grown / formula:.3f}"])
        measured.append((tokens, formula, cache.nbytes, grown))
        del cache
    table(
        f"{name} fp32 cache",
        ["tokens", "formula bytes", "tensor bytes", "process memory grew", "grew / formula"],
        rows,
    )
    return measured


def plot(configs: dict, mha: int, gqa: int, measured: list, name: str, out) -> None:
    """One panel per part: (1) growth with context, (2) what GQA saves, (3) formula against allocation."""
    fig, (growth, gqa_ax, check) = plt.subplots(
        1, 3, figsize=(15, 4.2), gridspec_kw={"width_ratios": [2, 1, 1.2]}
    )
    contexts = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    for name, (layers, _, kv_heads, head_dim, _) in configs.items():
        growth.plot(
            contexts,
            [kv_bytes_per_token(layers, kv_heads, head_dim, 2) * c / GiB for c in contexts],
            marker="o",
            label=name,
        )
    growth.set(
        xscale="log",
        yscale="log",
        xlabel="context length (tokens, log)",
        ylabel="KV cache of one sequence, fp16 (GiB, log)",
        title="1. The formula: one sequence's cache by context",
    )
    growth.legend(fontsize=8)
    bars = gqa_ax.bar(
        ["every query head\nits own K/V (MHA)", "shared KV heads\n(GQA)"], [mha / 1024, gqa / 1024]
    )
    gqa_ax.bar_label(bars, [f"{mha / 1024:.0f} KiB", f"{gqa / 1024:.0f} KiB"])
    gqa_ax.set(ylabel=f"{name} KV per token, fp32 (KiB)", title=f"2. GQA: {mha / gqa:.0f}x smaller")
    gqa_ax.margins(y=0.15)
    labels = [f"{tokens:,}" for tokens, *_ in measured]
    width = 0.27
    for i, (what, column) in enumerate((("formula", 1), ("tensor bytes", 2), ("process grew", 3))):
        check.bar(
            [x + (i - 1) * width for x in range(len(measured))],
            [row[column] / 2**20 for row in measured],
            width,
            label=what,
        )
    check.set_xticks(range(len(measured)), labels)
    exact = all(tensor == formula for _, formula, tensor, _ in measured)
    grew = sorted({f"{grown / formula:.3f}x" for _, formula, _, grown in measured})
    check.set(
        xlabel=f"tokens in an fp32 {name} cache",
        ylabel="MiB",
        title=f"3. Allocated now: tensors {'=' if exact else '!='} formula,\n"
        f"the process grew {' to '.join(grew)} the formula",
    )
    check.legend(fontsize=8)
    fig.tight_layout()
    save_plot(fig, out, "01_kv_cache_math.png")


def main():
    args = lesson_args(__doc__, shape_option)
    model_dir, name = lesson_model(args)
    ours = ModelConfig.from_dir(model_dir)
    our_shape = (ours.num_layers, ours.num_heads, ours.num_kv_heads, ours.head_dim, parameter_count(ours))
    configs = {f"{name} (GQA)": our_shape, **ARCHITECTURES}

    console.rule("1. The formula, in fp16 (2 bytes per number)")
    show_sizes(configs)

    console.rule("2. What grouped-query attention saves")
    mha = kv_bytes_per_token(ours.num_layers, ours.num_heads, ours.head_dim, 4)
    gqa = kv_bytes_per_token(ours.num_layers, ours.num_kv_heads, ours.head_dim, 4)
    console.print(
        f"{name} in fp32: {mha:,} B/token if every query head had its own K/V (MHA), "
        f"{gqa:,} B/token with {ours.num_kv_heads} shared KV heads: {mha / gqa:.0f}x smaller."
    )

    console.rule("3. The formula against tensors allocated now")
    measured = measure_allocation(model_dir, ours, name, args.quick)
    plot(configs, mha, gqa, measured, name, args.out)

    tokens, formula, tensor_bytes, grown = measured[-1]
    layers, _, kv_heads, head_dim, params = ARCHITECTURES["Llama-2-7B (MHA)"]
    over_weights = kv_bytes_per_token(layers, kv_heads, head_dim, 2) * 4096 * 32 / (params * 2)
    save_numbers(
        args.out,
        "01_kv_cache_math.json",
        {
            "llama2_7b_cache_4k_x_32_over_weights": over_weights,
            "smol_gqa_saving": mha / gqa,
            "smol_query_heads_per_kv_head": ours.num_heads / ours.num_kv_heads,
            "tokens": tokens,
            "formula_bytes": formula,
            "tensor_bytes": tensor_bytes,
            "process_grew_bytes": grown,
        },
    )
    console.print(
        f"\n[bold]What it means:[/bold] the cache is a per-token tax that, at long contexts and "
        f"large batches, outgrows the weights themselves (Llama-2-7B, 4k tokens x 32 sequences: "
        f"{over_weights:.1f}x its weights); GQA cuts it by the ratio of query to KV heads "
        f"({mha / gqa:.0f}x for {name}), and the tensors we allocate cost exactly what the "
        f"formula says ({tensor_bytes:,} bytes for {tokens:,} tokens; the process grew by "
        f"{grown / formula:.3f}x that)."
    )


if __name__ == "__main__":
    main()
