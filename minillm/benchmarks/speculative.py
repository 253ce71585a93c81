"""`minillm bench speculative`: decode with and without n-gram speculation, side by side.

Two kinds of prompts:
  - input-grounded: go on quoting a passage (plain text), and in the chat template quote from a
    passage, summarize one, edit a function's source: the answer copies its prompt, and guesses
    from the prompt are often right;
  - open-ended chat questions, where they are rarely right and guessing must cost next to nothing.
Each kind comes in two sets: "tune" (Alice, `statistics.median`, four questions) is what the
speculation's constants (`engine/speculative.py`) were chosen on; "report" (lcet10,
`textwrap.dedent`, four other questions) is what they are reported on.

At batch 1 every prompt runs greedy without and with speculation, interleaved, `repeats` times:
decode tok/s from the first token to the last, the ratio per run, and whether the tokens are the
very same. Batched, `batch` of the set's prompts run at once (each generates until EOS or
max_tokens): the wall time of the whole batch, prefill included (the same work in both), and the
ratio. Acceptance (guessed tokens kept / guessed) and tokens per checking pass come from the
engine's counters.
"""

from __future__ import annotations

import inspect
import statistics
import textwrap
import time
from pathlib import Path

from minillm.benchmarks import cpu_model
from minillm.config import DTYPES, EngineConfig
from minillm.engine import LLM, RequestOutput
from minillm.evaluation import DEFAULT_TEXT, TECHNICAL_TEXT, read_text
from minillm.report import print_table
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

PASSAGE_CHARS = 1200  # about 300 tokens of passage in each grounded prompt
OPEN_ENDED = {
    "tune": [
        "Write a short poem about autumn.",
        "What are three tips for staying healthy?",
        "Explain photosynthesis to a child.",
        "Tell me a story about a dragon.",
    ],
    "report": [
        "Write a haiku about the sea.",
        "Why do cats purr?",
        "Give me three ideas for a rainy weekend.",
        "Describe your favourite city.",
    ],
}


def _passage(text: str, start: int) -> str:
    """About PASSAGE_CHARS of `text` from `start`, cut at whole lines, its runs of spaces made one
    (the typewritten texts' double spaces are what this model does not copy)."""
    lines, passage = text[start:].splitlines()[1:], ""
    for line in lines:
        line = " ".join(line.split())
        if len(passage) + len(line) > PASSAGE_CHARS:
            break
        passage += line + "\n"
    return passage.strip()


def grounded_prompts(tokenizer: Tokenizer, which: str) -> list[list[int]]:
    """Four prompts answered from themselves: a passage to go on quoting (plain text: the passage,
    then its first line again), and in the chat template, sentences to quote from a passage, a
    passage to summarize, a function's source to edit."""
    if which == "tune":
        text, code, old, new = read_text(DEFAULT_TEXT), inspect.getsource(statistics.median), "data", "values"
    else:
        text, code, old, new = read_text(TECHNICAL_TEXT), inspect.getsource(textwrap.dedent), "text", "source"
    first, second = _passage(text, len(text) // 3), _passage(text, len(text) // 2)
    again = f"Here is a passage.\n\n{first}\n\nThe same passage again, word for word:\n\n"
    asked = [
        f"Quote the first four sentences of this passage.\n\n{second}",
        f"Summarize this passage in a few sentences.\n\n{first}",
        f"Rename the variable `{old}` to `{new}` in this Python function and show the whole "
        f"function.\n\n```python\n{code}```",
    ]
    return [
        tokenizer.encode(again + first.splitlines()[0] + "\n"),
        *(tokenizer.encode_chat([{"role": "user", "content": question}]) for question in asked),
    ]


def prompt_sets(tokenizer: Tokenizer, which: str) -> dict[str, list[list[int]]]:
    """kind -> its prompts as token ids."""
    open_ended = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in OPEN_ENDED[which]]
    return {"input-grounded": grounded_prompts(tokenizer, which), "open-ended": open_ended}


def decode_rate(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, RequestOutput]:
    """One request alone: decode tok/s from its first token to its last, and what it got."""
    first = out = None
    for out in llm.stream(prompt, params):
        first = first or time.perf_counter()
    elapsed = time.perf_counter() - first
    return (len(out.token_ids) - 1) / elapsed if elapsed > 0 else 0.0, out


def batch_time(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [out.token_ids for out in outputs]


def _spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def _batch_one(plain: LLM, guessing: LLM, prompts, params, repeats: int) -> dict:
    """Every prompt alone, without and with speculation, interleaved."""
    rows, identical, ratios = [], True, []
    for prompt in prompts:
        rates = {"plain": [], "ngram": []}
        for _ in range(repeats):
            plain_rate, plain_out = decode_rate(plain, prompt, params)
            guess_rate, guess_out = decode_rate(guessing, prompt, params)
            rates["plain"].append(plain_rate)
            rates["ngram"].append(guess_rate)
            identical &= plain_out.token_ids == guess_out.token_ids
        ratio = [g / p for p, g in zip(rates["plain"], rates["ngram"])]
        ratios += ratio
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "output_tokens": len(plain_out.token_ids),
                "plain_tok_s": statistics.median(rates["plain"]),
                "ngram_tok_s": statistics.median(rates["ngram"]),
                "speedup": statistics.median(ratio),
                "speedup_range": _spread(ratio),
            }
        )
    plain_total = statistics.median([row["plain_tok_s"] for row in rows])
    return {
        "prompts": rows,
        "speedup": statistics.median(ratios),
        "speedup_range": _spread(ratios),
        "plain_tok_s": plain_total,
        "ngram_tok_s": statistics.median([row["ngram_tok_s"] for row in rows]),
        "identical": identical,
    }


