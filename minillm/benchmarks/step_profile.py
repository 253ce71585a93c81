"""`minillm bench decode --profile` and `--contexts`: where each millisecond of a decode step goes.

The serving engine with one request (its products read the checkpoint's GGUF blocks where
weights="auto" finds them, each layer fused into two C++ calls: what `minillm serve` runs for one
conversation) decodes a prompt's continuation, and every decode step is cut into its parts:

    attention_in, layer_out  the fused layer's two C++ calls (`Block.forward_fused`), once a layer
                             each: norm, QKV product and RoPE; output product, norm and MLP
    attention                `PagedAttention.attend`: write this token's K and V, read the context's
    logits                   `Transformer.logits`: the product with the vocabulary
    model other              the rest of `Transformer.forward`: embedding, the RoPE rows, the final
                             norm, the Python between the calls
    engine other             the step's wall time less the forward and the logits: scheduling, the
                             attention's tables, sampling, the outputs

Each part is its median over every decode step of every repeat, so the parts add up to about the
step's median, not exactly (a sum of medians is not the median of the sums). Beside the time,
the bytes a part reads each step and the rate that is, against the read roof `bench decode`
measures: a C++ call reads the tensors handed to it (the weights' blocks, the norms, one token's
activations), the attention the KV cache at the mean context in the pool's format (scales
included), the logits the head's matrix or blocks.

How: four places are wrapped, for the run only, in timers (`time.perf_counter` before and after):
`minillm.model.dense_kernel` hands out the C++ kernels through a proxy that times each call and
counts its tensors' bytes, and `PagedAttention.attend`, `Transformer.logits` and
`Transformer.forward` are swapped for timed versions of themselves, then put back. The model does
not know it is profiled. A wrapped call costs a microsecond or so of its own, and a step makes
3 x layers + 2 of them: the profile times the same decode without the wrappers, interleaved with
it, and prints the difference. The engine caches full prompt blocks (prefix caching), so a repeat
does not prefill its prompt again.

`--contexts` profiles the step at growing context lengths, with the KV in the model's dtype and
in int8: the weights a step reads stay the same, the KV it reads grows with the context, and the
attention's share of the step says from where on the cache, not the weights, sets the pace.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

import minillm.model as model_module
from minillm.attention.paged import PagedAttention
from minillm.benchmarks import machine, read_bandwidth
from minillm.benchmarks.decode import bench_prompt, product_bytes, weights_read
from minillm.config import ConfigError
from minillm.engine import LLM
from minillm.model import Transformer
from minillm.progress import progress_bar
from minillm.report import print_table
from minillm.sampling import SamplingParams

KV_DTYPES = ("auto", "int8")  # --contexts: the KV in the model's dtype, then int8 with its scales
NOT_KERNEL_CALLS = ("attention", "logits", "model other", "engine other")  # the parts besides them
CONTEXT_TOKENS = 2**17  # --contexts decodes at most this many (context x new tokens) a row and repeat


class _StepClock:
    """Seconds, calls and bytes handed in, by part, since the last `take()`."""

    def __init__(self):
        self.seconds, self.calls, self.bytes = defaultdict(float), defaultdict(int), defaultdict(int)

    def timed(self, part: str, call, count_bytes: bool = False):
        """`call`, each call's wall time added to `part` (and its tensor arguments' bytes)."""

        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            result = call(*args, **kwargs)
            self.seconds[part] += time.perf_counter() - start
            self.calls[part] += 1
            if count_bytes:
                self.bytes[part] += sum(a.nbytes for a in args if isinstance(a, torch.Tensor))
            return result

        return timed_call

    def take(self) -> dict:
        """What was recorded since the last take, and a clean slate."""
        taken = {"seconds": dict(self.seconds), "calls": dict(self.calls), "bytes": dict(self.bytes)}
        self.seconds.clear(), self.calls.clear(), self.bytes.clear()
        return taken


class _TimedKernel:
    """The C++ kernels `dense_kernel()` returns, each call timed by `clock` under its own name."""

    def __init__(self, kernel, clock: _StepClock):
        self._kernel, self._clock = kernel, clock

    def __getattr__(self, name: str):
        timed = self._clock.timed(name, getattr(self._kernel, name), count_bytes=True)
        setattr(self, name, timed)  # wrapped once: found without __getattr__ from then on
        return timed


@contextmanager
def _profiled(clock: _StepClock):
    """The four places a step spends its time wrapped in `clock`'s timers, put back however the
    run ends."""
    kernel = model_module.dense_kernel()
    timed_kernel = None if kernel is None else _TimedKernel(kernel, clock)
    swaps = [
        (model_module, "dense_kernel", lambda: timed_kernel),
        (PagedAttention, "attend", clock.timed("attention", PagedAttention.attend)),
        (Transformer, "logits", clock.timed("logits", Transformer.logits)),
        (Transformer, "forward", clock.timed("forward", Transformer.forward)),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, timed in swaps:
        setattr(owner, name, timed)
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


def _decode(engine, prompt_ids: list[int], new_tokens: int, clock: _StepClock) -> list[dict]:
    """One request, prefilled untimed, then its `new_tokens` decode steps: each step's wall time
    ("step" in its seconds) beside what `clock` recorded in it (nothing where it is not wired in)."""
    engine.add_request(prompt_ids, SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True))
    first_token = False
    while not first_token:  # the prompt, in as many chunks as it takes, to its first token
        for out in engine.step():
            if out.error:
                raise ConfigError(f"bench decode: the engine refused the prompt: {out.error}")
            first_token = bool(out.token_ids)
    steps = []
    while engine.has_unfinished_requests():
        clock.take()
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        step = clock.take()
        step["seconds"]["step"] = seconds
        steps.append(step)
    return steps


def _decode_runs(llm, prompt_ids, new_tokens: int, repeats: int, advance, plain_too: bool):
    """(profiled steps, plain steps) over `repeats` runs, a plain run (no wrappers) before each
    profiled one where `plain_too`, after a short warm-up (first calls allocate and pack)."""
    clock, profiled, plain = _StepClock(), [], []
    _decode(llm.engine, prompt_ids, 2, clock)
    for _ in range(repeats):
        if plain_too:
            plain += _decode(llm.engine, prompt_ids, new_tokens, clock)
        with _profiled(clock):
            profiled += _decode(llm.engine, prompt_ids, new_tokens, clock)
        advance()
    return profiled, plain


def _part_seconds(step: dict) -> dict[str, float]:
    """One profiled step's seconds by part, the two "other" parts derived from what contains them."""
    seconds = step["seconds"]
    timed = {name: s for name, s in seconds.items() if name not in ("step", "forward")}
    inside_forward = sum(s for name, s in timed.items() if name != "logits")
    return {
        **timed,
        "model other": seconds["forward"] - inside_forward,
        "engine other": seconds["step"] - seconds["forward"] - seconds["logits"],
    }


