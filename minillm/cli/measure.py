"""The commands that measure: `minillm bench decode|speculative|structured|attention|chat-view|open`
(speed), and
`minillm bench all` (every benchmark, written to files); the engine serving many requests, `bench
serve|serve-http|prefix`, is `measure_serving.py`; what the memory system's choices cost, `bench
memory` and `eval ppl`, is `measure_memory.py`, and `bench tiers` `measure_tiers.py`; the serving
staircase, `bench staircase`, is `measure_staircase.py`.

Each benchmark lives in `minillm.benchmarks` and returns one dict: with --json it is printed as one
JSON object, to compare across commits; without, its module's `print_*_report` prints the tables.
Each `add_X` here declares a command's flags beside the `cmd_X` that runs it.
"""

from __future__ import annotations

from pathlib import Path

from minillm.cli.flags import add_model_args, add_shape_arg, add_switch, add_trace_arg, positive_int
from minillm.cli.measure_fleet import add_bench_fleet
from minillm.cli.measure_memory import add_bench_memory
from minillm.cli.measure_scheduling import add_bench_scheduling
from minillm.cli.measure_serving import add_bench_prefix, add_bench_serve, add_bench_serve_http
from minillm.cli.measure_staircase import add_bench_staircase
from minillm.cli.measure_tiers import add_bench_tiers
from minillm.config import DEFAULT_MODEL_DIR, DTYPES, SWITCHES
from minillm.report import console, print_json, show


def add_bench(subparsers) -> None:
    bench = subparsers.add_parser(
        "bench", help="measure speed", description="Benchmarks that print numbers measured now."
    )
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for add_command in (
        add_bench_decode,
        add_bench_speculative,
        add_bench_structured,
        add_bench_serve,
        add_bench_serve_http,
        add_bench_prefix,
        add_bench_tiers,
        add_bench_memory,
        add_bench_scheduling,
        add_bench_staircase,
        add_bench_fleet,
        add_bench_attention,
        add_bench_chat_view,
        add_bench_open,
        add_bench_all,
    ):
        add_command(benches)
    for name, command in benches.choices.items():
        if name not in ("serve-http", "open", "fleet"):  # their engines run in child processes
            add_trace_arg(command)


# ----------------------------------------------------------------------------- bench decode


def add_bench_decode(benches) -> None:
    decode = benches.add_parser(
        "decode",
        help="batch-1 decode tok/s: naive vs cached vs HF transformers",
        description="Batch-1 decode speed of the naive and cached decoders, of the serving "
        "engine with one request (what minillm serve runs per token) and of HF "
        "transformers' generate on the same weights, and of the cached decoder "
        "in the other precision (float32 beside bfloat16), with bandwidth "
        "achieved against this machine's read roof (every thread reading a large "
        "buffer: all a batch-1 step does with its weights) and copy roof, both "
        "measured now: the median of interleaved runs, the best and the spread.",
    )
    decode.add_argument(
        "--tokens", type=positive_int, default=128, help="new tokens per run for cached and HF (default: 128)"
    )
    decode.add_argument(
        "--repeats", type=positive_int, default=5, help="interleaved runs of every decoder (default: 5)"
    )
    decode.add_argument(
        "--naive-tokens",
        type=positive_int,
        default=16,
        help="new tokens for the slow naive decoder (default: 16)",
    )
    decode.add_argument(
        "--prompt-len", type=positive_int, default=64, help="prompt length in tokens (default: 64)"
    )
    decode.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    decode.add_argument(
        "--profile",
        action="store_true",
        help="instead of the decoders: where each ms of the engine's decode step goes (C++ calls, "
        "attention, logits, the rest), timed with and without the timers",
    )
    decode.add_argument(
        "--contexts",
        type=positive_int,
        nargs="+",
        metavar="N",
        help="instead of the decoders: the engine's decode step after a prompt of each N tokens, KV in "
        "--dtype and int8, with attention's share (fewer new tokens at long contexts; default: off)",
    )
    decode.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(decode)
    add_shape_arg(decode)
    decode.set_defaults(func=cmd_bench_decode)


def cmd_bench_decode(args) -> None:
    from minillm.benchmarks.decode import bench_decode, print_decode_report
    from minillm.benchmarks.step_profile import bench_step_profile, print_step_report

    if args.profile or args.contexts:
        report = bench_step_profile(
            args.model,
            args.dtype,
            args.prompt_len,
            args.tokens,
            args.repeats,
            args.profile,
            args.contexts,
            progress=not args.json,
        )
        show(report, print_step_report, args.json)
        return
    show(
        bench_decode(
            args.model,
            prompt_len=args.prompt_len,
            new_tokens=args.tokens,
            naive_tokens=args.naive_tokens,
            include_hf=not args.no_hf,
            dtype=args.dtype,
            repeats=args.repeats,
        ),
        print_decode_report,
        args.json,
    )


