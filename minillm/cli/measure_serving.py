"""The commands that measure the engine serving many requests: `minillm bench serve` (one seeded
trace through continuous and static batching and HF transformers), `minillm bench serve-http` (the
same trace through a `minillm serve` child, N streaming clients, or bench scheduling's workload with
--workload, or conversations resending their history with --turns; or through any
OpenAI-compatible server with --url) and `minillm bench prefix` (a
shared system prompt with the prefix cache off and on).

As in `measure.py`: each benchmark lives in `minillm.benchmarks` and returns one dict, printed as
one JSON object with --json, else as its module's tables.
"""

from __future__ import annotations

import argparse

from minillm.cli.flags import (
    CPU_BACKENDS,
    add_engine_args,
    add_eviction_args,
    add_kv_quantization_args,
    add_model_args,
    add_shape_arg,
    add_speculative_args,
    add_switch,
    add_tier_args,
    engine_argv,
    engine_switches,
    positive_float,
    positive_int,
)
from minillm.report import show

# ----------------------------------------------------------------------------- bench serve


def add_bench_serve(benches) -> None:
    serve = benches.add_parser(
        "serve",
        help="a 64-request trace: continuous vs static vs HF transformers",
        description="Serve one seeded trace (prompts U[16, 320], outputs U[8, 160] tokens) "
        "with minillm continuous and static batching and HF transformers' "
        "batched generate: output tok/s, achieved GFLOP/s against a matmul "
        "measured in the same run, TTFT, TPOT, KV utilization of paged "
        "vs contiguous memory, and a block-size sweep.",
    )
    serve.add_argument(
        "--requests", type=positive_int, default=64, help="requests in the trace (default: 64)"
    )
    serve.add_argument(
        "--max-num-seqs", type=positive_int, default=16, help="batch size for every server (default: 16)"
    )
    serve.add_argument(
        "--block-sizes",
        type=positive_int,
        nargs="*",
        default=[8, 16, 32, 64, 128],
        help="block sizes to sweep (default: 8 16 32 64 128; none to skip)",
    )
    add_switch(
        serve,
        "attention_backend",
        choices=CPU_BACKENDS,
        help="minillm's decode attention: torch reference or the C++ kernel (default: %(default)s)",
    )
    serve.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    serve.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(serve)
    add_shape_arg(serve)
    serve.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> None:
    from minillm.benchmarks.serve import bench_serve, print_serve_report

    show(
        bench_serve(
            args.model,
            num_requests=args.requests,
            max_num_seqs=args.max_num_seqs,
            block_sizes=tuple(args.block_sizes),
            include_hf=not args.no_hf,
            attention_backend=args.attention_backend,
            dtype=args.dtype,
        ),
        print_serve_report,
        args.json,
    )


# ----------------------------------------------------------------------------- bench serve-http


def add_bench_serve_http(benches) -> None:
    http = benches.add_parser(
        "serve-http",
        help="minillm serve with N streaming clients vs LLM.generate, or a workload's goodput",
        description="The HTTP server's cost: N streaming clients (default 32) send bench "
        "serve's seeded trace at once to a `minillm serve` child process; "
        "aggregate output tok/s against LLM.generate on the same prompts in "
        "this process (target >= 80%), p50/p99 time to first token, whether "
        "every client got LLM.generate's text, and the KV blocks still held "
        "once all have finished, and again after half of them hang up "
        "mid-stream (must be 0). Per client: the inter-token latency p50/p99 and decode tok/s. "
        "With --url, the same clients against a server already running (llama.cpp's, vLLM, "
        "minillm serve...). With --workload, bench scheduling's seeded traffic instead, each "
        "request at its arrival time: goodput within a TTFT and a TPOT SLO. With --turns N, each "
        "client a conversation of N turns, every turn resending the history: TTFT per turn. The "
        "prefix cache is on, as minillm serve starts it; --no-prefix-caching turns it off. Needs the serve "
        'extra: pip install -e ".[serve]" (not with --url).',
    )
    add_client_args(http)
    add_workload_args(http)
    http.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(http)
    add_kv_quantization_args(http)
    add_eviction_args(http)
    add_tier_args(http)
    add_speculative_args(http)
    add_model_args(http, weights="model")
    http.set_defaults(func=cmd_bench_serve_http)


