"""Benchmarks behind `minillm bench ...`: each measures side by side in one run and returns a
dict (printed as JSON with --json) so numbers can be compared across commits."""


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
