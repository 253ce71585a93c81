"""The memory system: where every token's keys and values live, who holds them, and what it costs.

kv_cache_manager.py  KVCacheManager: the one door the engine talks to about memory; Capacity
block_manager.py     blocks, block tables, reference counts, copy-on-write (PagedAttention)
tier_moves.py        TierMoves: tier moves over the same tables: swap out and in, spill, bring back
block_ledger.py      BlockLedger: each tier's free blocks, refcounts, the copies decided
prefix_cache.py      full blocks found again by their content (hash chains, LRU reuse)
pool.py              the KV tensors in the model's dtype: PagedKVPool; make_pool sizes a pool
quantized_pool.py    QuantizedKVPool: int8 / int4 / fp8 numbers with scales; keys staged as blocks fill
quantization.py      int8 / int4 / fp8 formats with scales: quantize, dequantize, bytes per token
tiers.py             host and disk tiers: TieredKV moves blocks, SwapCost weighs swap vs recompute
eviction.py          keep a budget of entries per sequence: window, attention sinks, H2O (Evictor)
rollback.py          speculation's rollback: how far a sequence may guess, its rejected guesses cut
sessions.py          a conversation's KV parked in one file, resumed by a later run
remote.py            RemoteKV: full prefix blocks shared by engines through a Redis server, checked
remote_values.py     ...its keys (a sha256 chain) and values (a checked header, the stored block)
pressure.py          the pressure ladder: reclaim, preempt, evict, cheapest first
arena.py             the "traditional" baseline: one max-length reservation per request
accounting.py        one place that answers: reserved, live, shared, utilization; MemorySnapshot
events.py            KV events: every change of a block's life, its JSON round trip, the bus
replay.py            Replayer: the block state rebuilt from the events alone (the tests' oracle)

It imports neither the engine nor attention: they call into it, through the door this package
exports (`KVCacheManager`, and what it hands back). Code that needs one part by name (a test of
the block manager, a benchmark that builds a pool) imports it from that part's module.
"""

from minillm.memory.accounting import MemorySnapshot, MemoryStats
from minillm.memory.kv_cache_manager import Capacity, KVCacheManager
from minillm.memory.sessions import SessionError

__all__ = ["Capacity", "KVCacheManager", "MemorySnapshot", "MemoryStats", "SessionError"]
