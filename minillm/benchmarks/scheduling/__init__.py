"""`minillm bench scheduling`: which waiting request to admit, measured where memory binds, on
traffic the policies were not tuned on.

The claim (the memory system's central one): a scheduler that prices each request's KV cost
against its benefit, keeps headroom when memory is tight and prefers requests whose KV is already
cached serves more requests within their latency targets than first come first served.

The run, in order:
  1. SLOs, from an idle engine (no compared run): TTFT <= TTFT_TIMES x the tuning trace's longest
     prompt prefilled alone, TPOT <= TPOT_TIMES x a batch-1 decode step. Goodput, as DistServe
     defines it: the share of requests meeting both.
  2. Loads, on the tuning seed (0) only: fcfs at arrival rates falling, then growing, from half its
     capacity, and the rates where its goodput crosses 50%, 80% and 95%. Every trace's arrivals
     come at exactly the rate asked, on average (`trace.py`), so a rate is the same load on
     every seed.
  3. Every policy (fcfs, lpm, memory, memory+lpm: `engine/admission.py`) on every held-out seed
     at every load, the policies alternating within a seed so drift hits them alike; mean and
     spread over the seeds, preemptions and the tokens they recomputed (with the share of busy time
     that took, at the idle prefill's rate), greedy outputs compared with fcfs's (order changes,
     tokens must not).
  4. The rate each policy sustains at 90% goodput, interpolated between the loads.
  5. The scheduler's own cost: schedule() per step with 100 and 10,000 requests waiting
     (2,000 with --quick).

Every engine has the prefix cache on and the same small device pool; nothing is lossy.

The package, in the order a run reads it:
  trace.py   the seeded traffic: kinds, shares, Poisson arrivals, conversations
  replay.py  a trace through an engine on the wall clock
  run.py     the whole run: `bench_scheduling`
  report.py  the tables and what they mean: `print_scheduling_report`
"""

from minillm.benchmarks.scheduling.report import print_scheduling_report
from minillm.benchmarks.scheduling.run import SIZES, bench_scheduling

__all__ = ["SIZES", "bench_scheduling", "print_scheduling_report"]