def batched(plain: LLM, guessing: LLM, prompts, params, batch: int, repeats: int) -> dict:
    """`batch` of the prompts at once (the set repeated to fill it), without and with speculation."""
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    times, identical = {"plain": [], "ngram": []}, True
    for _ in range(repeats):
        plain_s, plain_tokens = batch_time(plain, batch_prompts, params)
        guess_s, guess_tokens = batch_time(guessing, batch_prompts, params)
        times["plain"].append(plain_s)
        times["ngram"].append(guess_s)
        identical &= plain_tokens == guess_tokens
    ratios = [p / g for p, g in zip(times["plain"], times["ngram"])]
    tokens = sum(len(t) for t in plain_tokens)
    return {
        "sequences": batch,
        "output_tokens": tokens,
        "plain_s": statistics.median(times["plain"]),
        "ngram_s": statistics.median(times["ngram"]),
        "speedup": statistics.median(ratios),
        "speedup_range": _spread(ratios),
        "identical": identical,
    }


def counted(llm: LLM, run) -> tuple[dict, dict]:
    """What `run()` returns, and the speculation counters it moved."""
    stats = llm.engine.stats
    before = (stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens)
    result = run()
    drafts, guessed, kept = (
        now - then
        for now, then in zip((stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens), before)
    )
    return result, {
        "drafts": drafts,
        "draft_tokens": guessed,
        "accepted_tokens": kept,
        "acceptance_rate": kept / guessed if guessed else 0.0,
        "tokens_per_pass": 1 + kept / drafts if drafts else 1.0,
    }


def bench_speculative(
    model_dir: Path,
    dtype: str = "float32",
    weights: str = "model",
    fused_decode: bool = True,
    prompts: str = "report",
    max_tokens: int = 128,
    repeats: int = 3,
    batch: int = 16,
    num_speculative_tokens: int = EngineConfig.num_speculative_tokens,
    prompt_lookup_min: int = EngineConfig.prompt_lookup_min,
    prompt_lookup_max: int = EngineConfig.prompt_lookup_max,
) -> dict:
    model = load_model(model_dir, DTYPES[dtype], weights=weights, fused=fused_decode)
    tokenizer = Tokenizer(model_dir)
    speculation = {
        "num_speculative_tokens": num_speculative_tokens,
        "prompt_lookup_min": prompt_lookup_min,
        "prompt_lookup_max": prompt_lookup_max,
    }
    plain, guessing = (
        LLM(model_dir, model=model, tokenizer=tokenizer, dtype=dtype, **switches)
        for switches in ({}, {"speculative": "ngram", **speculation})
    )
    params = SamplingParams(max_tokens=max_tokens)
    sets = prompt_sets(tokenizer, prompts)
    for llm in (plain, guessing):  # warm up both engines
        llm.generate(sets["open-ended"][:1], SamplingParams(max_tokens=4))
    results = {}
    for kind, asked in sets.items():
        one, one_counts = counted(guessing, lambda: _batch_one(plain, guessing, asked, params, repeats))
        many, many_counts = counted(guessing, lambda: batched(plain, guessing, asked, params, batch, repeats))
        results[kind] = {"batch_1": {**one, **one_counts}, "batched": {**many, **many_counts}}
    return {
        "cpu": cpu_model(),
        "dtype": dtype,
        "weights": weights,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "speculation": speculation,
        "sets": results,
    }


def _report_row(kind: str, run: str, plain: str, guessing: str, numbers: dict) -> list[str]:
    """One run's row of the report: the two sides as given, then the ratio and the counters."""
    low, high = numbers["speedup_range"]
    return [
        kind,
        run,
        plain,
        guessing,
        f"{numbers['speedup']:.2f}x ({low:.2f}-{high:.2f})",
        f"{numbers['acceptance_rate']:.2f}",
        f"{numbers['tokens_per_pass']:.2f}",
        "yes" if numbers["identical"] else "NO",
    ]


def print_speculative_report(result: dict, console) -> None:
    spec = result["speculation"]
    console.print(
        f"[bold]speculative decoding (n-gram, k={spec['num_speculative_tokens']}, "
        f"n={spec['prompt_lookup_min']}..{spec['prompt_lookup_max']})[/bold] — {result['cpu']}, "
        f"{result['dtype']}, weights {result['weights']}, '{result['prompts']}' prompts, greedy, "
        f"up to {result['max_tokens']} tokens, {result['repeats']} interleaved repeats"
    )
    rows = []
    for kind, runs in result["sets"].items():
        one, many = runs["batch_1"], runs["batched"]
        rows.append(
            _report_row(
                kind, "batch 1 (decode tok/s)", f"{one['plain_tok_s']:.1f}", f"{one['ngram_tok_s']:.1f}", one
            )
        )
        batch = f"batch {many['sequences']} (wall s)"
        rows.append(_report_row(kind, batch, f"{many['plain_s']:.2f}", f"{many['ngram_s']:.2f}", many))
    print_table(
        console,
        "without and with speculation (speedup: median ratio over runs, min-max)",
        ["prompts", "run", "plain", "ngram", "speedup", "acceptance", "tokens/pass", "same tokens"],
        rows,
    )
    for kind, runs in result["sets"].items():
        per_prompt = ", ".join(
            f"{row['speedup']:.2f}x ({row['output_tokens']} tok)" for row in runs["batch_1"]["prompts"]
        )
        console.print(f"  {kind}, batch 1, per prompt: {per_prompt}")
    if not all(run["identical"] for runs in result["sets"].values() for run in runs.values()):
        console.print(
            "  [yellow]tokens differ[/yellow]: in bfloat16 a checking pass rounds differently from "
            "one-token steps (other kernels, other row counts), and a near tie can flip; in "
            "float32 they must be the same"
        )
