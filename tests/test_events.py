"""KV events: the state rebuilt from the events alone equals the block manager's, through every
mechanism (the soak in test_soak.py replays prefix caching, COW, preemption by swap and recompute,
tiers and speculation; here eviction, quantized pools, sessions and late subscribers); the events
survive a trace file; vLLM's BlockStored/BlockRemoved rebuild the prefix cache; with nobody
listening no event is even built; the prefix-miss explainer names the token a prompt parts at."""

import random

import pytest
from helpers import KV_BYTES_PER_TOKEN, assert_replayed, heard_snapshot, route

from minillm.engine import LLM, SamplingParams
from minillm.memory.block_ledger import tier_of
from minillm.memory.events import EVENT_TYPES, KVEvents, event_from_json
from minillm.memory.prefix_cache import PrefixCache
from minillm.memory.replay import Replayer
from minillm.serve.kv_events import VllmEvents
from minillm.tracing import TraceError, read_trace, tracing


def busy_llm(tiny_dir, tiny_model, rng: random.Random, tmp_path, **switches) -> LLM:
    host_blocks, disk = rng.choice([(0, True), (16, False), (16, True), (0, False)])
    return LLM(
        tiny_dir,
        model=tiny_model,
        block_size=rng.choice([2, 4]),
        kv_cache_bytes=rng.choice([24, 40, 400]) * 4 * KV_BYTES_PER_TOKEN,
        prefix_caching=True,
        max_num_batched_tokens=rng.choice([8, 64]),
        host_cache_bytes=host_blocks * 4 * KV_BYTES_PER_TOKEN,
        disk_cache_dir=str(tmp_path) if disk else None,
        preemption=rng.choice(["swap", "recompute"]) if host_blocks or disk else "recompute",
        **switches,
    )


def run_checked(llm: LLM, rng: random.Random, num_requests: int) -> Replayer:
    """Random requests (half sharing a prefix, some sampled n=2), the replayed state checked after
    every step; returns the replayer."""
    engine, replayer = llm.engine, Replayer()
    engine.subscribe(replayer)
    shared = [rng.randrange(97) for _ in range(rng.randint(6, 24))]
    for _ in range(num_requests):
        own = [rng.randrange(97) for _ in range(rng.randint(1, 20))]
        prompt = (shared if rng.random() < 0.5 else []) + own
        n = rng.choice([1, 1, 2])
        params = SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, seed=1, max_tokens=rng.randint(1, 24))
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        assert_replayed(replayer, engine.kv_cache)
    return replayer


