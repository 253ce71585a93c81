"""`minillm bench scheduling`: which waiting request to admit, measured where memory binds, on
traffic the policies were not tuned on.

The claim (the memory system's central one): a scheduler that prices each request by what its
whole life will cost the memory system (KV blocks held x steps held, each step reading them) against
its benefit, keeps headroom when memory is tight, prefers requests whose KV is already cached and
knows which requests can still meet their latency target serves more requests within that target
than first come first served.

The run, in order:
  1. SLOs, from an idle engine (no compared run): TTFT <= TTFT_TIMES x the tuning trace's longest
     prompt prefilled alone, TPOT <= TPOT_TIMES x a batch-1 decode step. Goodput, as DistServe
     defines it: the share of requests meeting both. Memory-aware admission is told the TTFT SLO
     (`--ttft-target`), as a server operator would tell it theirs.
  2. Loads, on the tuning seeds only (0, 6, 7, 8, 9): fcfs at arrival rates falling, then growing,
     from half its capacity; per seed the rates where its goodput crosses 50%, 80% and 95%, and
     each load the median of those over the seeds. Every trace's arrivals come at exactly the rate
     asked, on average (`trace.py`), so a rate is the same mean load on every seed; the seeds'
     bursts differ, which is why one tuning seed is not enough.
  3. Every policy (fcfs, lpm, memory: `engine/admission.py`, `engine/memory_aware.py`) on every
     held-out seed at every load, the policies alternating within a seed so drift hits them alike;
     at the heaviest load also memory-aware admission given the mean length of finished requests,
     and given the trace's true lengths (`lengths.py`). Mean and spread over the seeds,
     goodput by kind, TTFT p50 and p99, preemptions and the tokens they recomputed (with the share
     of busy time that took, at the idle prefill's rate), greedy outputs compared with fcfs's
     (order changes, tokens must not).
  4. The rate each policy sustains at 90% goodput, interpolated between the two loads around it.
  5. How well the learned lengths ranked requests: Spearman's correlation of the length predicted at
     arrival with the true one, warming up and warm, beside the ceiling a perfect guess of each
     request's kind would reach.
  6. The scheduler's own cost: schedule() per step with 100 and 10,000 requests waiting
     (2,000 with --quick).

Every engine has the prefix cache on and the same small device pool; nothing is lossy.

The package, in the order a run reads it:
  trace.py   the seeded traffic: its kinds and shares (built from `workload.py`)
  replay.py  a trace through an engine on the wall clock
  lengths.py the output lengths admission is given, and how well they rank
  bench.py   the whole run: `bench_scheduling`
  tables.py  the tables and what they mean: `print_scheduling_report`
"""

from minillm.benchmarks.scheduling.bench import SIZES, bench_scheduling
from minillm.benchmarks.scheduling.tables import print_scheduling_report

__all__ = ["SIZES", "bench_scheduling", "print_scheduling_report"]
