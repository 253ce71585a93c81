"""`minillm bench all`: every benchmark in one command, so every number the docs claim can be
reproduced by running one thing.

It runs each benchmark's own function (`bench_decode`, `bench_serve`, ... and `eval_ppl` for a
few KV formats) at a size a small CPU finishes in minutes, one after another (--quick: 306 s on
the 2-core development VM while other jobs shared it, 2026-12-01; without it, larger sizes);
a benchmark that fails is recorded as failed and the others still run. Into the output folder
(`bench_results/` by default) it writes:

  results.json   the machine (CPU model, torch version and threads), the date, and per benchmark
                 its size, seconds, status, headline numbers and its whole report;
  results.md     one markdown table of the headline numbers, exactly as results.json has them
                 (rounded to 3 significant digits), with the date and the machine above it;
  NAME.png       one bar chart per benchmark that ran.

Smaller sizes than a benchmark's own defaults measure the same things with more noise; each
row of the table names its benchmark, and `minillm bench NAME` measures it at full size.

The package, in the order a run reads it:
  suite.py      the benchmarks, how each is called, and their sizes: `BENCHMARKS`, `SIZES`
  headlines.py  each report's headline numbers and bar chart
  bench.py      every benchmark in turn, the files written: `bench_all`
  results.py    the markdown table, the plots, the printed table: `print_results`
"""

from minillm.benchmarks.all.bench import bench_all
from minillm.benchmarks.all.results import print_results
from minillm.benchmarks.all.suite import BENCHMARKS, SIZES, Benchmark

__all__ = ["BENCHMARKS", "SIZES", "Benchmark", "bench_all", "print_results"]
