"""KV memory accounting, in one place: reserved, live, utilization, fragmentation.

- reserved: slots set aside for sequences (whole blocks for paging, whole max-length stretches
  for the contiguous arena);
- live: slots holding the key/value of a token that exists now;
- utilization = live / reserved;
- internal fragmentation = reserved - live (slots reserved but empty);
- external fragmentation = free slots that the largest possible request could not use
  (always 0 for paging: any free block serves anyone);
- shared: slots that sharing saved (prefix hits, forks), counted once per extra holder;
- per tier: slots held in the host pool and on disk (swapped-out sequences), the host pool's
  size, and the bytes moved so far in each direction ("device->host", "host->device", ...);
- and the whole picture at one moment, read-only (`MemorySnapshot`): every block's state per
  tier, every sequence's table, the counters, what the prefix cache found.
Bytes are slots x bytes per token slot (K and V, all layers, scales included once quantized).
The device numbers above count the device pool only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from minillm.memory.arena import ContiguousArena
from minillm.memory.block_manager import BlockManager


@dataclass(slots=True)  # one per step in the engine's window: kept small
class MemoryStats:
    total_slots: int
    reserved_slots: int
    live_slots: int
    external_fragmentation_slots: int
    bytes_per_slot: int
    shared_slots: int = 0  # slots that sharing saved: a block held by k tables counts (k - 1) times
    host_total_slots: int = 0
    host_reserved_slots: int = 0  # held by swapped-out sequences
    disk_reserved_slots: int = 0
    bytes_moved: dict[str, int] = field(default_factory=dict)  # direction -> bytes, since the engine started

    @property
    def utilization(self) -> float:
        return self.live_slots / self.reserved_slots if self.reserved_slots else 1.0

    @property
    def internal_fragmentation_slots(self) -> int:
        return self.reserved_slots - self.live_slots

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "utilization": self.utilization,
            "internal_fragmentation_slots": self.internal_fragmentation_slots,
            "reserved_bytes": self.reserved_slots * self.bytes_per_slot,
            "live_bytes": self.live_slots * self.bytes_per_slot,
            "shared_bytes": self.shared_slots * self.bytes_per_slot,
            "host_reserved_bytes": self.host_reserved_slots * self.bytes_per_slot,
            "disk_reserved_bytes": self.disk_reserved_slots * self.bytes_per_slot,
        }


def paged_stats(
    manager: BlockManager,
    live_tokens: dict[int, int],
    bytes_per_slot: int,
    bytes_moved: dict[str, int] | None = None,
) -> MemoryStats:
    """live_tokens: seq_id -> tokens whose KV is stored in the device pool now."""
    size = manager.block_size
    reserved_blocks = manager.num_blocks - manager.num_free_blocks
    return MemoryStats(
        total_slots=manager.num_blocks * size,
        reserved_slots=reserved_blocks * size,
        live_slots=sum(live_tokens.values()),
        external_fragmentation_slots=0,
        bytes_per_slot=bytes_per_slot,
        shared_slots=sum(held - 1 for held in manager.held("device").values()) * size,
        host_total_slots=manager.num_host_blocks * size,
        host_reserved_slots=len(manager.held("host")) * size,
        disk_reserved_slots=len(manager.held("disk")) * size,
        bytes_moved=dict(bytes_moved or {}),
    )


def arena_stats(arena: ContiguousArena, live_tokens: dict[int, int], bytes_per_slot: int) -> MemoryStats:
    free = arena.num_free_slots
    return MemoryStats(
        total_slots=arena.num_slots,
        reserved_slots=arena.num_slots - free,
        live_slots=sum(live_tokens.values()),
        external_fragmentation_slots=free - arena.largest_hole,
        bytes_per_slot=bytes_per_slot,
    )


@dataclass(frozen=True)
class SequenceView:
    """One sequence as the memory system sees it, in plain values (a copy: changing it changes nothing)."""

    seq_id: int
    request_id: str
    status: str  # "running" or "waiting"
    num_computed: int  # tokens processed (the next position)
    num_cached: int  # KV entries stored (num_computed less what eviction dropped)
    max_len: int  # the most tokens it may reach
    table: tuple[int, ...]  # its block table: logical block i -> physical block id (any tier); () if none


@dataclass(frozen=True)
class MemorySnapshot:
    """The memory system at one moment, read-only: what `/metrics`, the chat's panel and `/memory`,
    `minillm generate --json`, the benchmarks and the lessons read, instead of reaching inside.

    `blocks` holds every block's state per tier the engine has: the device and host pools by id (a
    host block's id is `num_blocks` + its index), the disk's block files in use. States: "free";
    "cached" (free, but findable in the prefix cache: the first to go under pressure); "shared"
    (held by several tables, or by one and findable by requests to come); "private" (one table's
    alone); "filling" (a private device block of a quantized pool whose keys still wait in full
    precision)."""

    block_size: int
    bytes_per_token: int  # K and V, all layers, scales included once quantized
    pool_bytes: int  # the device pool's tensors
    staged_bytes: int  # keys of filling blocks kept in full precision (quantized pools)
    blocks: dict[str, tuple[str, ...]]  # tier -> every block's state
    stats: MemoryStats  # reserved, live, shared, per tier, bytes moved
    sequences: tuple[
        SequenceView, ...
    ]  # running ones first (oldest first), then the waiting ones in queue order
    counters: dict[str, int]  # preemptions, swapped_out, swapped_in, prefetched, recomputed_tokens,
    #   copy_on_write, spilled, spill_hits, reclaimed: totals since the engine started
    prefix_cache: dict | None  # PrefixCache.stats() (with "hit_rate"), None without a prefix cache
    preemption: str  # "recompute", "swap" or "auto" (the measured cost model)
    prefetch_seconds: float = 0.0  # copying done by prefetches
    prefetch_waited: float = 0.0  # ...of which the engine still waited for
    copy_rates: dict[str, float] = field(default_factory=dict)  # tier -> round-trip bytes/s measured so far
    prefill_rate: float | None = None  # prefill tokens/s measured so far (the cost model's other rate)
    # preemption="auto": its latest swap-or-recompute decisions (tokens, blocks, (recompute s, swap s), swap)
    swap_decisions: tuple[dict, ...] = ()
    remote: dict | None = None  # the remote store's counters (`RemoteKV.stats`), None without one

    @property
    def num_blocks(self) -> int:
        """Device blocks: the pool attention reads."""
        return len(self.blocks["device"])

    @property
    def num_host_blocks(self) -> int:
        return len(self.blocks.get("host", ()))

    @property
    def num_free_blocks(self) -> int:
        return sum(state in ("free", "cached") for state in self.blocks["device"])

    def count(self, tier: str = "device") -> dict[str, int]:
        """Blocks of a tier per state (every state named, 0 where none)."""
        counts = dict.fromkeys(("free", "cached", "shared", "private", "filling"), 0)
        for state in self.blocks.get(tier, ()):
            counts[state] += 1
        return counts

    def running(self) -> list[SequenceView]:
        return [seq for seq in self.sequences if seq.status == "running"]

    def waiting(self) -> list[SequenceView]:
        return [seq for seq in self.sequences if seq.status == "waiting"]


def block_states(manager: BlockManager, pool=None) -> dict[str, list[str]]:
    """Every block's state per tier the manager has, by id: the device and host pools whole, the
    disk's block files in use. "free"; "cached" (free, but its content is findable in the prefix
    cache: the first to go under pressure); "shared" (held by several tables, or by one and
    findable by requests to come); "private" (one table's alone); with a `pool`, "filling" for a
    private device block of a quantized pool whose keys still wait in full precision (in the first
    layer; every layer stages the same blocks)."""
    cached = manager.prefix_cache.entries if manager.prefix_cache else {}

    def state(block: int) -> str:
        if manager.refcounts[block] == 0:
            return "cached" if block in cached else "free"
        return "shared" if manager.refcounts[block] > 1 or block in cached else "private"

    first_disk = manager.num_blocks + manager.num_host_blocks
    ids = {
        "device": range(manager.num_blocks),
        "host": range(manager.num_blocks, first_disk),
        "disk": sorted(manager.held("disk")),
    }
    tiers = ["device"] + ["host"] * bool(manager.num_host_blocks) + ["disk"] * manager.disk
    states = {tier: [state(block) for block in ids[tier]] for tier in tiers}
    for block in pool.staged_blocks(0) if pool else ():
        if states["device"][block] == "private":
            states["device"][block] = "filling"
    return states


def take_snapshot(
    manager: BlockManager,
    tiers,
    sequences: list[tuple],
    counters: dict[str, int],
    preemption: str,
    swap_cost,
    remote: dict | None = None,
) -> MemorySnapshot:
    """The `MemorySnapshot` of a block manager, its tiers (`TieredKV`: the device pool first) and
    its cost model (`SwapCost`, or None without a tier to swap to). `sequences`: (seq_id,
    request_id, status, num_computed, num_cached, max_len) of each unfinished one; `remote`: the
    remote store's counters, if there is one."""
    pool, cache = tiers.device, manager.prefix_cache
    views = tuple(
        SequenceView(*seq, tuple(manager.table(seq[0])) if manager.has_table(seq[0]) else ())
        for seq in sequences
    )
    live = {view.seq_id: view.num_cached for view in views if view.status == "running"}
    counters = {
        **counters,
        "copy_on_write": manager.num_copies,
        "spilled": manager.moves.num_spilled,
        "spill_hits": manager.moves.num_spill_hits,
        "reclaimed": manager.moves.num_reclaimed,
        "swap_copies_saved": manager.moves.num_copies_saved,
    }
    rates = {tier: rate for tier in ("host", "disk") if (rate := tiers.copy_rate(tier)) is not None}
    return MemorySnapshot(
        block_size=manager.block_size,
        bytes_per_token=pool.bytes_per_slot,
        pool_bytes=pool.nbytes,
        staged_bytes=pool.staged_bytes,
        blocks={t: tuple(s) for t, s in block_states(manager, pool).items()},
        stats=paged_stats(manager, live, pool.bytes_per_slot, tiers.moved()),
        sequences=views,
        counters=counters,
        prefix_cache={**cache.stats(), "hit_rate": cache.hit_rate} if cache else None,
        preemption=preemption,
        prefetch_seconds=tiers.prefetch_seconds,
        prefetch_waited=tiers.prefetch_waited,
        copy_rates=rates,
        prefill_rate=swap_cost.prefill_rate() if swap_cost else None,
        swap_decisions=tuple(swap_cost.decisions) if swap_cost else (),
        remote=remote,
    )
