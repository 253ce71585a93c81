"""The hand-written kernels, as sources shipped with the package.

paged_attention.cu        CUDA decode: one thread block per (sequence, query head), walks the block table
flash_prefill.cu          CUDA flash prefill: every prefill chunk of a step in one ragged call, a
                          thread block per (sequence, tile of 32 query rows, KV head)
kv_rows_cuda.h            what the two CUDA kernels share: reading the pool's layer, the checks
paged_attention_cpu.cpp   decode's C++ twin for CPUs (OpenMP), built and tested everywhere
flash_prefill_cpu.cpp     flash prefill's C++ twin
kv_rows_cpu.h             what the two CPU kernels share: how the pool's layer is stored and read
kv_write_cpu.cpp          the quantized pool's write in one call per layer
dense_cpu.cpp             bf16 decode's dense work on a CPU: matrix products of 1-6 rows, RMSNorm,
                          RoPE (model.py calls them), and the read-roof probe the benchmarks use
bindings.cpp              both builds' Python bindings

Python never imports code from here: `minillm/attention/kernels.py` reads these files as
package data and compiles them on first use with torch's `cpp_extension.load`, so a plain
`pip install .` (not only an editable install) carries them along.
"""