def add_workload_args(http) -> None:
    """--workload: bench scheduling's traffic instead of N clients at once, and its SLOs."""
    from minillm.benchmarks import serve_http_workload as defaults

    workload = http.add_argument_group("--workload (bench scheduling's traffic, sent over HTTP)")
    workload.add_argument(
        "--workload",
        action="store_true",
        help="instead of the clients above and LLM.generate: replay bench scheduling's seeded workload "
        "(questions, shared system prompts, multi-turn chats, documents, long answers; Poisson "
        "arrivals) against the server, each request streamed at its arrival time, a chat turn after "
        "its previous answer and a think time; prints goodput (requests within both SLOs), TTFT "
        "and TPOT p50/p99",
    )
    sizes = (
        ("seed", int, defaults.SEED, "the workload's seed"),
        ("requests", positive_int, defaults.REQUESTS, "requests, a chat's every turn counted"),
        ("rate", positive_float, defaults.RATE, "arrivals per second, Poisson"),
        ("scale", positive_float, defaults.SCALE, "multiplies every prompt and output length"),
    )
    for name, kind, default, what in sizes:
        help = f"{what} (default: %(default)s)"
        workload.add_argument(f"--workload-{name}", type=kind, default=default, help=help)
    _add_slo_args(workload, defaults.SLO_FACTOR)
    workload.add_argument(
        *(f"--trace{tail}" for tail in ("", "-seed", "-requests", "-rate", "-scale")),
        nargs="?",
        action=Renamed,
        help=argparse.SUPPRESS,
    )


def _add_slo_args(workload, factor: float) -> None:
    """--ttft-slo and --tpot-slo: what makes a request good, by default measured on the idle server."""
    measured = {
        "ttft": ("time to first token", "the workload's longest prompt's prefill"),
        "tpot": ("time per output token", "the time per token of one request decoding alone"),
    }
    for name, (what, idle) in measured.items():
        workload.add_argument(
            f"--{name}-slo",
            type=positive_float,
            default=None,
            metavar="SECONDS",
            help=f"a request is good if its {what} is at most this (default: {factor} x {idle}, "
            "measured on the idle server before the replay, the smaller of 2 tries)",
        )


class Renamed(argparse.Action):
    """A flag bench serve-http renamed: --trace and --trace-* replayed a request trace here, and
    now --workload does (everywhere else --trace FILE writes KV events). One line says which."""

    def __call__(self, parser, namespace, values, option_string=None):
        renamed = option_string.replace("--trace", "--workload")
        parser.error(f"{option_string} is now {renamed}")


def cmd_bench_serve_http(args) -> None:
    from minillm.benchmarks.serve_http import bench_serve_http, print_serve_http_report
    from minillm.benchmarks.serve_http_turns import print_serve_http_turns_report
    from minillm.benchmarks.serve_http_url import bench_serve_http_url, print_serve_http_url_report
    from minillm.benchmarks.serve_http_workload import print_serve_http_workload_report
    from minillm.config import ConfigError
    from minillm.serve import missing_server_packages

    problem = None if args.url else missing_server_packages()  # --url needs no server of ours
    if problem:
        raise ConfigError(problem)
    switches = {k: v for k, v in engine_switches(args).items() if k != "model_dir"}
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    serve_args = engine_argv(args) + (["--threads", str(args.threads)] if args.threads else [])
    if args.turns and args.workload:
        raise ConfigError("--turns and --workload are two different loads: give one of them.")
    if args.prompt_tokens and args.workload:
        raise ConfigError("--workload brings its own prompt lengths: drop --prompt-tokens, or --workload.")
    if args.turns:
        show(bench_turns_from(args, serve_args), print_serve_http_turns_report, args.json)
    elif args.workload:
        show(bench_workload_from(args, serve_args, switches), print_serve_http_workload_report, args.json)
    elif args.url:
        show(
            bench_serve_http_url(
                args.model, args.url, args.clients, args.max_tokens, args.repeats, args.prompt_tokens
            ),
            print_serve_http_url_report,
            args.json,
        )
    else:
        show(
            bench_serve_http(
                args.model,
                serve_args,
                switches,
                clients=args.clients,
                disconnect_after=args.disconnect_after,
                repeats=args.repeats,
                max_tokens=args.max_tokens,
                prompt_tokens=args.prompt_tokens,
            ),
            print_serve_http_report,
            args.json,
        )


