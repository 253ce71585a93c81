"""The hand-written paged-attention decode kernels, as sources shipped with the package.

paged_attention.cu        CUDA: one thread block per (sequence, query head), walks the block table
paged_attention_cpu.cpp   its C++ twin for CPUs (OpenMP), built and tested everywhere

Python never imports code from here: `minillm/attention/kernels.py` reads these files as
package data and compiles them on first use with torch's `load_inline`, so a plain
`pip install .` (not only an editable install) carries them along.
"""
