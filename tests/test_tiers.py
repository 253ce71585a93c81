"""Tiers: swapped-out KV comes back bit for bit. With a device pool so small that sequences are
swapped out at almost every step, every switch still reproduces naive decoding (lossless ones)
or the same engine without swapping (quantized ones); random operation sequences keep every
tier's books true; lost block files are recomputed, never read wrong; `auto` follows the costs."""

import errno
import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REAL_CHAT_QUESTIONS, cached_blocks, free_and_intact, naive, random_prompts
from hypothesis import example, given, settings
from hypothesis import strategies as st
from references import replay_quantized, run_recorded

from minillm.cli import main
from minillm.config import ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.engine.beam import reference_beam_search
from minillm.memory.block_manager import BlockManager
from minillm.memory.pool import make_pool
from minillm.memory.quantization import FORMATS
from minillm.memory.tiers import DiskTier, SwapCost, TieredKV

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
BLOCK = 4


def tight(tiny_dir, tiny_model, blocks=14, **switches):
    """An engine whose device pool holds `blocks` blocks: running sequences crowd each other out."""
    probe = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        **{k: v for k, v in switches.items() if k in ("kv_dtype", "kv_key_scales")},
    )
    per_block = probe.engine.kv_cache.pool().bytes_per_slot * BLOCK
    switches = {"host_cache_bytes": 400 * per_block, "preemption": "swap", **switches}
    return LLM(tiny_dir, model=tiny_model, block_size=BLOCK, kv_cache_bytes=blocks * per_block, **switches)


def assert_swapped_and_drained(llm):
    snapshot = llm.engine.snapshot()
    counters = snapshot.counters
    assert counters["swapped_out"] > 0 and counters["swapped_in"] > 0
    assert counters["recomputed_tokens"] == 0  # swap preemption throws no work away
    assert free_and_intact(llm.engine)
    assert not snapshot.stats.host_reserved_slots and not snapshot.stats.disk_reserved_slots


@pytest.mark.parametrize(
    "switches", [{}, {"max_num_batched_tokens": 7}, {"prefix_caching": True}, {"attention_backend": "cpu"}]
)
def test_greedy_with_swaps_equals_naive(tiny_dir, tiny_model, switches):
    prompts = random_prompts(16, seed=3, longest=22)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, **switches)
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert_swapped_and_drained(llm)


def test_disk_as_the_only_tier_equals_naive(tiny_dir, tiny_model, tmp_path):
    prompts = random_prompts(10, seed=4, longest=22)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, host_cache_bytes=0, disk_cache_dir=str(tmp_path))
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert llm.engine.snapshot().stats.bytes_moved["device->disk"] > 0
    assert_swapped_and_drained(llm)


def test_a_full_host_pool_overflows_to_disk(tiny_dir, tiny_model, tmp_path):
    prompts = random_prompts(12, seed=5, longest=22)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    per_block = KV_BYTES_PER_TOKEN * BLOCK
    llm = tight(tiny_dir, tiny_model, host_cache_bytes=3 * per_block, disk_cache_dir=str(tmp_path))
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    moved = llm.engine.snapshot().stats.bytes_moved
    assert moved["device->host"] > 0 and moved["device->disk"] > 0
    assert_swapped_and_drained(llm)


