"""Attention over the paged KV pool, and the backends that compute it.

reference.py  plain torch: causal GQA for prefill and paged decode attention; the readable truth
              every faster path is checked against
paged.py      PagedAttention, the AttentionContext the model is handed: the pool, the block tables,
              the slots this step writes
kernels.py    the backends: auto | torch | cpu (C++) | cuda, built at first use and cached
"""
