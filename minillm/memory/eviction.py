"""KV eviction: keep a budget of tokens per sequence and drop the others.

Quantization makes every token cheaper; eviction keeps fewer tokens. After each step, a sequence
whose cache holds more entries than its budget drops the ones it is least likely to need:

- `window`: only the most recent tokens (the naive baseline);
- `sinks`: the first NUM_SINKS tokens plus the most recent (StreamingLLM, Xiao et al. 2023):
  softmax must put its mass somewhere, and models learn to park it on the first tokens, so
  evicting them hurts far more than their content suggests;
- `h2o`: the "heavy hitters" — tokens with the largest attention accumulated so far — plus a
  recent window of half the budget (H2O, Zhang et al. 2023). Each KV head chooses for itself,
  from the attention its group of query heads paid (summed), in every layer; every head keeps the
  same number of entries, so each layer's cache stays a rectangle (entries, kv_heads, head_dim)
  even though different heads keep different tokens.

The budget is a number of tokens (an int) or a fraction (a float) of the sequence's full length,
prompt plus max_tokens (capped by the context): 0.2 caps the cache at a fifth of what it would
grow to, H2O's definition. Until the sequence reaches its budget nothing is evicted.

Positions after eviction: keys are stored after RoPE, so a kept key keeps the rotation of its
original position, and a new token is rotated by its true position (`Sequence.num_computed`), not
by its index in the shrunken cache. The distances the model sees stay true; only which keys exist
changes. Index and position part ways: `Sequence.num_cached` (entries in the cache, where the
next one is written) vs `num_computed` (tokens processed, the next position). StreamingLLM
instead re-numbers positions inside the cache, which lets a stream run past the trained context;
minillm stays within the context, where true positions are the faithful choice.

Eviction rewrites the sequence's kept entries into its first blocks, in order, and gives the rest
back. A block that another sequence shares (parallel samples, beams) is copied first, never
written in place.
"""

from __future__ import annotations

import math

import torch

from minillm.engine.sequence import Sequence
from minillm.memory.block_manager import BlockManager

NUM_SINKS = 4  # StreamingLLM keeps 4 initial tokens


def budget_for(kv_budget: int | float, max_len: int) -> int:
    """Entries a sequence of at most `max_len` tokens may keep: an int is a number of tokens, a
    float a fraction of max_len (at least one)."""
    if isinstance(kv_budget, float):
        return max(1, math.ceil(kv_budget * max_len - 1e-9))
    return kv_budget


def kept_entries(policy: str, length: int, keep: int, num_layers: int, num_kv_heads: int,
                 mass: torch.Tensor | None = None) -> torch.Tensor:
    """Which of `length` cache entries to keep: (num_layers, num_kv_heads, keep) indices, in
    increasing order. `mass` (num_layers, num_kv_heads, length) is H2O's accumulated attention."""
    shape = (num_layers, num_kv_heads, keep)
    if policy == "window" or keep < 2:
        return torch.arange(length - keep, length).expand(shape)
    if policy == "sinks":
        sinks = min(NUM_SINKS, keep - 1)
        kept = torch.cat([torch.arange(sinks), torch.arange(length - (keep - sinks), length)])
        return kept.expand(shape)
    if policy == "h2o":
        recent = keep // 2
        older = mass[..., :length - recent]  # (layers, kv_heads, candidates)
        heavy = older.topk(keep - recent, dim=-1).indices.sort(dim=-1).values
        window = torch.arange(length - recent, length, device=mass.device).expand(num_layers, num_kv_heads, recent)
        return torch.cat([heavy, window], dim=-1)
    raise ValueError(f"unknown eviction policy {policy!r}")


def grow_attention_mass(seq: Sequence, length: int, num_layers: int, num_kv_heads: int, device) -> torch.Tensor:
    """The sequence's H2O accumulator, extended with zeros to cover `length` entries."""
    mass = seq.attention_mass
    if mass is None:
        mass = torch.zeros(num_layers, num_kv_heads, 0, device=device)
    if mass.shape[-1] < length:
        mass = torch.cat([mass, mass.new_zeros(num_layers, num_kv_heads, length - mass.shape[-1])], dim=-1)
    seq.attention_mass = mass
    return mass


def evict(seq: Sequence, kept: torch.Tensor, cache, manager: BlockManager) -> bool:
    """Rewrite the sequence's cache to hold only the `kept` entries (layers, kv_heads, keep) and
    free the blocks left over. Returns False (try again next step) if a shared block must be
    copied and no block is free."""
    keep, length = kept.shape[-1], seq.num_cached
    if len(manager.shared_blocks(seq.seq_id, 0, keep)) > manager.num_free_blocks:
        return False
    device = kept.device
    old_slots = torch.tensor(manager.slots(seq.seq_id, 0, length), device=device)
    manager.copy_on_write(seq.seq_id, 0, keep)  # private blocks to write into; the data is rewritten below
    new_slots = torch.tensor(manager.slots(seq.seq_id, 0, keep), device=device)
    heads = torch.arange(kept.shape[1], device=device)
    for layer in range(kept.shape[0]):
        keys, values = cache.read(layer, old_slots)  # (length, kv_heads, head_dim), read before any write
        rows = kept[layer].T  # (keep, kv_heads): entry kept by each head, row by row
        cache.write(layer, new_slots, keys[rows, heads], values[rows, heads])
    if seq.attention_mass is not None:
        seq.attention_mass = seq.attention_mass.gather(-1, kept)
    manager.truncate(seq.seq_id, keep)
    seq.num_evicted += length - keep
    return True
