"""`minillm.trace` and `minillm trace show`: numbers read from a traced run equal what the run did.

Each run here is small enough to reason out by hand: the free blocks are taken least recently
freed first (`block_ledger.py`), a cached block taken for new content spills to the host tier's
least recently used block (`spill="all"`: every cached block, read again or not), and a request
of `max_tokens=1` computes and ends in one step. The expected numbers below come from that
reasoning (or from the engine's own counters), never from running the code under test."""

import json

import numpy as np
import pytest

from minillm import trace
from minillm.cli import main
from minillm.engine import LLM, SamplingParams
from minillm.memory.block_manager import BlockManager
from minillm.tracing import read_trace, tracing

KV_BYTES_PER_TOKEN = 2 * 3 * 2 * 16 * 4  # the tiny model, fp32
BLOCK = 4
BLOCK_BYTES = BLOCK * KV_BYTES_PER_TOKEN

X = list(range(10, 18)) + [3]  # two full blocks and one token
Y = list(range(30, 34)) + [4]  # one full block and one token
Z = list(range(50, 58)) + [5]
D = X[:8] + [7, 8]  # X's two blocks, then its own
E = X[:8] + [9]


def one_at_a_time(llm, prompts) -> None:
    for prompt in prompts:
        llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))


@pytest.fixture(scope="module")
def prefix_run(tiny_dir, tiny_model, tmp_path_factory):
    """Six device blocks, two host blocks, five requests one per step: X, Y, Z, D, E.
    X fills blocks 0-2 (X0, X1 registered), Y 3-4 (Y0), Z takes 5 then X0 and X1 (both spill to
    host), D hits X0 and X1 on the host: both come back, the second into Y0's block, whose
    content spills into the host block X0 just left. E hits X0 and X1 on the device; its last
    block is Z0's, which spills and pushes Y0 off the host unread."""
    path = tmp_path_factory.mktemp("trace") / "prefix.jsonl"
    with tracing(path):
        llm = LLM(
            tiny_dir,
            model=tiny_model,
            block_size=BLOCK,
            kv_cache_bytes=6 * BLOCK_BYTES,
            host_cache_bytes=2 * BLOCK_BYTES,
            prefix_caching=True,
            spill="all",
        )
        one_at_a_time(llm, [X, Y, Z, D, E])
    (events,) = read_trace(path).values()
    return path, llm, trace.walk(events)


def test_the_prefix_blocks_two_requests_share_are_hit_by_both(prefix_run):
    _, _, view = prefix_run
    reuse = trace.summarize(view)["reuse"]
    assert reuse["registered"] == 5  # X0 X1, Y0, Z0 Z1; D and E add only partial blocks
    assert reuse["hit"] == 2 and reuse["never_hit"] == 3
    assert reuse["requests_per_hit_block"]["max"] == reuse["requests_per_hit_block"]["median"] == 2
    assert [row["requests"] for row in reuse["most_shared"]] == [2, 2]
    assert reuse["hits"] == 4 and reuse["hits_while_held"] == 0
    # X let go of them in step 1; D hit them in step 4 and let go, E hit them in step 5
    assert sorted(d for e in view.entries for d in e.distances) == [1, 1, 3, 3]


def test_spills_brought_back_and_spills_never_read_again(prefix_run):
    _, _, view = prefix_run
    spills = trace.summarize(view)["spills"]
    assert spills["spilled"] == 4  # X0 X1 in step 3, Y0 in step 4, Z0 in step 5
    assert spills["brought_back"] == 2  # X0 X1 by D, a step after they left
    assert spills["steps_on_host_before_back"]["max"] == 1
    assert spills["dropped_unread"] == 1  # Y0, pushed off by Z0
    assert spills["on_host_at_end"] == 1  # Z0


def test_a_hit_that_brings_blocks_back_replays_to_the_block_managers_state(prefix_run):
    """D's second bring-back spills Y0 into the host block the first one left, told before the Hit."""
    _, llm, view = prefix_run
    llm.engine.kv_cache.check_invariants(view.pool)


def test_every_request_reads_its_whole_prompt_once_and_lives_on_the_device(prefix_run):
    _, _, view = prefix_run
    summary = trace.summarize(view)
    prompts = [X, Y, Z, D, E]
    assert summary["steps"] == summary["requests"] == 5
    assert summary["reads"]["total_bytes"] == sum(map(len, prompts)) * KV_BYTES_PER_TOKEN
    assert summary["reads"]["bytes_per_step"]["max"] == len(D) * KV_BYTES_PER_TOKEN
    assert summary["places"]["request_steps"] == {"waiting": 0, "device": 5, "host": 0, "disk": 0, "mixed": 0}
    lanes, requests = trace.request_rows(view)
    assert lanes.shape == (5, 5) and (np.diag(lanes) == trace.PLACES.index("device")).all()


def test_block_lifetimes_count_each_content_and_its_cached_wait(prefix_run):
    _, _, view = prefix_run
    device = trace.summarize(view)["lifetimes"]["device"]
    # X 3 blocks, Y 2, Z 3, D 1 new and 2 brought back, E 1
    assert device["contents"] == 12
    assert device["held_steps"]["max"] == 2  # X0 X1 brought back: held by D in step 4, by E in step 5
    assert sum(device["ended"].values()) == 12


