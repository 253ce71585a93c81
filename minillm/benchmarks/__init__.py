"""Benchmarks behind `minillm bench ...`: each measures side by side in one run and returns a
dict (printed as JSON with --json) so numbers can be compared across commits.

decode.py               bench decode: batch-1 decode speed beside its physical roof
step_profile.py         bench decode --profile, --contexts: where a decode step's milliseconds go
attention.py            bench attention: decode attention alone, every backend and KV format
speculative.py          bench speculative: decode with and without n-gram speculation
structured.py           bench structured: what constraining the output to a grammar costs a step
chat_view.py            bench chat-view: what the chat's live memory panel costs in decode speed
open.py                 bench open: a folder and its GGUF file, to open and to the first token
serve.py                bench serve: one request trace, three servers (HF, minillm static and continuous)
prefix.py               bench prefix: requests sharing a system prompt, with and without the cache
serve_http.py           bench serve-http: what the HTTP server costs against LLM.generate
serve_http_url.py       bench serve-http --url: the same clients against any OpenAI-compatible server
serve_http_workload.py  bench serve-http --workload: bench scheduling's traffic over HTTP
serve_http_turns.py     bench serve-http --turns: conversations, each turn resending the history
memory/                 bench memory: the memory system built up one layer at a time
tiers/                  bench tiers: preemption, resume, prefix spill, the spill rule
scheduling/             bench scheduling: admission policies where memory binds, held-out traces
staircase/              bench staircase: HF transformers, then each technique in turn
fleet/                  bench fleet: engines in their own processes, a Redis KV store, the router
all/                    bench all: every benchmark in one command, into results.json and plots
recorded.py             the runs the pages quote, committed in docs/results/, and the quotes checked
shared by them: workload.py (what the benches serve: requests cut from prose, arriving over
time), stats.py (percentiles, spreads, MiB), hf_baseline.py (HF transformers on static
batches), serve_child.py (`minillm serve` in a child process), http_client.py (the clients
bench serve-http measures a server with), delay_proxy.py (a TCP proxy that delays every reply: a
slow store for the remote KV tier's tests and bench fleet)."""

from contextlib import contextmanager


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_extensions() -> str:
    """The vector extensions a kernel's speed turns on (Linux), widest first: the same marketing
    name covers an AVX2-only EPYC and one with avx512_bf16."""
    from pathlib import Path

    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "unknown"
    named = [name for name in ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if name in flags]
    return ", ".join(named) or "none of AVX2, AVX-512, AMX"


@contextmanager
def torch_threads(threads: int):
    """torch's threads set to `threads` for a run, and given back after it, however it ends."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def machine(threads: int | None = None) -> dict:
    """What a measurement ran on: the CPU, its cores, torch's threads (`threads`, else now), torch's
    and Python's versions."""
    import os
    import platform

    import torch

    return {
        "cpu_model": cpu_model(),
        "cpu_extensions": cpu_extensions(),
        "cpus": os.cpu_count(),
        "torch_threads": threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def print_targets(report: dict, console) -> None:
    """What a bench should buy beside what it bought (printed, never asserted), and the machine."""
    from minillm.report import print_table

    besides = any("beside" in t for t in report["targets"].values())
    print_table(
        console,
        "targets (printed, not asserted)",
        ["target", "want", "got", *(["beside it"] if besides else []), "met"],
        [
            [
                name,
                t["want"],
                "n/a" if t["got"] is None else f"{t['got']:.2f}" if isinstance(t["got"], float) else t["got"],
                *([t.get("beside", "")] if besides else []),
                "yes" if t["met"] else "no",
            ]
            for name, t in report["targets"].items()
        ],
    )
    m = report["machine"]
    console.print(
        f"[dim]{m['cpu_model']}, {m['cpus']} CPUs, {m['torch_threads']} torch thread(s), "
        f"torch {m['torch']}; idle gaps in the trace are skipped, so tok/s is over busy time.[/dim]"
    )


def copy_bandwidth(device: str = "cpu", nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes moved per second by a large tensor copy (read + write, STREAM's convention), best of
    `repeats`: the memory roof that decode speeds are compared with."""
    import time

    import torch

    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float | None:
    """Bytes read per second, best of `repeats`: the CPU kernels' `read_bytes` summing a buffer
    larger than the caches on every torch thread. Decode at batch 1 only reads its weights, so this,
    not the copy roof (which also writes), is the speed a batch-1 step is bounded by. None where the
    CPU kernels do not build."""
    import time

    import torch

    from minillm.matmul import dense_kernel

    kernel = dense_kernel()
    if kernel is None:
        return None
    buffer = torch.ones(nbytes // 8, dtype=torch.int64)
    kernel.read_bytes(buffer)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.read_bytes(buffer)
        best = min(best, time.perf_counter() - start)
    return nbytes / best
