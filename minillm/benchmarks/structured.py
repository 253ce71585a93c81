"""`minillm bench structured`: what constraining the output to a grammar costs a decode step.

A batch of chat prompts decodes greedily three ways, interleaved `repeats` times:
  - free: no constraint (ignore_eos, so every sequence decodes max_tokens);
  - regex: lowercase letters and spaces, more of them than max_tokens can hold, so the grammar
    never lets a sequence end and every sequence decodes as many tokens as free does: the same
    work plus the mask, so its ratio to free is the grammar's whole cost;
  - json: a small JSON schema, what a client asks for. Its answers end when the object closes,
    so the batch empties before max_tokens and its rate falls for that too: compare its mask.
Decode tok/s counts from the moment every sequence has its first token to the last token (the
prefill is the same work on every side and is left out). The mask alone is then timed on each
constrained side's own tokens: the batch's grammar states walked along them, `Grammars.mask_logits`
timed at every step on logits of the step's rows.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from minillm.benchmarks import cpu_model
from minillm.config import DTYPES
from minillm.engine import LLM
from minillm.sampling import SamplingParams
from minillm.structured import StructuredOutput
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

QUESTIONS = [
    "Describe a person you admire.",
    "Tell me about a city you would like to visit.",
    "What makes a good breakfast?",
    "Describe a pet you would like to have.",
    "What is your favourite season, and why?",
    "Tell me about a book you enjoyed.",
    "How would you plan a picnic?",
    "Describe the view from a mountain top.",
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "likes": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "likes"],
    "additionalProperties": False,
}


def sides(max_tokens: int) -> dict[str, SamplingParams]:
    """side -> its greedy SamplingParams."""
    endless = StructuredOutput(regex=f"[a-z ]{{{64 * max_tokens}}}")  # no token is longer than 64
    return {
        "free": SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        "regex": SamplingParams(max_tokens=max_tokens, temperature=0, structured=endless),
        "json": SamplingParams(
            max_tokens=max_tokens, temperature=0, structured=StructuredOutput.of_schema(PERSON)
        ),
    }


def decode_rate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """The batch at once: decode tok/s once every sequence has its first token, and its tokens."""
    engine = llm.engine
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    tokens: dict[str, list[int]] = {}
    started = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
        if started is None and len(tokens) == len(ids):
            started, first_tokens = time.perf_counter(), sum(map(len, tokens.values()))
    elapsed = time.perf_counter() - started
    decoded = sum(map(len, tokens.values())) - first_tokens
    return decoded / elapsed if elapsed > 0 else 0.0, [tokens[i] for i in ids]


def mask_times(llm: LLM, prompts: list[list[int]], outputs: list[list[int]], spec: StructuredOutput):
    """Seconds `mask_logits` takes at each step of the batch, walking its grammars along `outputs`
    (each step masks the rows still decoding; the logits are random, the states are real)."""
    grammars = llm.engine.grammars()
    states = [grammars.start(spec) for _ in prompts]
    vocab = llm.engine.model.config.vocab_size
    times = []
    for step in range(max(map(len, outputs))):
        live = [i for i, out in enumerate(outputs) if step < len(out)]
        logits = torch.randn(len(live), vocab)  # (rows, vocab)
        start = time.perf_counter()
        grammars.mask_logits(logits, [states[i] for i in live])
        times.append(time.perf_counter() - start)
        for i in live:
            states[i].advance(outputs[i][step])
    return times


def bench_structured(
    model_dir: Path, dtype: str = "float32", batch: int = 16, max_tokens: int = 64, repeats: int = 3
) -> dict:
    model, tokenizer = load_model(model_dir, DTYPES[dtype]), Tokenizer(model_dir)
    llm = LLM(model_dir, model=model, tokenizer=tokenizer, dtype=dtype, max_num_seqs=max(batch, 64))
    prompts = [
        tokenizer.encode_chat([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(batch)
    ]
    asked = sides(max_tokens)
    for params in asked.values():  # warm up: the kernels, and each grammar's first compile
        llm.generate(prompts[:2], dataclasses.replace(params, max_tokens=4))
    rates = {name: [] for name in asked}
    outputs = {}
    for _ in range(repeats):
        for name, params in asked.items():
            rate, outputs[name] = decode_rate(llm, prompts, params)
            rates[name].append(rate)
    masks = {
        name: mask_times(llm, prompts, outputs[name], asked[name].structured) for name in ("regex", "json")
    }
    free_step_s = batch / statistics.median(rates["free"])
    result = {
        "cpu": cpu_model(),
        "dtype": dtype,
        "batch": batch,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "free_step_ms": 1e3 * free_step_s,
    }
    result["sides"] = {
        name: {
            "tokens_per_sequence": statistics.mean(map(len, outputs[name])),
            "decode_tok_s": statistics.median(rates[name]),
            "decode_tok_s_range": [min(rates[name]), max(rates[name])],
            "ratio": statistics.median([r / f for r, f in zip(rates[name], rates["free"])]),
            "mask_ms": 1e3 * statistics.median(masks[name]) if name in masks else None,
            "mask_max_ms": 1e3 * max(masks[name]) if name in masks else None,
        }
        for name in asked
    }
    return result


def print_structured_report(result: dict, console) -> None:
    from minillm.report import print_table

    console.print(
        f"[bold]structured output[/bold] — {result['cpu']}, {result['dtype']}, batch {result['batch']}, "
        f"greedy, up to {result['max_tokens']} tokens, {result['repeats']} interleaved repeats"
    )
    rows = [
        [
            name,
            f"{side['tokens_per_sequence']:.1f}",
            "{:.1f} ({:.1f}-{:.1f})".format(side["decode_tok_s"], *side["decode_tok_s_range"]),
            f"{side['ratio']:.2f}x",
            "-" if side["mask_ms"] is None else f"{side['mask_ms']:.2f} (max {side['mask_max_ms']:.2f})",
        ]
        for name, side in result["sides"].items()
    ]
    print_table(
        console,
        "decode with and without a grammar (vs free: median over runs of side / free)",
        ["side", "tokens/seq", "decode tok/s (min-max)", "vs free", "mask ms a step"],
        rows,
    )
    console.print(
        f"  a free decode step of the batch takes {result['free_step_ms']:.1f} ms. regex decodes "
        "free's tokens under a grammar: its ratio is the whole cost. json's answers close early and "
        "its batch empties, which lowers its rate too: its mask is what compares."
    )
