"""Tiers: hot KV in the device pool, warm KV in a host pool, cold KV in files — and what moving costs.

The device pool is the one attention reads. When it runs short, a preempted sequence's blocks can
leave it instead of being thrown away (preemption by *swap*, not recompute): to a host pool of the
same layout, or to one file per block once the host pool is full. When the sequence runs again,
its blocks are copied back first. Blocks move whole and in their stored form — quantized numbers
with their scales and centres — so a block that comes back is bit for bit the block that left.

The block manager decides every move (`tier_moves.py`: which blocks, which tier, in which
order); `TieredKV` owns the tensors and files and performs the moves, in that order:

    tiers.copy(pairs)     for each (source, destination) block id, in any tiers

On a CUDA device the host pool is pinned (page-locked) memory that the GPU copies from directly.
On a CPU-only machine both pools live in the same RAM: the device pool is the budgeted pool that
attention reads, the host pool a second one, and a copy between them is still real memory
traffic — two passes over every byte — which is exactly what the cost model below measures.

A disk block is a safetensors file whose sha256 is kept beside it; a file that is missing, cut
short or altered no longer matches, and the sequence that needed it is recomputed instead (with a
warning): a wrong byte of KV must never reach attention. A write that fails (a full disk) loses
the block the same way.

Swap or recompute? Recomputing a victim costs a prefill of its tokens; swapping it costs two
copies of its blocks (out now, in later). `SwapCost` measures both rates on this machine as the
engine runs — prefill tokens per second from the forward passes, copy bytes per second from the
swaps — and picks the cheaper per victim (swap, until a copy has been timed).

Prefetch: the sequence the scheduler will resume next can have its blocks copied in one step
early, while the current step's forward pass runs: on a background thread (torch copies release
the GIL), timed, so the stats can say how much of the copying was hidden behind compute.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from minillm.config import ConfigError, EngineConfig, ModelConfig
from minillm.memory.block_ledger import tier_of
from minillm.memory.pool import make_pool

log = logging.getLogger("minillm")


class DiskTier:
    """One safetensors file per block, checked against the sha256 taken when written, in a folder
    of its own inside `folder` (removed when the engine goes: the blocks mean nothing to another run)."""

    def __init__(self, folder: str | Path):
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.folder = Path(tempfile.mkdtemp(prefix="minillm-kv-", dir=folder))
        except OSError as err:
            raise OSError(
                f"disk_cache_dir={str(folder)!r} cannot hold KV blocks ({err.strerror or err}); "
                "choose a writable folder."
            ) from None
        weakref.finalize(self, shutil.rmtree, self.folder, ignore_errors=True)
        self.checksums: dict[int, str] = {}  # block -> sha256 of its file
        self.lost: set[int] = set()  # blocks whose write failed
        self.checked: dict[int, dict[str, torch.Tensor]] = {}  # read and verified, not yet copied in

    def path(self, block: int) -> Path:
        return self.folder / f"block-{block}.safetensors"

    def write_block(self, block: int, payload: dict[str, torch.Tensor]) -> None:
        data = save_tensors({name: tensor.contiguous().cpu() for name, tensor in payload.items()})
        self.checksums.pop(block, None)
        self.checked.pop(block, None)  # a block id reused: what was read for its old content is stale
        self.lost.discard(block)
        try:
            self.path(block).write_bytes(data)
        except OSError as err:
            log.warning(
                "KV block %d could not be written to %s (%s); its sequence will be recomputed.",
                block,
                self.folder,
                err.strerror or err,
            )
            self.lost.add(block)
            return
        self.checksums[block] = hashlib.sha256(data).hexdigest()

    def readable(self, block: int) -> bool:
        """Is the block's file there and unaltered? (It is then kept, read, for the copy back.) A
        block not written yet is: its write was decided and is performed before any read of it."""
        if block in self.checked or (block not in self.checksums and block not in self.lost):
            return True
        try:
            data = self.path(block).read_bytes()
        except OSError:
            data = None
        if data is None or hashlib.sha256(data).hexdigest() != self.checksums.get(block):
            log.warning(
                "KV block file %s is missing or corrupt; its sequence will be recomputed.", self.path(block)
            )
            return False
        self.checked[block] = load_tensors(data)
        return True

    def read_block(self, block: int) -> dict[str, torch.Tensor]:
        if not self.readable(block):
            raise OSError(f"KV block file {self.path(block)} is missing or corrupt")
        return self.checked.pop(block)


class TieredKV:
    """The device pool, the host pool (or None) and the disk tier (or None), addressed by the
    block manager's ids: device 0..D-1, host D..D+H-1, disk D+H onward. Counts bytes moved."""

    def __init__(self, device_pool, host_pool=None, disk: DiskTier | None = None):
        self.device, self.host, self.disk = device_pool, host_pool, disk
        self.first_host = device_pool.num_blocks
        self.first_disk = self.first_host + (host_pool.num_blocks if host_pool else 0)
        self.block_bytes = device_pool.bytes_per_slot * device_pool.block_size
        self.bytes_moved: dict[str, int] = {}  # "device->host" etc. -> bytes copied that way
        self.timed: dict[str, tuple[int, float]] = {}  # way -> (bytes, seconds) of copies done in the
        #   foreground: what a swap costs the step that waits for it (a prefetch shares the cores with a
        #   forward pass, so its copies run slower and would understate the rate)
        self.side_stream = (
            torch.cuda.Stream(device_pool.device) if device_pool.device.type == "cuda" else None
        )
        self.prefetch_thread: threading.Thread | None = None
        self.prefetch_seconds = 0.0  # copying done by prefetches
        self.prefetch_waited = 0.0  # ...of which the engine still had to wait for

    @classmethod
    def build(cls, config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device) -> TieredKV:
        """The tiers a run's switches ask for: the device pool attention reads, a host pool of the
        same layout (pinned when the device is a GPU) if `host_cache_bytes`, a disk folder if
        `disk_cache_dir`."""
        layout = (config.block_size, config.kv_dtype, config.kv_key_scales, dtype)
        device_pool = make_pool(model, config.kv_cache_bytes, *layout, device)
        host_pool = disk = None
        if config.host_cache_bytes:
            pin = device_pool.device.type == "cuda"
            host_pool = make_pool(model, config.host_cache_bytes, *layout, "cpu", pin, "host_cache_bytes")
        if config.disk_cache_dir is not None:
            try:
                disk = DiskTier(config.disk_cache_dir)
            except OSError as err:
                raise ConfigError(str(err)) from None
        return cls(device_pool, host_pool, disk)

    def tier(self, block: int) -> str:
        return tier_of(block, self.first_host, self.first_disk - self.first_host)

    def store(self, block: int):
        """The pool (or disk tier) holding the block, and the block's index in it."""
        tier = self.tier(block)
        if tier == "device":
            return self.device, block
        return (self.host, block - self.first_host) if tier == "host" else (self.disk, block)

    def copy(self, pairs: list[tuple[int, int]], timed: bool = True) -> None:
        """Perform the copies in order: each destination block gets its source's stored form.
        On a GPU they run on a side stream (from pinned host memory, asynchronously), so a
        prefetch overlaps the compute on the main stream; each is waited for, to be timed."""
        for src, dst in pairs:
            start = time.perf_counter()
            (source, i), (target, j) = self.store(src), self.store(dst)
            with torch.cuda.stream(self.side_stream) if self.side_stream else contextlib.nullcontext():
                target.write_block(j, source.read_block(i))
            if self.side_stream:
                self.side_stream.synchronize()
            way = f"{self.tier(src)}->{self.tier(dst)}"
            self.bytes_moved[way] = self.bytes_moved.get(way, 0) + self.block_bytes
            if timed:
                moved, seconds = self.timed.get(way, (0, 0.0))
                self.timed[way] = (moved + self.block_bytes, seconds + time.perf_counter() - start)

    def start_prefetch(self, pairs: list[tuple[int, int]]) -> None:
        """Copy these blocks in the background; `finish_prefetch` must run before anything else
        reads or writes them (the engine calls it at the start of the next step)."""
        if pairs:

            def run():
                start = time.perf_counter()
                self.copy(pairs, timed=False)
                self.prefetch_seconds += time.perf_counter() - start

            self.prefetch_thread = threading.Thread(target=run, name="minillm-prefetch", daemon=True)
            self.prefetch_thread.start()

    def finish_prefetch(self) -> None:
        if self.prefetch_thread is not None:
            start = time.perf_counter()
            self.prefetch_thread.join()
            self.prefetch_waited += time.perf_counter() - start
            self.prefetch_thread = None

    def readable(self, blocks) -> bool:
        """Can every one of these blocks be copied back? (Disk files are verified now.)"""
        return all(self.tier(block) != "disk" or self.disk.readable(block) for block in blocks)

    def moved(self) -> dict[str, int]:
        """Bytes moved between tiers by direction (copy-on-write, device->device, is not a move)."""
        return {way: n for way, n in self.bytes_moved.items() if way != "device->device"}

    def copy_rate(self, tier: str) -> float | None:
        """Bytes per second of a round trip device -> tier -> device, as measured so far."""
        out, back = self.timed.get(f"device->{tier}", (0, 0.0)), self.timed.get(f"{tier}->device", (0, 0.0))
        moved, seconds = out[0] + back[0], out[1] + back[1]
        return moved / seconds if seconds > 0 and moved else None