def _median(steps: list[dict], key: str, part: str) -> float:
    return statistics.median(step[key].get(part, 0) for step in steps)


def _parts(steps: list[dict], read_roof: float | None, kv_bytes: float, head_bytes: int) -> dict:
    """Each part's median ms a step, share of the step, calls and bytes a step, and the rate read."""
    by_part = [_part_seconds(step) for step in steps]
    step_s = statistics.median(step["seconds"]["step"] for step in steps)
    parts = {}
    for part in by_part[0]:
        seconds = statistics.median(p.get(part, 0) for p in by_part)
        read = {"attention": kv_bytes, "logits": head_bytes}.get(part, _median(steps, "bytes", part))
        rate = read / seconds if read and seconds else None
        parts[part] = {
            "ms": seconds * 1e3,
            "share": seconds / step_s,
            "calls_per_step": _median(steps, "calls", part),
            "bytes_per_step": read,
            "GBs": rate / 1e9 if rate else None,
            "read_roof_fraction": rate / read_roof if rate and read_roof else None,
        }
    return parts


def _head_bytes(model) -> int:
    """The bytes the vocabulary product reads: the lm_head's, or the tied embedding's."""
    name = "embed.weight" if model.lm_head is None else "lm_head.weight"
    return product_bytes(model.products()[name], model.state_dict()[name])


