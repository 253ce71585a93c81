"""`minillm bench staircase`: the classic serving staircase at this machine's scale, one step at a
time on one trace and one KV byte budget: HF transformers -> paged KV + continuous batching ->
+ int8 KV in the same bytes -> + flash prefill.

The seeds' claim: from the same KV bytes, paging fits more sequences at once than a static batch
sized for the worst case, int8 fits ~3.5x the tokens again, and flash prefill computes the same
attention without a score matrix; each step says what it bought, here, measured now.

The trace (seeded, `serve.make_trace`): N requests (default 3) all arriving at t=0, prompts
U[1024, 4096] tokens cut from real prose, outputs U[128, 256] tokens decoded greedily to exactly
that length (EOS ignored), so every row does the same work. --quick: 3 requests, prompts
U[512, 1024], outputs U[32, 64]. On a CPU that is few requests: prefill is compute-bound, ~200
tokens/s on one thread of the 2-core development VM, so 7k prompt tokens take most of a minute a
row, and more when row (2) runs short of blocks and recomputes (2026-12-01: 110 preemptions on a
4-request trace). One torch thread by default (as `bench memory`): on a CPU shared with other work more
threads wait for each other.

The budget: --kv-tokens tokens of KV in the model's dtype (default: twice the trace's worst case,
longest prompt + longest output), given to every row in bytes. Rows, each a fresh engine, same
dtype:
  (1) HF transformers, its own cache: `generate` on static left-padded batches. Its cache holds
      batch x (padded prompt + generated) tokens and a static server cannot know in advance which
      requests share a batch, so it sizes the batch for the worst one:
      batch = budget // ((longest prompt + longest output) x KV bytes per token);
  (2) minillm paged + continuous: the budget cut into 16-token blocks, iteration-level scheduling
      (first come first served, preemption by recompute), the kernel backend's decode attention
      ("cpu": C++), prefill attention through the torch reference (`flash_prefill=False`);
  (3) + int8 KV: the same bytes, ~3.5x the blocks;
  (4) + flash prefill: prefill chunks through the kernel backend's flash kernel.
Greedy identical: (2) against (1) and (4) against (3) are lossless steps, but a different order
of floating-point sums may flip a near-tie, so the fraction of requests with identical tokens is
reported, never asserted; (3) against (2) is lossy and reported as such. Between (3) and (4) the
flips are likelier than between fp32 rows: the prompt's KV, computed through a different prefill
kernel, differs in its last bits, and an entry that sits near an int8 rounding boundary then
rounds the other way (2026-12-01, default trace: 2 of 3 requests differed, each first at a token
whose two best exact-model logits were 0.003 and 0.04 apart).

Then prefill attention alone: one layer, a 512-query chunk at the end of a 4096-entry context,
the torch reference against the C++ flash kernel, fp32 and int8 pools, best of N. Last, a few
sentences computed from the numbers: which step paid (moved tok/s or TTFT p50 by more than
NOISE), which did not.

The package, in the order a run reads it:
  rows.py     the trace, the budget, the four rows and their comparisons: `run_rows`
  prefill.py  prefill attention alone: `prefill_attention`
  run.py      the whole run: `bench_staircase`, `SIZES`
  report.py   what it means and the tables: `print_staircase_report`
"""

from minillm.benchmarks.staircase.report import print_staircase_report
from minillm.benchmarks.staircase.run import SIZES, bench_staircase

__all__ = ["SIZES", "bench_staircase", "print_staircase_report"]
