"""BlockManager invariants under random operation sequences (hypothesis), and its contract."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.memory.accounting import arena_stats, block_states, paged_stats
from minillm.memory.arena import ContiguousArena
from minillm.memory.block_manager import BlockManager, BlockManagerError

operations = st.lists(
    st.tuples(st.sampled_from(["grow", "append", "fork", "free"]), st.integers(0, 9), st.integers(1, 40)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 8), ops=operations)
def test_invariants_hold_under_random_operations(num_blocks, block_size, ops):
    manager = BlockManager(num_blocks, block_size)
    lengths: dict[int, int] = {}  # seq_id -> tokens it holds
    for op, seq_id, amount in ops:
        if op == "grow" and seq_id not in lengths and manager.can_grow(seq_id, amount):
            manager.grow(seq_id, amount)
            lengths[seq_id] = amount
        elif op == "append" and seq_id in lengths and manager.can_grow(seq_id, lengths[seq_id] + 1):
            manager.grow(seq_id, lengths[seq_id] + 1)
            lengths[seq_id] += 1
        elif op == "fork" and seq_id in lengths:
            child = 100 + len(lengths) + amount
            if child not in lengths:
                manager.fork(seq_id, child)
                lengths[child] = lengths[seq_id]
        elif op == "free" and seq_id in lengths:
            manager.free(seq_id)
            del lengths[seq_id]
        manager.check_invariants()
        for sid, n in lengths.items():
            assert len(manager.table(sid)) == manager.blocks_for(n)
    for sid in list(lengths):
        manager.free(sid)
    manager.check_invariants()
    assert manager.num_free_blocks == num_blocks  # nothing leaks


def test_freeing_twice_is_an_error_not_silent():
    manager = BlockManager(4, 2)
    manager.grow(1, 3)
    manager.free(1)
    with pytest.raises(BlockManagerError, match="freed twice"):
        manager.free(1)


def test_growing_past_the_free_pool_is_refused():
    manager = BlockManager(2, 4)
    assert not manager.can_grow(7, 9)
    with pytest.raises(BlockManagerError, match="needs 3 blocks"):
        manager.grow(7, 9)


def test_slots_follow_the_block_table():
    manager = BlockManager(8, 4)
    manager.grow(1, 2)  # takes block 0
    manager.grow(2, 5)  # takes blocks 1, 2
    manager.grow(1, 6)  # block 3 joins sequence 1
    assert manager.table(1) == [0, 3]
    assert manager.slots(1, 0, 6) == [0, 1, 2, 3, 12, 13]
    assert manager.slots(2, 3, 5) == [7, 8]


def test_forked_blocks_are_freed_only_by_the_last_holder():
    manager = BlockManager(4, 4)
    manager.grow(1, 8)
    manager.fork(1, 2)
    manager.free(1)
    assert manager.num_free_blocks == 2
    manager.free(2)
    assert manager.num_free_blocks == 4


def test_block_states_name_what_each_block_holds():
    manager = BlockManager(6, 2, prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    manager.grow(1, 5)  # blocks 0, 1, 2; the first two full
    manager.prefix_cache.register(1, manager.table(1), tokens, 5)
    manager.fork(1, 2)
    manager.grow(3, 2)
    states = block_states(manager)["device"]
    assert [states[b] for b in manager.table(1)] == ["shared"] * 3
    assert states[manager.table(3)[0]] == "private"
    manager.free(1)
    manager.free(2)  # the registered blocks stay findable; the third was never full
    assert sorted(block_states(manager)["device"]) == [
        "cached",
        "cached",
        "free",
        "free",
        "free",
        "private",
    ]


def test_contiguous_arena_refuses_a_request_that_total_free_memory_would_fit():
    arena = ContiguousArena(100)
    for seq_id in range(4):
        arena.allocate(seq_id, 25)
    arena.free(0)
    arena.free(2)  # 50 slots free, in two holes of 25
    assert arena.num_free_slots == 50 and not arena.can_allocate(30)
    with pytest.raises(MemoryError, match="50 free in total, largest hole 25"):
        arena.allocate(9, 30)
    stats = arena_stats(arena, {1: 10, 3: 20}, bytes_per_slot=2)
    assert stats.external_fragmentation_slots == 25 and stats.utilization == pytest.approx(30 / 50)


def test_paged_accounting_counts_whole_blocks():
    manager = BlockManager(10, 4)
    manager.grow(1, 5)  # 2 blocks for 5 tokens
    stats = paged_stats(manager, {1: 5}, bytes_per_slot=3)
    assert stats.reserved_slots == 8 and stats.live_slots == 5 and stats.internal_fragmentation_slots == 3
    assert stats.as_dict()["reserved_bytes"] == 24 and stats.external_fragmentation_slots == 0
