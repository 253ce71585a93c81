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

Not every cached block is worth a host copy when it leaves the device: most are read once (a
document, an answer). A block is *reused* once a lookup hit it, once it was computed again after
its entry was dropped (the cache remembers the last DROPPED_KEYS keys it let go, the "ghost" list
of the 2Q and ARC caches, so a block asked for a second time is known when it comes back), or when
it extends a reused block (the rest of a request on a shared system prompt, a conversation's next
turn). With `spill="reused"` only reused blocks spill (`tier_moves.py`). A hash collision among
remembered keys can only mark a block reused wrongly, a question of what to copy, never of what is
read.

A cache that silently stops hitting is the classic failure (a timestamp in the system prompt
makes every prefix different), so every lookup also says why it ended where it did
(`PrefixMiss`): where the prompt first differs from the best cached chain (the cached blocks
that follow the last hit), or, when the chain simply ends, from the closest of the last few
prompts — then blocks they shared have left the cache (reused for other content), or were not
computed yet.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from minillm.memory.events import KVEvents, Registered, Uncached


@dataclass
class Entry:
    key: int  # hash(parent key, tokens)
    parent: int | None  # parent block id (None for a first block)
    tokens: tuple[int, ...]
    reused: bool = False  # a lookup hit it, it was computed again after a drop, or its parent is reused


DROPPED_KEYS = 4096  # keys of dropped entries remembered, to know a block computed a second time
RECENT_PROMPTS = 16  # prompts kept to explain a miss where the cached chain ends
RECENT_TOKENS = 4096  # ...each up to this many tokens
SHOWN_TOKENS = 8  # tokens of each side kept from where they differ


@dataclass(frozen=True)
class PrefixMiss:
    """Why a prompt's prefix-cache hit ended where it did. `cause`:
        "hit"       every full block a hit can cover (all but the last token's) was cached
        "diverged"  the prompt differs at token `diverged_at` from a cached or a recent prompt;
                    the block holding that token, and every later one, must be computed
        "evicted"   a recent prompt shared more full blocks than the cache still holds (they
                    were reused for other content, or not computed yet)
        "new"       no cached block and no recent prompt begins like it
    `ours` / `theirs`: a few token ids of the prompt and of the other from `diverged_at` on
    (`theirs` is empty where the other prompt ended)."""

    cause: str
    prompt_tokens: int
    cacheable_tokens: int
    cached_tokens: int
    diverged_at: int | None = None
    ours: tuple[int, ...] = ()
    theirs: tuple[int, ...] = ()

    @property
    def recomputed_tokens(self) -> int:
        """Prompt tokens in full blocks that were computed although a hit could have covered them."""
        return self.cacheable_tokens - self.cached_tokens


def common_length(a, b) -> int:
    """How many leading items two sequences share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[:middle] == b[:middle] else (low, middle)
    return low


class PrefixCache:
    def __init__(self, block_size: int, events: KVEvents | None = None):
        self.block_size = block_size
        self.events = events if events is not None else KVEvents()  # the block manager's, shared
        self.block_of: dict[int, int] = {}  # key -> block
        self.entries: dict[int, Entry] = {}  # block -> its entry
        self.children: dict[int | None, set[int]] = {}  # block -> cached blocks whose parent it is
        #   (None -> the first blocks of chains)
        self.registered: dict[int, int] = {}  # seq_id -> how many of its leading blocks were offered
        self.recent: deque[tuple[int, ...]] = deque(maxlen=RECENT_PROMPTS)  # the last prompts looked up
        self._dropped: OrderedDict[int, None] = OrderedDict()  # keys of the last DROPPED_KEYS entries dropped
        self.misses: dict[str, int] = {}  # cause -> lookups (`PrefixMiss.cause`)
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

    def is_reused(self, block: int) -> bool:
        """Was this cached block read again (or computed again after a drop, or its parent reused)?"""
        return self.entries[block].reused

    def holds(self, block: int) -> bool:
        """Does the cache vouch for this block's content? (Then nobody may write it.)"""
        return block in self.entries

    def record_lookup(self, token_ids: list[int], hits: list[int]) -> PrefixMiss:
        """Count a lookup whose hit is `hits` (`lookup`'s blocks), and say why it ended there."""
        self.queried_tokens += len(token_ids)
        self.queried_blocks += (len(token_ids) - 1) // self.block_size
        self.hit_blocks += len(hits)
        for block in hits:
            self.entries[block].reused = True
        miss = self.explain(token_ids, hits)
        self.misses[miss.cause] = self.misses.get(miss.cause, 0) + 1
        self.recent.append(tuple(token_ids[:RECENT_TOKENS]))
        return miss

    def explain(self, token_ids: list[int], hits: list[int]) -> PrefixMiss:
        """Where `token_ids` parts from the best cached chain past its hit `hits`, or else from
        the closest recent prompt (see `PrefixMiss`)."""
        size, prompt = self.block_size, tuple(token_ids)
        cacheable, cached = (len(prompt) - 1) // size * size, len(hits) * size
        counts = (len(prompt), cacheable, cached)
        if cached == cacheable:
            return PrefixMiss("hit", *counts)
        following = self.children.get(hits[-1] if hits else None, ())
        block_tokens = prompt[cached : cached + size]
        best = max(following, key=lambda b: common_length(self.entries[b].tokens, block_tokens), default=None)
        shared = cached + (common_length(self.entries[best].tokens, block_tokens) if best is not None else 0)
        if best is not None and (hits or shared):  # the cached chain goes on, with other tokens
            theirs = self.entries[best].tokens[shared - cached :]
            return self._parted("diverged", counts, prompt, shared, theirs)
        shared, other = max(((common_length(p, prompt), p) for p in self.recent), default=(0, ()))
        theirs = other[shared : shared + SHOWN_TOKENS]
        if shared // size * size > cached:
            return self._parted("evicted", counts, prompt, shared, theirs)
        if shared > cached and shared < cacheable:
            return self._parted("diverged", counts, prompt, shared, theirs)
        return PrefixMiss("new", *counts)

    @staticmethod
    def _parted(cause: str, counts: tuple, prompt: tuple[int, ...], shared: int, theirs) -> PrefixMiss:
        ours = prompt[shared : shared + SHOWN_TOKENS]
        return PrefixMiss(cause, *counts, shared, ours, tuple(theirs[:SHOWN_TOKENS]))

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
                # computed again after it was dropped, or extending a prefix that was read again
                reused = key in self._dropped or (parent_entry is not None and parent_entry.reused)
                self._dropped.pop(key, None)
                self.entries[block] = Entry(key, parent, self._block_tokens(token_ids, index), reused)
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
        self._dropped[entry.key] = None
        self._dropped.move_to_end(entry.key)
        if len(self._dropped) > DROPPED_KEYS:
            self._dropped.popitem(last=False)
        if self.events:
            self.events.emit(Uncached(block, entry.key))
        self.children.get(entry.parent, set()).discard(block)
        for child in self.children.pop(block, set()):
            self.evict(child)

    def move(self, block: int, new_block: int) -> None:
        """The cached content of `block` now lives in `new_block` (spilled to the host tier, or
        brought back): the entry, its key and its place in the chain follow it."""
        entry = self.entries.pop(block)
        self.entries[new_block] = entry
        self.block_of[entry.key] = new_block
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
            "lookups": dict(self.misses),  # cause -> lookups (`PrefixMiss`: hit, diverged, evicted, new)
        }