@pytest.mark.parametrize(
    "kv_dtype, key_scales", [("auto", "channel"), ("int8", "channel"), ("int4", "channel"), ("fp8", "token")]
)
def test_a_block_comes_back_from_host_and_disk_bit_for_bit(tiny_model, tmp_path, kv_dtype, key_scales):
    """Numbers, scales, centres and the staged keys of a half-filled block: every stored tensor
    of a block sent device -> host -> disk -> device equals the original, bit for bit."""
    config, block = tiny_model.config, 4
    device_pool, host_pool = (
        make_pool(config, 8 * block * KV_BYTES_PER_TOKEN, block, kv_dtype, key_scales, torch.float32, "cpu")
        for _ in range(2)
    )
    tiers = TieredKV(device_pool, host_pool, DiskTier(tmp_path))
    for layer in range(config.num_layers):  # block 0 full, block 1 half filled
        k, v = torch.randn(2, 6, config.num_kv_heads, config.head_dim) * 3
        device_pool.write(layer, torch.arange(6), k, v)
    host, disk = tiers.first_host + 2, tiers.first_disk + 5
    for original in (0, 1):
        tiers.copy([(original, host), (host, disk), (disk, 3)])
        before, after = device_pool.read_block(original), device_pool.read_block(3)
        assert before.keys() == after.keys()
        assert all(torch.equal(before[name], after[name]) for name in before)
    assert any(name.startswith("k_staging") for name in device_pool.read_block(1)) == (
        kv_dtype != "auto" and key_scales == "channel"
    )


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype, key_scales", [("int8", "channel"), ("int4", "channel"), ("fp8", "token")])
def test_quantized_engine_with_swaps_equals_the_quantized_reference(
    tiny_dir, tiny_model, kv_dtype, key_scales
):
    """Swapping changes the schedule (which chunk computes which tokens), and a quantized cache's
    numbers depend on it (a block still filling is read exact), so the reference replays the
    schedule the engine ran through a cache rounded as the format rounds. Prefill chunks of 7
    tokens leave victims with half-filled blocks whose keys are staged in full precision."""
    prompts = random_prompts(10, seed=6, longest=22)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, kv_dtype=kv_dtype, kv_key_scales=key_scales, max_num_batched_tokens=7)
    recorder, requests = run_recorded(llm, prompts, params)
    errors, rounding = [], []  # per token: |engine - reference|, |reference - unrounded reference|
    for (seq,) in requests:
        history = recorder.history(seq)
        replayed = replay_quantized(tiny_model, seq.token_ids, history, FORMATS[kv_dtype], key_scales, BLOCK)
        unrounded = replay_quantized(tiny_model, seq.token_ids, history, None, key_scales, BLOCK)
        assert [int(logits.argmax()) for logits in replayed.logits] == seq.output_ids
        errors += [float((ours - ref).abs().max()) for ours, ref in zip(seq.sampler.logits, replayed.logits)]
        rounding += [
            float((ref - exact).abs().max()) for ref, exact in zip(replayed.logits, unrounded.logits)
        ]
    # Float noise (the engine batches a chunk with other sequences) may tip a number across a
    # rounding step now and then, and every later token of that sequence then carries the small
    # difference; a block brought back wrong (a lost scale, staged keys dropped) moves logits as
    # much as rounding itself does.
    assert max(errors) <= 0.05 * max(rounding)
    assert_swapped_and_drained(llm)


def test_parallel_samples_swap_as_one_and_equal_the_unswapped_engine(tiny_dir, tiny_model):
    prompts = random_prompts(6, seed=7, longest=22)
    params = SamplingParams(n=3, max_tokens=12, temperature=0.9, seed=11, ignore_eos=True)
    roomy = LLM(tiny_dir, model=tiny_model, block_size=BLOCK)
    llm = tight(tiny_dir, tiny_model, blocks=16)
    assert [o.samples for o in llm.generate(prompts, params)] == [
        o.samples for o in roomy.generate(prompts, params)
    ]
    assert_swapped_and_drained(llm)


def test_beams_with_swaps_equal_the_reference_search(tiny_dir, tiny_model):
    prompts = random_prompts(4, seed=8, longest=22)
    params = SamplingParams(beam_width=3, max_tokens=8, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, blocks=12)
    for out, prompt in zip(llm.generate(prompts, params), prompts):
        assert out.samples == reference_beam_search(tiny_model, prompt, 3, 8, frozenset())
    assert_swapped_and_drained(llm)


def test_a_shared_block_moves_once_and_stays_shared():
    manager = BlockManager(8, 4, host_blocks=8)
    manager.grow(1, 10)  # 3 blocks
    manager.fork(1, 2)  # the two tables share all 3
    manager.moves.swap_out([1, 2])
    assert len(manager.take_copies()) == 3  # 3 moves, not 6
    assert manager.table(1) == manager.table(2) and all(manager.refcounts[b] == 2 for b in manager.table(1))
    assert manager.num_free_blocks == 8
    manager.moves.swap_in([1, 2])
    assert len(manager.take_copies()) == 3 and manager.table(1) == manager.table(2)
    manager.check_invariants()