def add_client_args(parser) -> None:
    """Who the clients talk to, how many there are, what they ask (`_add_request_args`) and how often."""
    parser.add_argument(
        "--url",
        metavar="URL",
        help="drive the OpenAI-compatible server at URL (http://HOST:PORT) instead of a minillm serve "
        "child: the same streaming requests to URL/v1/completions (prompt as token ids of --model's "
        "tokenizer, so serve the same model; ignore_eos), the model named by URL/v1/models; no "
        "LLM.generate comparison, no /metrics checks, no disconnect round, and the engine flags "
        "and --threads do not apply. The warm-up and every round get their own seeded prompts "
        "(seeds 0, 1, 2...), so that no round finds its prompts in the server's cache from an "
        "earlier one. With --repeats, the median and min-max of the rounds. With "
        "--workload, that workload replayed against URL (no KV blocks check)",
    )
    parser.add_argument(
        "--clients", type=positive_int, default=32, help="streaming clients, one request each (default: 32)"
    )
    _add_request_args(parser)
    parser.add_argument(
        "--disconnect-after",
        type=positive_int,
        default=4,
        help="in the second round, every other client hangs up after this many chunks (default: 4)",
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="rounds of LLM.generate then the clients, interleaved; the best of each is reported "
        "(with --url: rounds of the clients, their median and min-max) (default: 1)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch threads for LLM.generate and for the server's engine; on a CPU shared with "
        "other work (here: the clients) more threads wait for each other (default: 1)",
    )


def _add_request_args(parser) -> None:
    """What each client asks: how long its prompt and answer are, and how many turns it talks."""
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="every request decodes exactly N tokens instead of its own length (e.g. --clients 1 "
        "--max-tokens 128: one stream's decode speed)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=None,
        metavar="N",
        help="every prompt is exactly N tokens of prose instead of U[16, 320] (e.g. --clients 1 "
        "--prompt-tokens 4000 --max-tokens 128: one conversation's time to first token and decode "
        "speed at that prompt length), cut from the same text, so shorter than it; with --turns, "
        "turn 1's prompt; not with --workload (default: off)",
    )
    parser.add_argument(
        "--turns",
        type=positive_int,
        default=None,
        metavar="N",
        help="each client holds a conversation of N turns instead of one request: turn 1 its prompt, "
        "each later turn the whole history resent (the last prompt, the answer's token ids, or its "
        "text tokenized again where the server sends none, and a new user message of prose); TTFT "
        "per turn, with --repeats its median and min-max over rounds of new conversations; against "
        "the minillm serve child or --url (default: off, one request per client)",
    )


def bench_turns_from(args, serve_args: list[str]) -> dict:
    from minillm.benchmarks.serve_http_turns import bench_serve_http_turns

    return bench_serve_http_turns(
        args.model,
        serve_args,
        url=args.url,
        clients=args.clients,
        turns=args.turns,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        prompt_tokens=args.prompt_tokens,
    )


def bench_workload_from(args, serve_args: list[str], switches: dict) -> dict:
    from minillm.benchmarks.serve_http_workload import bench_serve_http_workload

    return bench_serve_http_workload(
        args.model,
        serve_args,
        switches,
        seed=args.workload_seed,
        num_requests=args.workload_requests,
        rate=args.workload_rate,
        scale=args.workload_scale,
        ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo,
        progress=not args.json,
        url=args.url,
        max_tokens=args.max_tokens,
    )


# ----------------------------------------------------------------------------- bench prefix


def add_bench_prefix(benches) -> None:
    prefix = benches.add_parser(
        "prefix",
        help="requests sharing a system prompt: prefix cache off vs on",
        description="Requests that share a ~500-token system prompt, one after another, "
        "with and without the prefix cache: TTFT and prefill tokens computed.",
    )
    prefix.add_argument("--requests", type=positive_int, default=32, help="(default: 32)")
    prefix.add_argument(
        "--system-tokens", type=positive_int, default=500, help="system prompt length (default: 500)"
    )
    add_switch(prefix, "attention_backend", choices=CPU_BACKENDS, help="(default: %(default)s)")
    prefix.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)


def cmd_bench_prefix(args) -> None:
    from minillm.benchmarks.prefix import bench_prefix, print_prefix_report

    show(
        bench_prefix(args.model, args.requests, args.system_tokens, args.attention_backend),
        print_prefix_report,
        args.json,
    )