class SwapCost:
    """Per victim: recompute (prefill its tokens again) or swap (copy its blocks out and back)?
    Both rates are measured as the engine runs; nothing here is a typed-in constant."""

    def __init__(self, tiers: TieredKV):
        self.tiers = tiers
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0
        self.decisions: deque[dict] = deque(maxlen=1024)  # the latest: tokens, blocks, costs, swap

    def record_forward(self, tokens: int, sequences: int, seconds: float) -> None:
        """A forward pass that prefilled (more tokens than sequences) tells the prefill rate."""
        if tokens > sequences:
            self.prefill_tokens += tokens
            self.prefill_seconds += seconds

    def prefill_rate(self) -> float | None:
        """Prefill tokens per second measured so far."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else None

    def seconds(self, tokens: int, num_blocks: int, tier: str) -> tuple[float, float] | None:
        """(recompute seconds, swap seconds) for a victim, or None before both rates are known."""
        copy_rate = self.tiers.copy_rate(tier)
        if not self.prefill_tokens or copy_rate is None:
            return None
        recompute = tokens / self.prefill_rate()
        swap = 2 * num_blocks * self.tiers.block_bytes / copy_rate  # out now, in later
        return recompute, swap

    def prefers_swap(self, tokens: int, num_blocks: int, tier: str) -> bool:
        costs = self.seconds(tokens, num_blocks, tier)
        swap = costs is None or costs[1] < costs[0]  # unmeasured: swap, which never loses work
        self.decisions.append({"tokens": tokens, "blocks": num_blocks, "costs": costs, "swap": swap})
        return swap
