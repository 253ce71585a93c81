"""The memory system: where every token's keys and values live, and what that costs.

block_manager.py  paged blocks, block tables, reference counts (PagedAttention)
contiguous.py     the "traditional" baseline: one max-length reservation per request
accounting.py     one place that answers: reserved, live, utilization, fragmentation
"""