@pytest.fixture(scope="module")
def swap_run(tiny_dir, tiny_model, tmp_path_factory):
    """Two requests decoding side by side in a device pool that holds one and a half of them:
    preemption by swap sends one to the host tier until the other is done."""
    path = tmp_path_factory.mktemp("trace") / "swap.jsonl"
    with tracing(path):
        llm = LLM(
            tiny_dir,
            model=tiny_model,
            block_size=BLOCK,
            kv_cache_bytes=10 * BLOCK_BYTES,
            host_cache_bytes=32 * BLOCK_BYTES,
            preemption="swap",
        )
        llm.generate([list(range(1, 9)), list(range(20, 28))], SamplingParams(max_tokens=20, ignore_eos=True))
    (events,) = read_trace(path).values()
    return path, llm, trace.walk(events)


def test_a_swapped_sequence_makes_a_round_trip(swap_run):
    _, llm, view = swap_run
    swaps = trace.summarize(view)["swaps"]
    counters = llm.engine.snapshot().counters
    assert counters["swapped_out"] >= 1
    assert swaps["round_trips"] == counters["swapped_in"] == counters["swapped_out"]
    assert swaps["blocks_out"] == swaps["blocks_in"] > 0
    assert swaps["freed_while_away"] == swaps["away_at_end"] == 0
    assert swaps["steps_away"]["median"] >= 1


def test_a_request_lives_on_the_host_for_the_steps_its_sequence_was_away(swap_run):
    _, _, view = swap_run
    summary = trace.summarize(view)
    away = {row["request"]: row["steps_away"] for row in summary["swaps"]["per_sequence"]}
    host = {row["request"]: row["host"] for row in summary["places"]["per_request"] if row["host"]}
    assert host == away


def test_a_cell_shows_its_most_frequent_state_that_is_not_free():
    grid = np.array(
        [
            [0, 0, 1, 1, 3],
            [0, 3, 2, 1, 0],
        ],
        dtype=np.uint8,
    )
    cells = trace.aggregate(grid, 2, 2, len(trace.BLOCK_STATES))
    assert cells.tolist() == [[3, 1, 3]]  # free is the most frequent in the first, yet not drawn
    assert trace.aggregate(np.zeros((3, 3), np.uint8), 2, 2, 4).tolist() == [[0, 0], [0, 0]]


def test_trace_show_prints_tables_and_writes_the_timeline(prefix_run, tmp_path, capsys):
    path, _, _ = prefix_run
    png = tmp_path / "timeline.png"
    assert main(["trace", "show", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Summary of run 0" in out and "spilled to the host tier" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trace_show_json_is_one_object_of_the_run_asked(prefix_run, capsys):
    path, _, _ = prefix_run
    assert main(["trace", "show", str(path), "--json", "--no-plot", "--run", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["run"] == 0 and report["run_chosen"] == "--run" and report["plot"] is None
    assert report["runs"][0]["steps"] == 5


def test_trace_show_without_matplotlib_says_how_to_install_it_and_still_prints(
    prefix_run, tmp_path, capsys, monkeypatch
):
    path, _, _ = prefix_run
    monkeypatch.setattr(trace.picture, "pyplot", lambda: None)
    assert main(["trace", "show", str(path), "--plot", str(tmp_path / "no.png")]) == 0
    captured = capsys.readouterr()
    assert "pip install matplotlib" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "Summary of run 0" in captured.out and not (tmp_path / "no.png").exists()


def test_trace_show_of_a_bad_file_is_a_one_line_error(tmp_path, capsys, prefix_run):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"run": 0, "step": 0, "t": 0, "type": "Nonsense"}\n')
    assert main(["trace", "show", str(bad)]) == 2
    assert main(["trace", "show", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["trace", "show", str(prefix_run[0]), "--run", "7", "--no-plot"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(line.startswith("error: ") for line in errors)
    assert "bad.jsonl:1" in errors[0] and "No trace file" in errors[1] and "no run 7" in errors[2]


def test_a_block_shared_again_without_a_copy_keeps_its_one_life():
    """Two sequences share two blocks; one leaves (they are copied out), comes back while the other
    still holds them (no copy: the same device blocks again), and both end. The device saw two
    contents, each held from step 0 to the end; the host two copies, freed on the way back."""
    manager = BlockManager(8, BLOCK, host_blocks=8)
    events = []
    manager.subscribe(lambda step, event: events.append((step, 0.0, event)))
    manager.grow(1, 2 * BLOCK)
    manager.fork(1, 2)
    manager.events.step = 1
    manager.moves.swap_out([1])
    manager.events.step = 2
    manager.moves.swap_in([1])
    manager.events.step = 3
    manager.free(1)
    manager.free(2)
    view = trace.walk(events)
    lives = trace.summarize(view)["lifetimes"]
    assert lives["device"]["contents"] == 2 and lives["device"]["held_steps"]["max"] == 4
    assert lives["host"]["contents"] == 2 and lives["host"]["ended"] == {"freed": 2}
    assert manager.moves.num_copies_saved == 2