def _profile(llm, prompt_ids, new_tokens: int, repeats: int, read_roof, advance, plain_too: bool) -> dict:
    """One engine's decode steps after `prompt_ids`, profiled: the step's ms and its parts."""
    profiled, plain = _decode_runs(llm, prompt_ids, new_tokens, repeats, advance, plain_too)
    model, kv_per_token = llm.engine.model, llm.engine.snapshot().bytes_per_token
    kv_bytes = kv_per_token * (len(prompt_ids) + new_tokens / 2)  # at the steps' mean context
    parts = _parts(profiled, read_roof, kv_bytes, _head_bytes(model))
    kernel_calls = [name for name in parts if name not in NOT_KERNEL_CALLS]
    profile = {
        "weights": weights_read(model),
        "kv": _kv_name(llm.engine.config.kv_dtype, model.dtype),
        "prompt_len": len(prompt_ids),
        "new_tokens": new_tokens,
        "kv_bytes_per_token": kv_per_token,
        "step_ms": statistics.median(step["seconds"]["step"] for step in profiled) * 1e3,
        "cpp_calls_per_step": sum(parts[name]["calls_per_step"] for name in kernel_calls),
        "wrapped_calls_per_step": sum(part["calls_per_step"] for part in parts.values()) + 1,
        "parts": parts,
    }
    if plain_too:
        profile["unwrapped_step_ms"] = statistics.median(step["seconds"]["step"] for step in plain) * 1e3
    return profile


def _kv_name(kv_dtype: str, dtype: torch.dtype) -> str:
    """The KV format's name: "auto" is the model's dtype."""
    return str(dtype).removeprefix("torch.") if kv_dtype == "auto" else kv_dtype


def _engine(model_dir: Path, dtype: str, kv_dtype: str, model=None) -> LLM:
    """The engine `minillm serve` builds for one conversation (weights="auto", fused decode) in
    `dtype`, its KV in `kv_dtype`; prefix caching on so that a repeat skips its prefill."""
    return LLM(
        model_dir,
        model=model,
        dtype=dtype,
        weights="auto",
        kv_dtype=kv_dtype,
        prefix_caching=True,
        max_num_seqs=1,
    )


