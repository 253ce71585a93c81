"""The memory view (`minillm/view/`, `serve/memory_page.py`): the frames it draws, built from the KV
events alone, equal the block manager's real state after every step (device, host and disk blocks,
each table, the queue's order), live and replayed from a trace file; its routes serve the page
under a strict CSP, read-only, with the API key asked as a header. The page in a real browser is
`test_memory_page_browser.py`'s."""

import json
import random

import pytest
from helpers import KV_BYTES_PER_TOKEN
from test_events import busy_llm

from minillm.engine import SamplingParams
from minillm.tracing import read_trace, tracing
from minillm.view import Replay, ViewState

REAL_STATE = {  # (accounting's state, on the device?) -> the frame's character
    ("free", True): ".",
    ("free", False): ".",
    ("cached", True): "c",
    ("shared", True): "s",
    ("private", True): "hw",
    ("filling", True): "hw",
    ("cached", False): "p",
    ("shared", False): "o",
    ("private", False): "o",
}


def real_picture(engine) -> dict:
    """What the frame should say, read from the engine itself (not from its events)."""
    snapshot = engine.snapshot()
    states = [(state, True) for state in snapshot.blocks["device"]]
    for tier in ("host", "disk"):  # the host tier whole, the disk's blocks in use
        states += [(state, False) for state in snapshot.blocks.get(tier, ())]
    tables = {seq.seq_id: list(seq.table) for seq in snapshot.sequences if seq.table}
    queue = [seq.seq_id for seq in snapshot.waiting()]
    return {"states": states, "tables": tables, "queue": queue}


def assert_drawn(frame: dict, real: dict) -> None:
    drawn = frame["states"]
    assert len(drawn) == len(real["states"]) == len(frame["born"])
    for block, (char, state) in enumerate(zip(drawn, real["states"])):
        assert char in REAL_STATE[state], f"block {block}: drawn {char!r}, really {state}"
    tables = {seq["seq"]: seq["blocks"] for seq in frame["sequences"] if seq["blocks"]}
    assert tables == real["tables"]
    queued = [seq["seq"] for seq in frame["sequences"] if seq["status"] != "running"]
    assert queued == real["queue"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_frames_equal_the_real_state_live_and_replayed(tiny_dir, tiny_model, tmp_path, seed):
    rng = random.Random(seed)
    llm = busy_llm(tiny_dir, tiny_model, rng, tmp_path)
    engine, view = llm.engine, ViewState()
    engine.subscribe(lambda step, event: view.apply(step, 0.0, event))
    shared = [rng.randrange(97) for _ in range(16)]
    for _ in range(10):
        prompt = (shared if rng.random() < 0.6 else []) + [
            rng.randrange(97) for _ in range(rng.randint(1, 20))
        ]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 20)))
    while engine.has_unfinished_requests():
        engine.step()
        assert_drawn(view.frame(), real_picture(engine))
    assert view.counters()["utilization"] == 0.0  # every request finished: nothing held


def test_a_replayed_trace_draws_every_step_as_it_was(tiny_dir, tiny_model, tmp_path):
    rng, path = random.Random(5), tmp_path / "run.jsonl"
    reals = []
    with tracing(path):
        llm = busy_llm(tiny_dir, tiny_model, rng, tmp_path)
        shared = [rng.randrange(97) for _ in range(12)]
        engine = llm.engine
        for index in range(8):
            engine.add_request(
                shared + [index] * rng.randint(1, 9), SamplingParams(max_tokens=rng.randint(2, 16))
            )
        while engine.has_unfinished_requests():
            engine.step()
            reals.append(real_picture(engine))
    replay = Replay(read_trace(path)[0])
    assert len(replay) == len(reals) + 1  # the snapshot's frame, then one per step
    for index, real in enumerate(reals, 1):
        assert_drawn(json.loads(replay.frame(index)), real)
    summary = replay.summary()
    assert summary["frames"] == len(replay) and len(summary["counters"]) == len(replay)
    assert summary["counters"][-1]["hit_rate"] > 0  # the shared prefix was hit
    with pytest.raises(IndexError):
        replay.frame(len(replay))


def test_a_preemption_is_drawn_with_its_cause(tiny_dir, tiny_model):
    from minillm.engine import LLM

    llm = LLM(tiny_dir, model=tiny_model, block_size=4, kv_cache_bytes=12 * 4 * KV_BYTES_PER_TOKEN)
    engine, view = llm.engine, ViewState()
    engine.subscribe(lambda step, event: view.apply(step, 0.0, event))
    for index in range(4):
        engine.add_request([index + 1] * 10, SamplingParams(max_tokens=12))
    while engine.has_unfinished_requests():
        engine.step()
        frame = view.frame()
        assert frame["counters"]["utilization"] <= 1.0
    assert engine.num_preemptions > 0
    assert frame["counters"]["preemptions"] >= engine.num_preemptions
    assert any("preempted by recompute" in line for _, line in frame["log"])


ORPHAN = {"type": "CopiedOnWrite", "seq_id": 5, "index": 0, "source": 1, "block": 2}  # of no table


@pytest.mark.parametrize(
    "change, then, message",
    [
        ({"num_blocks": 10**12}, [], "draws at most 262,144"),
        ({"num_blocks": -5}, [], "draws at most"),
        ({"tables": {"1": [0, 1, "a"]}}, [], "Snapshot.tables should be dict.int, tuple.int, ....., not"),
        ({"block_size": 0}, [], "blocks of 0 tokens"),
        ({}, [ORPHAN], "Event 2 of this run .CopiedOnWrite. does not follow"),
    ],
)
def test_a_damaged_trace_is_one_clear_error(change, then, message):
    from minillm.memory.events import event_from_json

    snapshot = {"type": "Snapshot", "num_blocks": 4, "host_blocks": 0, "block_size": 4, "bytes_per_token": 8}
    records = [{**snapshot, "tables": {}, "cached": [], **change}, *then]
    with pytest.raises(ValueError, match=message):
        Replay([(0, 0.0, event_from_json(record)) for record in records])


def test_a_replay_stops_at_its_memory_bound_with_one_clear_error(monkeypatch):
    """A small file may claim a big pool and many steps: the frames stop at MAX_BYTES."""
    from minillm.memory.events import Snapshot, Step
    from minillm.view import replay

    monkeypatch.setattr(replay, "MAX_BYTES", 50_000)
    events = [(0, 0.0, Snapshot(10_000, 0, 16, 8, {}, ()))]
    events += [(step, 0.0, Step(0.01, ())) for step in range(1, 100)]
    with pytest.raises(ValueError, match="This run's frames pass 0 MiB by step [0-9]+ .10,000 blocks"):
        Replay(events)
