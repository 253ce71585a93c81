"""Which engine holds which prefix blocks: a radix tree over block chains, built from KV events.

A KV-aware router (Dynamo, llm-d) sends a prompt where its leading blocks are already cached. Each
engine tells what it caches through its KV events (`serve/kv_events.py`): `BlockStored` (a block's
hash, its parent's hash, its token ids), `BlockRemoved`, `AllBlocksCleared`. The hashes are the
engine's own (Python's `hash`, salted per process), so two engines name the same content
differently and the index cannot key by them. It keys by *content* instead: a node is (its parent
node, the block's token ids), so a chain of blocks is a path from the root, and the same prefix
cached by two engines is one path that both engines hold. Per engine a map from its hash to the
node lets a later `BlockRemoved`, which names only the hash, find what to take off.

    index.apply(engine, events)       one message's events, in order
    index.overlap(token_ids)          {engine: leading full blocks of token_ids it holds}
    index.drop(engine)                forget everything an engine held
    index.blocks_held(engine), index.blocks_shared(engine)   how many, and how many another holds too

A block cached on any tier (device or host) counts: the engine brings it back instead of
recomputing it. All engines are expected to use one block size, the first one an event names;
a block of another size is not indexed.
"""

from __future__ import annotations

from collections import Counter


class Node:
    """One block of a chain: its tokens, the blocks that follow it, and which engines hold it."""

    def __init__(self, parent: Node | None, tokens: tuple[int, ...]):
        self.parent, self.tokens = parent, tokens
        self.children: dict[tuple[int, ...], Node] = {}
        self.holders: set[str] = set()


class BlockIndex:
    def __init__(self):
        self.root = Node(None, ())
        self.block_size: int | None = None  # learned from the first BlockStored
        self.held: dict[str, dict[int, Node]] = {}  # engine -> its hash of a block -> the block's node
        self.media: dict[str, dict[int, set[str]]] = {}  # engine -> its hash -> the tiers holding it

    def apply(self, engine: str, events: list[dict]) -> None:
        """Apply one message's vLLM-shaped events from `engine`, in order."""
        for event in events:
            kind = event.get("type")
            if kind == "AllBlocksCleared":
                self.drop(engine)
            elif kind == "BlockStored":
                self._stored(engine, event)
            elif kind == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    self._removed(engine, block_hash, event.get("medium"))

    def overlap(self, token_ids: list[int]) -> dict[str, int]:
        """How many leading full blocks of `token_ids` each engine holds (engines holding none left out)."""
        if self.block_size is None:
            return {}
        counts: Counter[str] = Counter()
        node, size = self.root, self.block_size
        holding = None  # the engines that held every block so far
        for start in range(0, len(token_ids) - size + 1, size):
            node = node.children.get(tuple(token_ids[start : start + size]))
            if node is None:
                break
            holding = set(node.holders) if holding is None else holding & node.holders
            if not holding:
                break
            counts.update(holding)
        return dict(counts)

    def drop(self, engine: str) -> None:
        """Forget every block `engine` held (it restarted, cleared its cache, or is gone)."""
        self.media.pop(engine, None)
        for node in self.held.pop(engine, {}).values():
            self._release(node, engine)

    def blocks_held(self, engine: str) -> int:
        return len(self.held.get(engine, {}))

    def blocks_shared(self, engine: str) -> int:
        """Blocks `engine` holds that another engine holds too: the same KV kept twice."""
        return sum(len(node.holders) > 1 for node in set(self.held.get(engine, {}).values()))

    def _stored(self, engine: str, event: dict) -> None:
        """vLLM may store several chained blocks in one event: their tokens, block after block."""
        size = event["block_size"]
        if self.block_size is None:
            self.block_size = size
        if size != self.block_size:
            return
        held, media = self.held.setdefault(engine, {}), self.media.setdefault(engine, {})
        parent_hash = event.get("parent_block_hash")
        parent = self.root if parent_hash is None else held.get(parent_hash)
        if parent is None:  # a parent this engine never told of: the chain cannot be placed
            return
        token_ids = event["token_ids"]
        for i, block_hash in enumerate(event["block_hashes"]):
            tokens = tuple(token_ids[i * size : (i + 1) * size])
            node = held.get(block_hash) or parent.children.get(tokens)
            if node is None:
                node = parent.children[tokens] = Node(parent, tokens)
            held[block_hash] = node
            node.holders.add(engine)
            media.setdefault(block_hash, set()).add(event.get("medium"))
            parent = node

    def _removed(self, engine: str, block_hash: int, medium: str | None) -> None:
        """A block leaves one tier; the engine holds it until it has left every tier (a spill to
        host is a BlockRemoved on the device and a BlockStored on the host)."""
        tiers = self.media.get(engine, {}).get(block_hash)
        if tiers is None:
            return
        tiers.discard(medium)
        if not tiers:
            del self.media[engine][block_hash]
            self._release(self.held[engine].pop(block_hash), engine)

    def _release(self, node: Node, engine: str) -> None:
        """The engine holds the node no more; a node nobody holds and nothing follows is cut off,
        and so on upward."""
        node.holders.discard(engine)
        while node is not self.root and not node.holders and not node.children:
            del node.parent.children[node.tokens]
            node = node.parent