def test_a_block_others_still_use_is_copied_for_the_victim_and_stays_put():
    manager = BlockManager(8, 4, host_blocks=8)
    manager.grow(1, 8)
    manager.fork(1, 2)  # sequence 2 keeps running on the device
    manager.moves.swap_out([1])
    assert all(manager.tier(b) == "host" for b in manager.table(1))
    assert all(manager.tier(b) == "device" and manager.refcounts[b] == 1 for b in manager.table(2))
    manager.check_invariants()


def test_a_shared_block_left_at_different_steps_is_copied_out_once():
    manager = BlockManager(8, 4, host_blocks=8)
    manager.grow(1, 8)  # 2 full blocks
    manager.fork(1, 2)
    manager.moves.swap_out([1])  # sequence 2 keeps the blocks: copied for 1
    assert len(manager.take_copies()) == 2
    manager.moves.swap_out([2])  # a later step: 2 shares 1's copies
    assert manager.take_copies() == [] and manager.moves.num_copies_saved == 2
    assert manager.table(1) == manager.table(2) and all(manager.refcounts[b] == 2 for b in manager.table(1))
    assert len(manager.held("host")) == 2 and manager.num_free_blocks == 8
    manager.moves.swap_in([1])  # both follow, still shared: 2 copies back, not 4
    assert len(manager.take_copies()) == 2 and manager.table(1) == manager.table(2)
    manager.check_invariants()


def test_a_block_still_on_the_device_is_shared_again_without_a_copy():
    manager = BlockManager(8, 4, host_blocks=8)
    manager.grow(1, 8)
    manager.fork(1, 2)
    manager.moves.swap_out([1])
    manager.take_copies()
    manager.moves.swap_in([1])  # its blocks never left the device for sequence 2
    assert manager.take_copies() == [] and manager.moves.num_copies_saved == 2
    assert manager.table(1) == manager.table(2) and not manager.held("host")
    manager.check_invariants()


def test_a_block_written_after_its_copy_is_copied_back():
    manager = BlockManager(8, 4, host_blocks=8)
    manager.grow(1, 6)  # a full block and a half-filled one
    manager.fork(1, 2)
    manager.moves.swap_out([1])
    manager.take_copies()
    manager.grow(2, 7)
    manager.check_writable(2, 6, 7)  # 2 writes into the half-filled block: its copy is 1's now
    manager.moves.swap_in([1])
    (copied,) = manager.take_copies()
    assert manager.table(1)[0] == manager.table(2)[0] and copied[1] == manager.table(1)[1]
    assert manager.table(1)[1] != manager.table(2)[1]
    manager.check_invariants()


def test_a_copy_taken_for_other_content_stands_for_nothing():
    manager = BlockManager(8, 4, host_blocks=2)
    manager.grow(1, 4)
    manager.fork(1, 2)
    manager.moves.swap_out([1])  # the first host block gets the shared block's bytes
    manager.free(1)  # ...and is free again, still their copy
    for seq_id in (3, 4):  # the second host block, then the first, taken for other sequences
        manager.grow(seq_id, 4)
        manager.moves.swap_out([seq_id])
    manager.take_copies()
    manager.moves.swap_out([2])
    assert manager.table(2) != manager.table(4) and len(manager.take_copies()) == 1
    manager.check_invariants()


