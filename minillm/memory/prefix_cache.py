"""Prefix caching: reuse the KV of a prompt's leading blocks computed for an earlier request.

Many requests start alike (a system prompt, a shared document). A *full* block's keys and values
depend only on the tokens up to its end, so a block can be found again by its content: the key
is a hash chain, hash(parent block's hash, this block's token ids), as in vLLM. A hit raises the
block's refcount instead of recomputing it.

A hash can collide, and wrong KV must never come back, so every entry also stores its block's
tokens and its parent *block*; a lookup accepts a block only if its tokens equal the prompt's and
its parent is the block accepted just before. By induction the whole prefix is then exactly the
prompt's. When a block is reused for other content (evicted), the entries of its descendants go
too, so a stale parent can never vouch for a child.

Freed blocks keep their entry while they wait in the free pool; the pool hands out the least
recently freed block first (LRU), and only then is its entry dropped — or, with a host tier, the
block spills there and its entry follows it (`move`), so a later hit copies it back instead of
recomputing it. A prompt that is entirely
cached still recomputes its last token, to get the logits the next token is sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

from minillm.memory.events import KVEvents, Registered, Uncached


@dataclass
class Entry:
    key: int  # hash(parent key, tokens)
    parent: int | None  # parent block id (None for a first block)
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, block_size: int, events: KVEvents | None = None):
        self.block_size = block_size
        self.events = events if events is not None else KVEvents()  # the block manager's, shared
        self.block_of: dict[int, int] = {}  # key -> block
        self.entries: dict[int, Entry] = {}  # block -> its entry
        self.children: dict[int, set[int]] = {}  # block -> cached blocks whose parent it is
        self.registered: dict[int, int] = {}  # seq_id -> how many of its leading blocks were offered
        self.queried_tokens = 0  # prompt tokens of every lookup
        self.queried_blocks = 0  # full blocks a lookup could have hit
        self.hit_blocks = 0

    def _block_tokens(self, token_ids: list[int], index: int) -> tuple[int, ...]:
        return tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of full blocks of `token_ids`, at most all
        but the last token (which must be computed for its logits)."""
        blocks: list[int] = []
        key = None
        for index in range((len(token_ids) - 1) // self.block_size):
            tokens = self._block_tokens(token_ids, index)
            key = hash((key, tokens))
            block = self.block_of.get(key)
            entry = self.entries.get(block)
            if entry is None or entry.tokens != tokens or entry.parent != (blocks[-1] if blocks else None):
                break  # a miss, or a hash collision caught
            blocks.append(block)
        return blocks

    def holds(self, block: int) -> bool:
        """Does the cache vouch for this block's content? (Then nobody may write it.)"""
        return block in self.entries

    def record_lookup(self, token_ids: list[int], hits: int) -> None:
        self.queried_tokens += len(token_ids)
        self.queried_blocks += (len(token_ids) - 1) // self.block_size
        self.hit_blocks += hits

    def register(self, seq_id: int, table: list[int], token_ids: list[int], num_computed: int) -> None:
        """Offer the sequence's newly full and computed blocks to the cache."""
        done = self.registered.get(seq_id, 0)
        for index in range(done, num_computed // self.block_size):
            block = table[index]
            parent = table[index - 1] if index else None
            parent_entry = self.entries.get(parent) if parent is not None else None
            if index and parent_entry is None:
                break  # the parent is not cached (e.g. a duplicate), so neither can the child be
            if block not in self.entries:
                key = hash((parent_entry.key if parent_entry else None, self._block_tokens(token_ids, index)))
                if key in self.block_of:
                    break  # the same content is cached in another block already
                self.block_of[key] = block
                self.entries[block] = Entry(key, parent, self._block_tokens(token_ids, index))
                if parent is not None:
                    self.children.setdefault(parent, set()).add(block)
                if self.events:
                    parent_key = parent_entry.key if parent_entry else None
                    self.events.emit(Registered(block, key, parent_key, self.entries[block].tokens))
            self.registered[seq_id] = index + 1

    def truncate(self, seq_id: int, num_blocks: int) -> None:
        """The sequence was cut back to `num_blocks` full blocks: blocks after them are offered
        again once they are full of their new content."""
        if self.registered.get(seq_id, 0) > num_blocks:
            self.registered[seq_id] = num_blocks

    def forget_sequence(self, seq_id: int) -> None:
        self.registered.pop(seq_id, None)

    def evict(self, block: int) -> None:
        """The block is about to hold other content: drop its entry and its descendants'."""
        entry = self.entries.pop(block, None)
        if entry is None:
            return
        del self.block_of[entry.key]
        if self.events:
            self.events.emit(Uncached(block, entry.key))
        if entry.parent is not None:
            self.children.get(entry.parent, set()).discard(block)
        for child in self.children.pop(block, set()):
            self.evict(child)

    def move(self, block: int, new_block: int) -> None:
        """The cached content of `block` now lives in `new_block` (spilled to the host tier, or
        brought back): the entry, its key and its place in the chain follow it."""
        entry = self.entries.pop(block)
        self.entries[new_block] = entry
        self.block_of[entry.key] = new_block
        if entry.parent is not None:
            siblings = self.children[entry.parent]
            siblings.discard(block)
            siblings.add(new_block)
        children = self.children.pop(block, set())
        for child in children:
            self.entries[child].parent = new_block
        if children:
            self.children[new_block] = children

    def described(self) -> tuple[tuple[int, int, int | None, tuple[int, ...]], ...]:
        """(block, key, parent key, tokens) of every entry, each parent before its children."""
        order: dict[int, None] = {}

        def visit(block: int) -> None:
            parent = self.entries[block].parent
            if parent is not None and parent not in order:
                visit(parent)
            order[block] = None

        for block in self.entries:
            if block not in order:
                visit(block)
        return tuple(
            (block, self.entries[block].key, self._parent_key(block), self.entries[block].tokens)
            for block in order
        )

    def _parent_key(self, block: int) -> int | None:
        parent = self.entries[block].parent
        return None if parent is None else self.entries[parent].key

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0

    def stats(self) -> dict:
        hit_tokens = self.hit_blocks * self.block_size  # prefill tokens not computed
        return {
            "queried_blocks": self.queried_blocks,
            "hit_blocks": self.hit_blocks,
            "block_hit_rate": self.hit_rate,
            "prompt_tokens": self.queried_tokens,
            "prefill_tokens_saved": hit_tokens,
            "token_hit_rate": hit_tokens / self.queried_tokens if self.queried_tokens else 0.0,
            "cached_blocks": len(self.entries),
        }
