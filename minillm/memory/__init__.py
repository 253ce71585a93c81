"""The memory system: where every token's keys and values live, who holds them, and what it costs.

kv_cache_manager.py  KVCacheManager: the one door the scheduler talks to about memory
block_manager.py     blocks, block tables, reference counts, copy-on-write (PagedAttention)
prefix_cache.py      full blocks found again by their content (hash chains, LRU reuse)
pool.py              the KV tensors: PagedKVPool (model dtype), QuantizedKVPool; make_pool sizes one
quantization.py      int8 / int4 / fp8 formats with scales: quantize, dequantize, bytes per token
tiers.py             host and disk tiers: TieredKV moves blocks, SwapCost weighs swap vs recompute
eviction.py          keep a budget of entries per sequence: window, attention sinks, H2O (Evictor)
sessions.py          a conversation's KV parked in one file, resumed by a later run
pressure.py          the pressure ladder: reclaim, preempt, evict, cheapest first
arena.py             the "traditional" baseline: one max-length reservation per request
accounting.py        one place that answers: reserved, live, shared, utilization; MemorySnapshot
events.py            KV events: every change of a block's life, its JSON round trip, the bus
replay.py            Replayer: the block state rebuilt from the events alone (the tests' oracle)

It imports neither the engine nor attention: they call into it.
"""

from minillm.memory.accounting import MemorySnapshot, MemoryStats, SequenceView, arena_stats, paged_stats
from minillm.memory.arena import ContiguousArena
from minillm.memory.block_manager import BlockManager, BlockManagerError
from minillm.memory.eviction import NUM_SINKS, Evictor, budget_for, kept_entries
from minillm.memory.kv_cache_manager import Allocation, KVCacheManager
from minillm.memory.pool import PagedKVPool, QuantizedKVPool, bytes_per_slot, make_pool
from minillm.memory.prefix_cache import PrefixCache
from minillm.memory.pressure import RUNGS, PressureLadder
from minillm.memory.quantization import FORMATS, KVFormat, bytes_per_token, dequantize, quantize
from minillm.memory.sessions import SessionError, load_session, save_session
from minillm.memory.tiers import DiskTier, SwapCost, TieredKV

__all__ = [
    "Allocation",
    "BlockManager",
    "BlockManagerError",
    "ContiguousArena",
    "DiskTier",
    "Evictor",
    "FORMATS",
    "KVCacheManager",
    "KVFormat",
    "MemorySnapshot",
    "MemoryStats",
    "NUM_SINKS",
    "PagedKVPool",
    "PressureLadder",
    "PrefixCache",
    "QuantizedKVPool",
    "RUNGS",
    "SequenceView",
    "SessionError",
    "SwapCost",
    "TieredKV",
    "arena_stats",
    "budget_for",
    "bytes_per_slot",
    "bytes_per_token",
    "dequantize",
    "kept_entries",
    "load_session",
    "make_pool",
    "paged_stats",
    "quantize",
    "save_session",
]