def test_prompts_sharing_a_prefix_swap_it_once_and_equal_naive(tiny_dir, tiny_model):
    prefix = [5, 9, 14, 3, 8, 21, 2, 7, 30, 11, 4, 6]  # three blocks every prompt adopts
    prompts = [prefix + tail for tail in random_prompts(6, seed=3, longest=22)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, blocks=16, prefix_caching=True)
    outs = llm.generate(prompts, params)
    assert [out.token_ids for out in outs] == [naive(tiny_model, p, params) for p in prompts]
    assert_swapped_and_drained(llm)
    assert llm.engine.snapshot().counters["swap_copies_saved"] > 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["grow", "append", "fork", "free", "swap_out", "swap_in", "cache"]),
        st.integers(0, 7),
        st.integers(1, 30),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@example(
    num_blocks=2,
    host_blocks=0,
    disk=True,
    block_size=1,
    ops=[("grow", 0, 1), ("append", 0, 1), ("swap_out", 0, 1)],
)
@example(  # a block shared, copied for one holder, then freed and reused: the copy comes back
    num_blocks=4,
    host_blocks=4,
    disk=False,
    block_size=2,
    ops=[("grow", 3, 4), ("grow", 0, 4), ("fork", 0, 1), ("swap_out", 0, 1), ("free", 1, 1)]
    + [("grow", 2, 4), ("free", 3, 1), ("swap_in", 0, 1)],
)
@given(
    num_blocks=st.integers(2, 16),
    host_blocks=st.integers(0, 8),
    disk=st.booleans(),
    block_size=st.integers(1, 4),
    ops=OPS,
)
def test_every_tier_keeps_its_books_under_random_operations(num_blocks, host_blocks, disk, block_size, ops):
    """allocate / grow / fork / free / swap out / swap in / cache-and-spill, in any order: no block
    leaked or freed twice in any tier, refcounts equal the tables holding a block, every table
    reads back what its sequence wrote (through copies, shared twins and writes by siblings), and
    every tier drains to all-free."""
    manager = BlockManager(num_blocks, block_size, prefix_caching=True, host_blocks=host_blocks, disk=disk)
    moves = manager.moves
    content: dict[int, dict] = {}  # block -> offset -> what was written there, replayed from the copies
    written: dict[int, list] = {}  # seq_id -> what each of its positions must read
    tokens = {}

    def replay():
        for src, dst in manager.take_copies():
            assert src in content, f"copy from block {src}, which holds nothing"
            content[dst] = dict(content[src])

    def write(seq_id, start, end):
        manager.check_writable(seq_id, start, end)  # as the engine announces every write
        table = manager.table(seq_id)
        for pos in range(start, end):
            content.setdefault(table[pos // block_size], {})[pos % block_size] = (seq_id, pos)
            written[seq_id][pos:] = [(seq_id, pos)]

    def check_reads():
        for seq_id, values in written.items():
            table = manager.table(seq_id)
            read = [content[table[pos // block_size]].get(pos % block_size) for pos in range(len(values))]
            assert read == values, f"sequence {seq_id} reads {read}, wrote {values}"

    for op, seq_id, amount in ops:
        swapped = moves.is_swapped(seq_id)
        length = len(written.get(seq_id, ()))
        if op == "grow" and seq_id not in written and manager.can_grow(seq_id, amount):
            manager.grow(seq_id, amount)
            written[seq_id], tokens[seq_id] = [], [seq_id % 3] * amount
            write(seq_id, 0, amount)
        elif op == "append" and seq_id in written and not swapped:
            if manager.can_grow(
                seq_id, length + 1, copies=len(manager.shared_blocks(seq_id, length, length + 1))
            ):
                manager.grow(seq_id, length + 1)
                manager.copy_on_write(seq_id, length, length + 1)
                tokens[seq_id].append(seq_id % 3)
                replay()
                write(seq_id, length, length + 1)
        elif op == "fork" and seq_id in written and not swapped and len(written) < 8:
            child = min(set(range(8)) - set(written))  # an id the other operations can name
            manager.fork(seq_id, child)
            written[child], tokens[child] = list(written[seq_id]), list(tokens[seq_id])
        elif op == "free" and seq_id in written:
            manager.free(seq_id)
            del written[seq_id]
        elif op == "swap_out" and seq_id in written and not swapped and moves.can_swap_out([seq_id]):
            moves.swap_out([seq_id])
        elif op == "swap_in" and swapped and moves.can_swap_in([seq_id]):
            moves.swap_in([seq_id])
        elif op == "cache" and seq_id in written and not swapped:
            manager.prefix_cache.register(seq_id, manager.table(seq_id), tokens[seq_id], length)
        replay()
        manager.check_invariants()
        check_reads()
    for seq_id in list(written):
        manager.free(seq_id)
    replay()
    manager.check_invariants()
    assert manager.num_free_blocks == num_blocks
    assert not manager.held("host") and not manager.held("disk")


def corrupt_every_block_file(monkeypatch, damage):
    """Wrap the disk tier's writes so each file is damaged right after it is written."""
    original = DiskTier.write_block

    def write_then_damage(disk, block, payload):
        original(disk, block, payload)
        damage(disk.path(block))

    monkeypatch.setattr(DiskTier, "write_block", write_then_damage)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(path.read_bytes()[:-7]),  # truncated
        lambda path: path.write_bytes(path.read_bytes()[:-1] + b"\x01"),  # a flipped byte
        lambda path: path.unlink(),  # gone
    ],
)
def test_a_lost_block_file_is_recomputed_with_a_warning(
    tiny_dir, tiny_model, tmp_path, caplog, monkeypatch, damage
):
    prompts = random_prompts(8, seed=9, longest=22)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, host_cache_bytes=0, disk_cache_dir=str(tmp_path))
    corrupt_every_block_file(monkeypatch, damage)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert "missing or corrupt" in caplog.text and llm.engine.snapshot().counters["recomputed_tokens"] > 0
    llm.engine.kv_cache.check_invariants()


def test_a_full_disk_means_recompute_not_wrong_kv(tiny_dir, tiny_model, tmp_path, caplog, monkeypatch):
    prompts = random_prompts(8, seed=10, longest=22)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, host_cache_bytes=0, disk_cache_dir=str(tmp_path))

    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", disk_full)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert "could not be written" in caplog.text


class FakeTiers:
    block_bytes = 1000

    def __init__(self, rate):
        self.rate = rate

    def copy_rate(self, tier):
        return self.rate


@pytest.mark.parametrize("copy_rate, expected", [(1e9, True), (1e3, False)])
def test_auto_swaps_when_copying_is_cheaper_and_recomputes_when_not(copy_rate, expected):
    cost = SwapCost(FakeTiers(copy_rate))
    cost.record_forward(tokens=1000, sequences=2, seconds=1.0)  # 1,000 prefill tokens/s
    # 100 tokens to recompute: 0.1 s; 10 blocks of 1,000 B out and back: 2e-5 s at 1 GB/s, 20 s at 1 kB/s
    assert cost.prefers_swap(tokens=100, num_blocks=10, tier="host") is expected


def test_auto_in_the_engine_follows_the_measured_costs(tiny_dir, tiny_model, monkeypatch):
    prompts = random_prompts(12, seed=12, longest=22)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    expected = [naive(tiny_model, prompt, params) for prompt in prompts]
    for copy_is_cheap in (True, False):
        monkeypatch.setattr(
            SwapCost,
            "seconds",
            lambda self, tokens, blocks, tier, cheap=copy_is_cheap: (1.0, 0.001) if cheap else (0.001, 1.0),
        )
        llm = tight(tiny_dir, tiny_model, preemption="auto")
        assert [out.token_ids for out in llm.generate(prompts, params)] == expected
        counters = llm.engine.snapshot().counters
        assert counters["preemptions"] > 0
        assert (counters["swapped_out"] > 0) is copy_is_cheap
        assert (counters["recomputed_tokens"] > 0) is not copy_is_cheap


def test_prefix_blocks_spill_to_host_and_come_back(tiny_dir, tiny_model):
    """More distinct system prompts than the device pool holds: with a host tier the cached
    blocks pushed out of the device LRU are found again there, and the answers stay exact."""
    rng = random.Random(13)
    systems = [[rng.randrange(97) for _ in range(5 * BLOCK)] for _ in range(6)]
    prompts = [systems[i % 6] + [rng.randrange(97) for _ in range(3)] for i in range(18)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = [naive(tiny_model, prompt, params) for prompt in prompts]
    saved = {}
    for host in (0, 64):
        llm = LLM(
            tiny_dir,
            model=tiny_model,
            block_size=BLOCK,
            prefix_caching=True,
            kv_cache_bytes=16 * BLOCK * KV_BYTES_PER_TOKEN,
            host_cache_bytes=host * BLOCK * KV_BYTES_PER_TOKEN,
        )
        assert [llm.generate([p], params)[0].token_ids for p in prompts] == expected
        saved[host] = llm.engine.snapshot().prefix_cache["hit_blocks"]
        llm.engine.kv_cache.check_invariants()
    assert saved[64] >= 2 * max(saved[0], 1)
    assert llm.engine.snapshot().counters["spill_hits"] > 0


@pytest.mark.parametrize("spill", ["reused", "all"])
def test_only_blocks_read_again_spill_under_the_reused_rule(tiny_dir, tiny_model, spill):
    """Six device blocks, a host tier of four, one request at a time, each two full blocks and a
    token (three blocks). A, A again (it hits A0 A1: reused), B, then C and D take the least
    recently freed blocks: C reclaims A0 A1, D reclaims B0 B1. Under "reused" only A's two spill
    (B's were never read again); under "all" all four. A comes back: its two blocks return from
    the host, into C's blocks, which "all" copies out too, pushing B's copies off the host; B
    comes back: computed again under both rules (its blocks now known as reused), D's blocks
    copied out under "all". The same two hits: two copies against eight. Then E and F reclaim
    A's blocks and B's: under "reused" all four spill, B's too (computed again after a drop)."""
    rng = random.Random(5)
    full = {name: [rng.randrange(97) for _ in range(2 * BLOCK)] for name in "ABCDEF"}
    prompts = [
        full["A"] + [1],
        full["A"] + [2],
        full["B"] + [3],
        full["C"] + [4],
        full["D"] + [5],
        full["A"] + [6],
        full["B"] + [7],
    ]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    llm = LLM(
        tiny_dir,
        model=tiny_model,
        block_size=BLOCK,
        prefix_caching=True,
        kv_cache_bytes=6 * BLOCK * KV_BYTES_PER_TOKEN,
        host_cache_bytes=4 * BLOCK * KV_BYTES_PER_TOKEN,
        spill=spill,
    )
    counters = []
    for prompt in prompts:
        assert llm.generate([prompt], params)[0].token_ids == naive(tiny_model, prompt, params)
        counters.append(llm.engine.snapshot().counters)
    after_d, after_a, after_b = counters[4], counters[5], counters[6]
    assert after_d["spilled"] == (2 if spill == "reused" else 4)
    assert after_a["spill_hits"] == after_b["spill_hits"] == 2  # A0 A1 came back from the host
    assert after_b["spilled"] == (2 if spill == "reused" else 8)
    assert len(cached_blocks(llm.engine, prompts[-1])) == 2  # B's blocks, computed again, are cached
    for prompt in (full["E"] + [8], full["F"] + [9]):  # they reclaim A's blocks, then B's
        llm.generate([prompt], params)
    assert llm.engine.snapshot().counters["spilled"] == (6 if spill == "reused" else 12)
    llm.engine.kv_cache.check_invariants()


def test_tier_switches_are_checked(tiny_dir, tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="needs somewhere to swap to"):
        LLM(tiny_dir, model=tiny_model, preemption="swap")
    with pytest.raises(ConfigError, match="preemption must be"):
        LLM(tiny_dir, model=tiny_model, preemption="sometimes")
    with pytest.raises(ConfigError, match="host_cache_bytes must be"):
        LLM(tiny_dir, model=tiny_model, host_cache_bytes=-1)
    with pytest.raises(ConfigError, match="host_cache_bytes=10 cannot hold one block"):
        LLM(tiny_dir, model=tiny_model, host_cache_bytes=10)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ConfigError, match="cannot hold KV blocks"):
        LLM(tiny_dir, model=tiny_model, disk_cache_dir=str(blocker))


def test_memory_stats_count_every_tier(tiny_dir, tiny_model):
    llm = tight(tiny_dir, tiny_model)
    llm.generate(random_prompts(12, seed=14, longest=22), SamplingParams(max_tokens=12, ignore_eos=True))
    snapshots = list(llm.engine.stats.memory)
    assert max(m.host_reserved_slots for m in snapshots) > 0
    final = snapshots[-1].as_dict()
    assert final["bytes_moved"]["device->host"] == final["bytes_moved"]["host->device"] > 0
    assert final["host_total_slots"] == llm.engine.snapshot().num_host_blocks * BLOCK


@pytest.mark.slow
def test_cli_generate_on_the_engine_reports_memory_per_tier(capsys, real_dir):
    argv = ["generate", "The sky is", "--max-tokens", "6", "--json", "--model", str(real_dir)]
    assert main(argv) == 0
    cached = json.loads(capsys.readouterr().out)
    assert main(argv + ["--decoder", "paged", "--host-cache-mb", "8"]) == 0
    paged = json.loads(capsys.readouterr().out)
    assert paged["generated_ids"] == cached["generated_ids"]
    assert paged["memory"]["host_total_slots"] > 0 and paged["memory_peak"]["device_reserved_bytes"] > 0
    assert paged["preemption"]["mode"] == "auto" and paged["preemption"]["tokens_recomputed"] == 0


@pytest.mark.slow
def test_prefetched_swap_ins_copy_behind_the_forward_pass_and_stay_exact(tiny_dir, tiny_model):
    prompts = random_prompts(30, seed=3, longest=22)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, blocks=20)
    outputs = llm.generate(prompts, params)
    assert [out.token_ids for out in outputs] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert llm.engine.snapshot().counters["prefetched"] > 0 and llm.engine.snapshot().prefetch_seconds > 0
    assert_swapped_and_drained(llm)