@pytest.mark.parametrize("seed", range(6))
def test_replayer_follows_eviction_and_quantized_pools(tiny_dir, tiny_model, tmp_path, seed):
    rng = random.Random(seed)
    switches = [
        {"eviction": "h2o", "kv_budget": 8},
        {"eviction": "sinks", "kv_budget": 6, "speculative": "ngram"},
        {"kv_dtype": "int8", "speculative": "ngram"},
        {"kv_dtype": "int4", "kv_key_scales": "token"},
        {"eviction": "window", "kv_budget": 5, "kv_dtype": "fp8"},
        {"speculative": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    ][seed]
    llm = busy_llm(tiny_dir, tiny_model, rng, tmp_path, **switches)
    replayer = run_checked(llm, rng, 24)
    assert not replayer.tables and not replayer.refcounts  # everything went back


def test_a_late_subscriber_starts_from_the_snapshot(tiny_dir, tiny_model, tmp_path):
    rng = random.Random(7)
    llm = busy_llm(tiny_dir, tiny_model, rng, tmp_path)
    engine = llm.engine
    for _ in range(6):
        engine.add_request([rng.randrange(97) for _ in range(30)], SamplingParams(max_tokens=20))
    for _ in range(5):
        engine.step()
    late = Replayer()
    engine.subscribe(late)
    assert_replayed(late, engine.kv_cache)
    while engine.has_unfinished_requests():
        engine.step()
        assert_replayed(late, engine.kv_cache)


def test_a_trace_file_replays_to_the_same_state(tiny_dir, tiny_model, tmp_path):
    path, rng = tmp_path / "trace.jsonl", random.Random(3)
    with tracing(path):
        llm = busy_llm(tiny_dir, tiny_model, rng, tmp_path)
        live = run_checked(llm, rng, 16)
    (run,) = read_trace(path).values()
    replayed = Replayer()
    kinds = set()
    for step, seconds, event in run:
        replayed.apply(event)
        kinds.add(type(event).__name__)
        assert event_from_json(event.to_json()) == event
    assert replayed.tables == live.tables and replayed.refcounts == live.refcounts
    assert replayed.cached == live.cached
    assert {"Snapshot", "Allocated", "Registered", "Hit", "Filled", "Freed", "Step"} <= kinds
    steps = [step for step, _, event in run if type(event).__name__ == "Step"]
    assert steps == list(range(1, len(steps) + 1)) == list(range(1, llm.engine.num_steps + 1))


def test_a_bad_trace_file_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": 0, "step": 0, "t": 0, "type": "Allocated", "seq_id": 1, "block": 2}\n')
    with pytest.raises(TraceError, match="Snapshot"):
        read_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(TraceError, match="bad.jsonl:1"):
        read_trace(bad)
    with pytest.raises(TraceError, match="No trace file"):
        read_trace(tmp_path / "missing.jsonl")
    snapshot = '{"run": 0, "step": 0, "t": 0, "type": "Snapshot", "num_blocks": 4, "host_blocks": 0, '
    snapshot += '"block_size": 4, "bytes_per_token": 8, "tables": {}, "cached": []}\n'
    wrong = {  # a field of the wrong type or shape, each named (a trace file is hostile)
        snapshot.replace('"block_size": 4', '"block_size": "x"'): "Snapshot.block_size should be int",
        snapshot + '{"run": 0, "step": 1, "t": NaN, "type": "Step", "seconds": 0.1, "sequences": []}\n': ":2",
        snapshot + '{"run": 0, "step": 1, "t": 0, "type": "Step", "seconds": 1, "sequences": "abc"}\n': (
            "Step.sequences should be"
        ),
        snapshot + '{"run": true, "step": 1, "t": 0, "type": "Reused", "block": 1}\n': "whole numbers",
        snapshot + "[" * 100_000 + "\n": ":2",
    }
    for text, message in wrong.items():
        bad.write_text(text)
        with pytest.raises(TraceError, match=message):
            read_trace(bad)
    bad.write_text("\ufeff" + snapshot + "\n\n")  # a BOM and blank lines are no events
    assert len(read_trace(bad)[0]) == 1


def test_vllm_events_rebuild_the_prefix_cache_per_medium(tiny_dir, tiny_model, tmp_path):
    """A router that keeps only BlockStored / BlockRemoved / AllBlocksCleared knows, at every
    step, exactly which block hashes each tier's prefix cache holds."""
    rng = random.Random(5)
    llm = busy_llm(tiny_dir, tiny_model, rng, tmp_path)
    engine, view, known = llm.engine, VllmEvents(), set()

    def router(step, event):
        for item in view(event):
            route(known, item)

    shared = [rng.randrange(97) for _ in range(20)]
    for _ in range(20):
        engine.add_request(shared + [rng.randrange(97) for _ in range(8)], SamplingParams(max_tokens=6))
    engine.subscribe(router)
    while engine.has_unfinished_requests():
        engine.step()
        state = heard_snapshot(engine)
        assert known == {
            (key, tier_of(block, state.num_blocks, state.host_blocks)) for block, key, *_ in state.cached
        }
    assert known


def test_nobody_listening_builds_no_event(tiny_dir, tiny_model, tmp_path, monkeypatch):
    def refuse(self, event):
        raise AssertionError(f"an event was emitted with no subscriber: {event}")

    monkeypatch.setattr(KVEvents, "emit", refuse)
    llm = busy_llm(tiny_dir, tiny_model, random.Random(1), tmp_path, speculative="ngram")
    prompt = list(range(40))
    outs = llm.generate([prompt, prompt], SamplingParams(max_tokens=12, n=2, temperature=1.0, seed=0))
    assert all(out.error is None for out in outs)


def test_every_event_type_is_emitted_by_some_run():
    """Each declared event type is named somewhere it is built (an event nobody sends is dead)."""
    import pathlib

    import minillm

    sources = "".join(p.read_text() for p in pathlib.Path(minillm.__file__).parent.rglob("*.py"))
    for name in EVENT_TYPES:
        assert f"{name}(" in sources.replace(f"class {name}(", ""), name


# ---------------------------------------------------------------------------- the prefix-miss explainer
def cache_with(prompts: list[list[int]], block_size: int = 4) -> PrefixCache:
    """A prefix cache holding every full block of `prompts`, each in blocks of its own."""
    cache, next_block = PrefixCache(block_size), 0
    for seq_id, prompt in enumerate(prompts):
        table = list(range(next_block, next_block + len(prompt) // block_size))
        next_block += len(table)
        cache.record_lookup(prompt, cache.lookup(prompt))
        cache.register(seq_id, table, prompt, len(prompt))
    return cache


def test_the_explainer_names_the_token_a_timestamp_changes():
    system = list(range(100, 160))
    first = [1, 2, 3, 7, 7, 0, 5, *system]  # "time: 07:05" then the system prompt
    second = [1, 2, 3, 7, 7, 0, 6, *system]
    cache = cache_with([first])
    miss = cache.record_lookup(second, cache.lookup(second))
    assert (miss.cause, miss.diverged_at, miss.cached_tokens) == ("diverged", 6, 4)
    assert miss.ours[0] == 6 and miss.theirs[0] == 5
    assert miss.recomputed_tokens == (len(second) - 1) // 4 * 4 - 4


def test_the_explainer_names_a_one_word_edit_deep_in_a_long_system_prompt():
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(500)]
    edited = list(system)
    edited[337] += 1
    cache = cache_with([system + [1, 2, 3]])
    miss = cache.record_lookup(edited + [4, 5], cache.lookup(edited + [4, 5]))
    assert (miss.cause, miss.diverged_at, miss.cached_tokens) == ("diverged", 337, 336)
    assert (miss.ours[0], miss.theirs[0]) == (edited[337], system[337])


def test_the_explainer_tells_evicted_blocks_from_new_prompts():
    prompt = list(range(40))
    cache = cache_with([prompt])
    for block in list(cache.entries):
        cache.evict(block)  # every block reused for other content
    miss = cache.record_lookup(prompt, cache.lookup(prompt))
    assert miss.cause == "evicted" and miss.cached_tokens == 0
    assert cache.record_lookup(prompt[:3], []).cause == "hit"  # fills no block: nothing to miss
    assert cache.record_lookup([999] * 12, []).cause == "new"
    hit = cache_with([prompt])
    assert hit.record_lookup(prompt, hit.lookup(prompt)).cause == "hit"


def test_the_engine_reports_the_miss_per_request(tiny_dir, tiny_model):
    llm = LLM(tiny_dir, model=tiny_model, prefix_caching=True, block_size=4)
    base = list(range(1, 30))
    llm.generate([base], SamplingParams(max_tokens=2))
    changed = base[:9] + [90] + base[10:]
    (out,) = llm.generate([changed], SamplingParams(max_tokens=2))
    report = out.prefix_miss_report()
    assert report["cause"] == "diverged" and report["diverged_at"] == 9 and report["cached_tokens"] == 8
    assert "token 9" in report["summary"]


def test_a_subscriber_that_fails_is_dropped_and_the_requests_go_on(tiny_dir, tiny_model, tmp_path):
    llm = busy_llm(tiny_dir, tiny_model, random.Random(2), tmp_path)
    calls = []

    def full_disk(step, event):
        calls.append(event)
        if len(calls) > 1:  # takes its Snapshot, then the disk is full
            raise OSError(28, "No space left on device")

    replayer = Replayer()
    llm.engine.subscribe(full_disk)
    llm.engine.subscribe(replayer)
    outs = llm.generate([list(range(30))] * 3, SamplingParams(max_tokens=8))
    assert all(out.error is None and len(out.token_ids) == 8 for out in outs)
    assert len(calls) == 2  # the Snapshot, then the event it failed on
    assert_replayed(replayer, llm.engine.kv_cache)