# ----------------------------------------------------------------------------- bench speculative


def add_bench_speculative(benches) -> None:
    spec = benches.add_parser(
        "speculative",
        help="decode with and without n-gram speculation: input-grounded vs open-ended prompts",
        description="Greedy decode without and with speculative decoding from the prompt "
        "(n-gram lookup), interleaved, on input-grounded prompts (repeat, quote, summarize a "
        "passage; edit a function's source) and open-ended chat prompts: batch-1 decode tok/s "
        "and a batch's wall time, the speedup (median ratio over runs, min-max), acceptance, "
        "tokens per checking pass, and whether the tokens are the very same. The 'tune' "
        "prompts are what the speculation's constants were chosen on; 'report' are others.",
    )
    spec.add_argument(
        "--prompts",
        choices=["report", "tune"],
        default="report",
        help="which prompt set: report (lcet10, textwrap) or tune (Alice, statistics) (default: report)",
    )
    spec.add_argument(
        "--max-tokens", type=positive_int, default=128, help="new tokens per request at most (default: 128)"
    )
    spec.add_argument(
        "--repeats", type=positive_int, default=3, help="interleaved runs of each side (default: 3)"
    )
    spec.add_argument(
        "--batch", type=positive_int, default=16, help="sequences in the batched run (default: 16)"
    )
    for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
        add_switch(spec, name)
    spec.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(spec, weights="model")
    spec.set_defaults(func=cmd_bench_speculative)


def cmd_bench_speculative(args) -> None:
    from minillm.benchmarks.speculative import bench_speculative, print_speculative_report

    show(
        bench_speculative(
            args.model,
            dtype=args.dtype,
            weights=args.weights,
            fused_decode=args.fused_decode,
            prompts=args.prompts,
            max_tokens=args.max_tokens,
            repeats=args.repeats,
            batch=args.batch,
            num_speculative_tokens=args.num_speculative_tokens,
            prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max,
        ),
        print_speculative_report,
        args.json,
    )


# ----------------------------------------------------------------------------- bench structured


def add_bench_structured(benches) -> None:
    structured = benches.add_parser(
        "structured",
        help="decode with and without a grammar (regex, JSON schema): what the mask costs a step",
        description="A batch of chat prompts decoded greedily, interleaved: free, constrained to "
        "a regex that cannot end before max_tokens (the same tokens' work plus the mask), and to a "
        "small JSON schema. Decode tok/s once every sequence has its first token, the ratio to "
        "free (median over runs, min-max), and the mask alone (Grammars.mask_logits) per step.",
    )
    structured.add_argument(
        "--batch", type=positive_int, default=16, help="sequences decoded at once (default: 16)"
    )
    structured.add_argument(
        "--max-tokens", type=positive_int, default=64, help="new tokens per sequence at most (default: 64)"
    )
    structured.add_argument(
        "--repeats", type=positive_int, default=3, help="interleaved runs of each side (default: 3)"
    )
    structured.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(structured)
    structured.set_defaults(func=cmd_bench_structured)


def cmd_bench_structured(args) -> None:
    from minillm.benchmarks.structured import bench_structured, print_structured_report

    show(
        bench_structured(
            args.model, dtype=args.dtype, batch=args.batch, max_tokens=args.max_tokens, repeats=args.repeats
        ),
        print_structured_report,
        args.json,
    )


# ----------------------------------------------------------------------------- bench chat-view


def add_bench_chat_view(benches) -> None:
    view = benches.add_parser(
        "chat-view",
        help="the chat's live memory panel: decode tok/s with it vs without",
        description="The same chat reply, again and again, with the live memory panel drawn "
        "into a terminal and as plain text, interleaved: decode tok/s of each "
        "(median, best, spread) and the slowdown (target: under 5%).",
    )
    view.add_argument("--rounds", type=positive_int, default=5, help="replies with each view (default: 5)")
    view.add_argument("--tokens", type=positive_int, default=128, help="tokens per reply (default: 128)")
    view.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(view)
    view.set_defaults(func=cmd_bench_chat_view)


def cmd_bench_chat_view(args) -> None:
    from minillm.benchmarks.chat_view import bench_chat_view, print_chat_view_report

    show(bench_chat_view(args.model, args.rounds, args.tokens, args.dtype), print_chat_view_report, args.json)


# ----------------------------------------------------------------------------- bench open


