"""`minillm bench memory`: the memory system built up one layer at a time, on one trace and one budget.

The seeds' claim: from the same KV bytes, paging, sharing, compression, tiers, memory-aware
admission and a pressure ladder serve more requests at once, faster and within latency targets,
than reserving each request's maximum length; and the lossy layers say what they cost.

The trace (seeded, so every run and commit sees the same one): N requests (default 24) arriving
over time (exponential gaps, --rate per second), of four kinds in fixed shares (40% questions, 35%
chats, 15% documents, 10% long answers) in a seeded order (--seed; the sizes were chosen on seed
0, and the default reports seed 1), cut from real prose, decode-heavy as chat traffic is:
  question     a short question, U[16, 48] tokens, 64 tokens out (max_tokens 128);
  chat         one of 3 system prompts (96 tokens of a second text) and a user turn of U[8, 24]
               tokens, in the chat template, 96 out (max_tokens 192): the prefix cache can share
               the system prompt;
  document     a long document, U[192, 384] tokens, 32 out (max_tokens 64);
  long answer  a short prompt, U[16, 32] tokens, and a long answer, 256 out (max_tokens 384).
Like a client, each request declares a max_tokens larger than what it turns out to need, and
nobody but the trace knows its length: it is decoded greedily and ends with EOS at exactly its
output length (`ScriptedStop`; no EOS before), so every row does the same work and the engine
learns lengths only as requests finish. --quick quarters every length and runs fewer requests.

The budget: one device pool of --kv-tokens tokens of float32 KV (default 640: 40 blocks, under two
documents), given to every row in bytes, so an int8 pool cuts the same bytes into ~3.5x more
blocks. The trace is decode-heavy and its requests overlap, so the pool binds for every row: the
float32 rows hold a handful of requests and preempt; the int8 rows hold about three times as many
and still run short at the trace's peak (chosen on seed 0, 2026-12-06: 7 requests at once in row
3 and 20 in row 4, which still preempted 4 times). The rows add one layer at a time:
  (1) max-length reservation: each request holds prompt + max_tokens from admission on (the
      contiguous baseline, played on the paged pool, `admission="reserve"`);
  (2) paged: blocks as tokens come, first come first served, preemption by recompute;
  (3) + prefix cache;  (4) + int8 KV;  (5) + a host tier holding the whole trace, preemption
      "auto" (swap or recompute by measured cost);  (6) + memory-aware admission;
  (7) + the pressure ladder's lossy rung: H2O eviction to half of each sequence's length, only
      after a step that had to preempt (a shared prompt prefix stays whole: each sequence evicts
      only from its private part);
  (L) the lossless system: (6) with float32 KV, to compare with (1).
Lossless rows must give row (2)'s greedy tokens: checked and reported, not asserted.

Goodput is the fraction of requests meeting a time-to-first-token and a time-per-output-token
target, both derived from a calibration measured in this run on an idle engine: TTFT within
TTFT_TIMES x the time to prefill the trace's longest prompt alone, TPOT within TPOT_TIMES x a
batch-1 decode step. Quality for the lossy rows is perplexity through the row's cache over the
exact cache, on two public-domain texts of different kinds (a novel, a workshop report).

Two load tests (rows (1), (2), (L), (6)): closed loop, C clients each sending a chat request
when its previous one has answered. (a) At --clients C: p50/p99 latency. (b) The largest C on a
doubling grid whose p99 TTFT meets a target (LOAD_TTFT_TIMES x one such request prefilled alone);
the sweep stops at the first C that misses it.

As in `bench tiers`: idle time in the trace is skipped (the clock jumps to the next arrival), so
tok/s is over busy time, CPU seconds are reported beside wall time, and targets are printed
beside the numbers, never asserted.

The package, in the order a run reads it:
  trace.py   the seeded trace: its request kinds and shares (built from `workload.py`)
  rows.py    the rows, one layer added each; the calibration; quality through the lossy caches
  load.py    the closed-loop load tests
  bench.py   the whole run and its targets: `bench_memory`
  tables.py  the tables: `print_memory_report`
"""

from minillm.benchmarks.memory.bench import SIZES, bench_memory
from minillm.benchmarks.memory.tables import print_memory_report

__all__ = ["SIZES", "bench_memory", "print_memory_report"]
