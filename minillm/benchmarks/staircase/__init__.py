"""`minillm bench staircase`: the classic serving staircase at this machine's scale, one step at
a time on one KV byte budget that binds, one trace per seed: HF transformers -> paged KV +
continuous batching -> + int8 KV in the same bytes -> + flash prefill.

The seeds' claim: from the same KV bytes, paging fits more sequences at once than a static batch
sized for the worst case, int8 fits ~1.7x (bf16; ~3.5x fp32) the tokens again, and flash
prefill computes the same attention without a score matrix; each step says what it bought, here, measured now.

The payoff is a claim about serving *under a KV budget*: many requests, decode-heavy, a pool that
holds far fewer worst cases than the traffic needs. So the trace (`workload.uniform_trace`, one per
seed) is chat-like: 20 requests all arriving at t=0, prompts U[64, 384] tokens cut from real
prose, answers U[64, 320] tokens decoded greedily to exactly that length (EOS ignored), so every
row does the same work. --quick: 12 requests, prompts U[64, 256], answers U[64, 160], one seed.
The sizes and the budget were chosen on seed 0 and the table reports seeds 1 2 3 (--seeds): each
number is the median over the seeds, min-max beside it, and each "x before" a seed's ratio
between rows run side by side. In the machine's fastest precision (--dtype auto), on 2 threads.

The budget: --kv-tokens tokens of KV in the model's dtype (default: 3 x (the longest prompt + the
longest output) the ranges allow, what a static server configured for them must size for),
given to every row in bytes. Rows, each a fresh engine, same dtype:
  (1) HF transformers, its own cache: `generate` on static left-padded batches. Its cache holds
      batch x (padded prompt + generated) tokens and a static server cannot know in advance which
      requests share a batch, so it sizes the batch for the worst one:
      batch = budget // ((longest prompt + longest output) x KV bytes per token): 3 by default;
  (2) minillm paged + continuous: the budget cut into 16-token blocks, iteration-level scheduling
      with memory-aware admission (headroom for the batch's peak, so it rarely preempts),
      preemption by recompute, the kernel backend's decode attention ("cpu": C++), prefill
      attention through the torch reference (`flash_prefill=False`);
  (3) + int8 KV: the same bytes, ~1.7x the blocks in bf16 (~3.5x in fp32);
  (4) + flash prefill: prefill chunks through the kernel backend's flash kernel.
Greedy identical: (2) against (1) and (4) against (3) are lossless steps, but a different order
of floating-point sums may flip a near-tie (in bf16, often: compare them with --dtype float32), so
the requests with identical tokens are counted, never asserted; (3) against (2) is lossy and
reported as such. Between (3) and (4) the flips are likelier than between fp32 rows: the
prompt's KV, computed through a different prefill kernel, differs in its last bits, and an entry
that sits near an int8 rounding boundary then rounds the other way (2026-12-01, the old trace: 2
of 3 requests differed, each first at a token whose two best exact-model logits were 0.003 and
0.04 apart). In fp32 (--quick, seed 1, 2026-12-04) both lossless steps gave 12 of 12.

Then prefill attention alone: one layer, a 512-query chunk at the end of a 4096-entry context,
the torch reference against the C++ flash kernel, fp32 and int8 pools, best of N. Last, a few
sentences computed from the numbers: which step paid (moved tok/s or TTFT p50 by more than
NOISE), which did not.

The package, in the order a run reads it:
  rows.py     the budget, the four rows, their comparisons and medians: `run_rows`, `summarize`
  prefill.py  prefill attention alone: `prefill_attention`
  bench.py    the whole run: `bench_staircase`, `SIZES`
  tables.py   what it means and the tables: `print_staircase_report`
"""

from minillm.benchmarks.staircase.bench import SIZES, bench_staircase
from minillm.benchmarks.staircase.tables import print_staircase_report

__all__ = ["SIZES", "bench_staircase", "print_staircase_report"]