def _context_rows(llm, model_dir: Path, contexts, new_tokens, repeats, read_roof, progress) -> list[dict]:
    """A profile at each context (a prompt that long, then new tokens: fewer the longer the
    context), for each of KV_DTYPES; a prompt is cut where it and its new tokens would not fit."""
    model = llm.engine.model
    engines = [llm] + [_engine(model_dir, llm.engine.config.dtype, kv, model) for kv in KV_DTYPES[1:]]
    text = bench_prompt(model_dir, max(contexts))
    rows = []
    with progress_bar("contexts", len(engines) * len(contexts) * repeats, enabled=progress) as advance:
        for engine in engines:
            for context in contexts:
                tokens = min(new_tokens, max(16, CONTEXT_TOKENS // context))
                prompt = text[: min(context, engine.engine.context_len - tokens - 1)]
                profile = _profile(engine, prompt, tokens, repeats, read_roof, advance, plain_too=False)
                attention = profile["parts"]["attention"]
                rows.append(
                    {
                        "context": context,
                        "capped": len(prompt) < context,
                        "kv_bytes_per_step": attention["bytes_per_step"],
                        "attention_share": attention["share"],
                        "ms_per_token": profile["step_ms"],
                        "tok_s": 1e3 / profile["step_ms"],
                        **profile,
                    }
                )
    return rows


def bench_step_profile(
    model_dir: Path,
    dtype: str,
    prompt_len: int,
    new_tokens: int,
    repeats: int,
    profile: bool,
    contexts: list[int] | None,
    progress: bool = True,
) -> dict:
    """`bench decode --profile` (one step's parts after a `prompt_len` prompt) and `--contexts`
    (the step at each context length, per KV format), whichever are asked, in one report."""
    read_roof = read_bandwidth()
    llm = _engine(model_dir, dtype, KV_DTYPES[0])
    report = {
        "machine": machine(),
        "model_dir": str(model_dir),
        "dtype": llm.engine.config.dtype,
        "repeats": repeats,
        "read_bandwidth_GBs": read_roof / 1e9 if read_roof else None,
    }
    with torch.inference_mode():
        if profile:
            prompt = bench_prompt(model_dir, prompt_len)
            with progress_bar("profile", repeats, enabled=progress) as advance:
                report["profile"] = _profile(
                    llm, prompt, new_tokens, repeats, read_roof, advance, plain_too=True
                )
        if contexts:
            report["contexts"] = _context_rows(
                llm, model_dir, contexts, new_tokens, repeats, read_roof, progress
            )
    return report


def _cells(values: dict, keys: list[str]) -> list[str]:
    """A part's ms, share, calls, MB and GB/s as printed; "-" where a part reads no bytes of its own."""
    ms, share, calls, read, rate, roof = (values.get(key) for key in keys)
    return [
        f"{ms:.2f}",
        f"{share:.0%}",
        f"{calls:g}" if calls else "-",
        f"{read / 1e6:.1f}" if read else "-",
        f"{rate:.1f}" if rate else "-",
        f"{roof:.0%}" if roof else "-",
    ]


PART_KEYS = ["ms", "share", "calls_per_step", "bytes_per_step", "GBs", "read_roof_fraction"]


def print_profile(report: dict, console) -> None:
    """The profile's table: each part of a step, then the step; the C++ calls and the wrappers' cost."""
    p = report["profile"]
    rows = [[name, *_cells(part, PART_KEYS)] for name, part in p["parts"].items()]
    rows.append(["step", *_cells({"ms": p["step_ms"], "share": 1.0}, PART_KEYS)])
    print_table(
        console,
        f"one decode step, {report['dtype']}, weights {p['weights']}, KV {p['kv']}: prompt "
        f"{p['prompt_len']} tokens, {p['new_tokens']} new, median of every step of {report['repeats']} runs",
        ["part", "ms/step", "of step", "calls/step", "MB read/step", "GB/s", "of read roof"],
        rows,
    )
    overhead_ms = p["step_ms"] - p["unwrapped_step_ms"]
    console.print(
        f"C++ calls a step: {p['cpp_calls_per_step']:g}; the step without the timers: "
        f"{p['unwrapped_step_ms']:.2f} ms, with them {p['step_ms']:.2f} ms: "
        f"{1e3 * overhead_ms / p['wrapped_calls_per_step']:.1f} µs for each of the "
        f"{p['wrapped_calls_per_step']:g} timed calls (noise moves it either way)"
    )


def print_contexts(report: dict, console) -> None:
    """The --contexts table: one row per KV format and context."""
    rows = [
        [
            r["kv"],
            r["context"],
            f"{r['prompt_len']}{'*' if r['capped'] else ''}",
            r["new_tokens"],
            f"{r['kv_bytes_per_token']:,}",
            f"{r['kv_bytes_per_step'] / 1e6:.1f}",
            f"{r['attention_share']:.0%}",
            f"{r['ms_per_token']:.2f}",
            f"{r['tok_s']:.1f}",
        ]
        for r in report["contexts"]
    ]
    print_table(
        console,
        f"one-stream decode by context, {report['dtype']}, weights {report['contexts'][0]['weights']}, "
        f"median of every step of {report['repeats']} runs",
        ["KV", "context", "prompt", "new", "KV B/token", "KV MB read/step", "attention", "ms/token", "tok/s"],
        rows,
    )
    if any(r["capped"] for r in report["contexts"]):
        console.print("* the prompt cut so that it and its new tokens fit the model's context")


def print_step_report(report: dict, console) -> None:
    if "profile" in report:
        print_profile(report, console)
    if "contexts" in report:
        print_contexts(report, console)
    read = report["read_bandwidth_GBs"]
    if read:
        console.print(f"read roof measured now: {read:.1f} GB/s (every thread summing a buffer)")
