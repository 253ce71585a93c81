"""`minillm bench tiers`: what the KV tiers buy, four questions measured side by side in one run.

1. Preemption: recompute, swap or auto? A seeded trace of N requests (default 64; prompts of a
   32-token system prompt they share through the prefix cache, then U[16, 96] tokens of real
   prose; outputs U[8, 40], decoded greedily to exactly that length)
   arrives over time (exponential gaps, --rate requests per second) at an engine whose device KV
   pool is far too small for the requests that run at once, behind a host pool that can hold them
   all. The three rows differ only in what a preemption does: *recompute* throws the victim's KV
   away and prefills it again; *swap* copies its blocks to the host pool and back (the next one to
   run is prefetched behind a forward pass; a shared block moves once, however many holders leave
   at different steps); *auto* asks the measured cost model per victim. All
   three are lossless, so their greedy outputs must be identical — checked, not assumed.
2. Resume: a ~2,000-token chat (turns cut from real prose, in the chat template) answered by a
   fresh engine that prefills the whole history, which then parks the history in a session file;
   a second fresh engine loads it and answers the same turn, prefilling only the new turn.
3. Prefix spill: requests pick among more distinct system prompts than the device pool holds,
   one after another, with the prefix cache on. Without a host tier a prompt pushed out of the
   device LRU is gone; with one it spills there and a later request copies it back.
4. Spill rule: which cached blocks are worth that copy, every one ("all") or those a prompt read
   again ("reused"), on `bench scheduling`'s mixed trace, held-out seeds (`spill_rule.py`).

Idle time in the trace is skipped: when nothing runs and the next request has not arrived yet,
the clock jumps to its arrival, so a run costs only compute and tok/s is over busy time. Beside
it each row reports the CPU seconds the process spent: on a machine shared with other work, wall
time moves with the neighbours' load and CPU time much less. Targets are printed beside the
numbers, never asserted: a timing is a measurement, not a test.

The package, in the order a run reads it:
  preemption.py  part 1, on `workload.uniform_trace`
  sessions.py    parts 2 and 3: resume from a session file, prefix spill to a host tier
  spill_rule.py  part 4: the two spill rules on mixed traffic, on a step clock
  bench.py       the four parts on one model, and the targets: `bench_tiers`
  tables.py      the tables: `print_tiers_report`
"""

from minillm.benchmarks.tiers.bench import bench_tiers
from minillm.benchmarks.tiers.tables import print_tiers_report

__all__ = ["bench_tiers", "print_tiers_report"]