def test_real_model_with_swaps_at_every_turn_equals_naive(real_dir, real_model, real_tokenizer, naive_real):
    questions = REAL_CHAT_QUESTIONS + ["Name three colors."]  # four: the pool cannot hold them all
    prompts = [real_tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=12)
    per_block = real_model.config.kv_bytes_per_token(torch.float32) * 16
    llm = LLM(
        real_dir,
        model=real_model,
        tokenizer=real_tokenizer,
        kv_cache_bytes=7 * per_block,
        host_cache_bytes=64 * per_block,
        preemption="swap",
        max_num_batched_tokens=48,
    )
    outputs = llm.generate(prompts, params)
    for out, prompt in zip(outputs, prompts):
        assert out.token_ids == naive_real(prompt, params.max_tokens)
    assert_swapped_and_drained(llm)


def _vanish(folder, monkeypatch):
    shutil.rmtree(folder)  # the folder deleted under the running engine (a cleanup job, a user)


def _fill(folder, monkeypatch):
    def disk_full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", disk_full)


@pytest.mark.parametrize("fault", [_vanish, _fill], ids=["folder gone", "disk full"])
def test_the_disk_tier_failing_mid_run_means_recompute_and_no_request_fails(
    tiny_dir, tiny_model, tmp_path, caplog, monkeypatch, fault
):
    """Once blocks lie on disk, its folder disappears, or the disk fills up: blocks already there
    cannot be read back and new ones cannot be written, so their sequences are recomputed; every
    request still gets the naive decoder's tokens and none ends with an error."""
    prompts = random_prompts(8, seed=11, longest=22)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = tight(tiny_dir, tiny_model, host_cache_bytes=0, disk_cache_dir=str(tmp_path))
    engine = llm.engine
    ids, final = [engine.add_request(prompt, params) for prompt in prompts], {}
    while not engine.snapshot().blocks["disk"]:  # run until some blocks were swapped out to disk
        assert engine.has_unfinished_requests(), "nothing went to disk: tighten the pool"
        final |= {out.request_id: out for out in engine.step() if out.finished}
    fault(next(tmp_path.glob("minillm-kv-*")), monkeypatch)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        while engine.has_unfinished_requests():
            final |= {out.request_id: out for out in engine.step() if out.finished}
    assert all(final[i].finish_reason != "error" for i in ids)
    assert [final[i].token_ids for i in ids] == [naive(tiny_model, prompt, params) for prompt in prompts]
    assert "missing or corrupt" in caplog.text or "could not be written" in caplog.text
    engine.kv_cache.check_invariants()