def add_bench_open(benches) -> None:
    from minillm.benchmarks.open import DEFAULT_GGUF

    opening = benches.add_parser(
        "open",
        help="open time, first token and peak memory: the fetched folder vs its GGUF file",
        description="Open one model in two forms, the folder weights_fetch.py wrote (safetensors) "
        "and the GGUF file it came from (opened in place), each in fresh processes taking turns: "
        "seconds to open, seconds to the first token of a 32-token prompt, and peak resident "
        "memory, as median, min and max.",
    )
    opening.add_argument(
        "--model", type=Path, default=DEFAULT_MODEL_DIR, help=f"the folder (default: {DEFAULT_MODEL_DIR})"
    )
    opening.add_argument(
        "--gguf", type=Path, default=DEFAULT_GGUF, help=f"the GGUF file (default: {DEFAULT_GGUF})"
    )
    opening.add_argument(
        "--repeats", type=positive_int, default=3, help="timed processes per form (default: 3)"
    )
    opening.add_argument("--json", action="store_true", help="print one JSON object")
    opening.set_defaults(func=cmd_bench_open)


def cmd_bench_open(args) -> None:
    from minillm.benchmarks.open import bench_open, print_open_report

    show(bench_open(args.model, args.gguf, args.repeats), print_open_report, args.json)


# ----------------------------------------------------------------------------- bench attention


def add_bench_attention(benches) -> None:
    attention = benches.add_parser(
        "attention",
        help="decode attention: torch reference vs C++ / CUDA kernels",
        description="Time one layer of SmolLM2-shaped paged decode attention for each "
        "backend and KV format over batch x context, with bandwidth "
        "achieved (the format's real bytes, scales included) against the "
        "device's measured copy bandwidth.",
    )
    attention.add_argument(
        "--batches", type=positive_int, nargs="+", default=[1, 4, 16, 64], help="(default: 1 4 16 64)"
    )
    attention.add_argument(
        "--contexts",
        type=positive_int,
        nargs="+",
        default=[128, 512, 1024, 4096],
        help="(default: 128 512 1024 4096)",
    )
    attention.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    add_switch(attention, "dtype", help="(default: %(default)s)")
    kv_formats = SWITCHES["kv_dtype"].choices
    add_switch(
        attention,
        "kv_dtype",
        nargs="+",
        default=list(kv_formats),
        help="how the pool stores K and V: auto (the model's dtype), int8, int4, fp8 (default: all four)",
    )
    attention.add_argument("--json", action="store_true", help="print one JSON object")
    attention.set_defaults(func=cmd_bench_attention)


def cmd_bench_attention(args) -> None:
    from minillm.benchmarks.attention import bench_attention, print_attention_report

    show(
        bench_attention(
            tuple(args.batches),
            tuple(args.contexts),
            args.device,
            DTYPES[args.dtype],
            tuple(dict.fromkeys(args.kv_dtype)),
        ),
        print_attention_report,
        args.json,
    )


# ----------------------------------------------------------------------------- bench all


def add_bench_all(benches) -> None:
    bench_all = benches.add_parser(
        "all",
        help="every benchmark at a size that takes minutes: JSON, plots, a table",
        description="Run every benchmark (decode, attention, serve, prefix, tiers, memory, "
        "staircase, and perplexity per KV format) at a size a small CPU finishes in "
        "minutes (--quick: about 5 on a shared 2-core VM), and write "
        "results.json (the machine, the date, every report), results.md (a "
        "table of the headline numbers) and a PNG plot per benchmark. A "
        "benchmark that fails is recorded as failed and the others still run.",
    )
    bench_all.add_argument(
        "--quick", action="store_true", help="smaller sizes, noisier numbers, no HF baselines"
    )
    bench_all.add_argument(
        "--out",
        type=Path,
        default=Path("bench_results"),
        help="folder for results.json, results.md and the plots (default: bench_results)",
    )
    bench_all.add_argument("--json", action="store_true", help="print the results as one JSON object")
    bench_all.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help=f"checkpoint folder written by weights_fetch.py (default: {DEFAULT_MODEL_DIR}); "
        "every benchmark runs in float32 on the CPU",
    )
    bench_all.set_defaults(func=cmd_bench_all)


def cmd_bench_all(args) -> int:
    """Exit status 1 when a benchmark failed (its error is in the results, the others' numbers too)."""
    import sys

    from minillm.benchmarks.all import SIZES, bench_all, print_results

    def show(bench, result) -> None:
        console.rule(f"{bench.name}: {result['status']}, {result['seconds']:.0f} s")
        if result["status"] == "ok":
            bench.print_report(result["report"], console)
        else:
            console.print(result["error"], markup=False, highlight=False)

    command = "minillm bench all" + (" --quick" if args.quick else "")
    results = bench_all(
        args.model,
        args.out,
        SIZES["quick" if args.quick else "full"],
        command,
        progress=not args.json,
        show=None if args.json else show,
    )
    if args.json:
        print_json(results)
    else:
        print_results(results, args.out)
    if results["failed"]:
        print(
            f"error: bench all: {', '.join(results['failed'])} failed; the error and traceback of each "
            f"are in {args.out / 'results.json'}",
            file=sys.stderr,
        )
        return 1
    return 0
