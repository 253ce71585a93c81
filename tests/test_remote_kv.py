"""The remote KV tier on a real Redis server: a prompt one engine computed is read by another (same
weights) instead of recomputed, and whatever the store does (dies, answers late, is full, holds a
damaged block or another model's) every request completes with the naive decoder's tokens."""

import logging
import shutil
import struct

import pytest
from helpers import (
    TINY_CONFIG,
    RedisServer,
    free_port,
    naive,
    random_llama_tensors,
    wait_until,
    write_checkpoint,
)

from minillm.benchmarks.delay_proxy import delay_proxy
from minillm.config import ConfigError
from minillm.engine import LLM, SamplingParams
from minillm.memory import remote
from minillm.memory.remote_values import HEADER
from minillm.serve.engine_loop import EngineLoop
from minillm.serve.metrics import metric_values, parse_metrics, prometheus
from minillm.weights import load_model

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (Debian: apt-get install redis-server)",
)

BLOCK = 4
PROMPT = [(7 * i + 3) % 97 for i in range(33)]  # 8 full blocks a hit may cover, and a last token
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
OUTAGE = "unavailable"  # the words of the one warning an outage gets


@pytest.fixture
def store(tmp_path):
    server = RedisServer(tmp_path)
    try:
        yield server.start()
    finally:
        server.stop()


def engine(tiny_dir, model, url: str, **switches) -> LLM:
    return LLM(
        tiny_dir,
        model=model,
        block_size=BLOCK,
        prefix_caching=True,
        kv_cache_bytes=64 * BLOCK * 768,  # 64 blocks of the tiny model (in fp32; more when quantized)
        remote_kv=url,
        **switches,
    )


def remote_stats(llm: LLM) -> dict:
    return llm.engine.snapshot().remote


def written(llm: LLM, blocks: int) -> None:
    """Wait until the engine's writer has answered for `blocks` blocks (new or already there)."""
    stats = lambda: remote_stats(llm)  # noqa: E731
    wait_until(lambda: stats()["blocks_written"] + stats()["already_stored"] >= blocks, what="the writes")


def outages(caplog, url: str) -> int:
    """Outage warnings logged of the store at `url` (an earlier test's engine may still be logging
    its own store's end)."""
    return sum(OUTAGE in record.getMessage() and url in record.getMessage() for record in caplog.records)


def stored_value(client, tokens: list[int]) -> tuple[bytes, bytes]:
    """(key, value) of the stored block holding `tokens`, found by its header."""
    for key in client.keys(b"minillm:kv:*"):
        value = client.get(key)
        count = HEADER.unpack_from(value)[4]
        if list(struct.unpack_from(f"<{count}i", value, HEADER.size)) == tokens:
            return key, value
    raise AssertionError(f"no stored block holds {tokens}")


@pytest.mark.parametrize("switches", [{}, {"kv_dtype": "int8"}])
def test_a_fresh_engine_reads_the_blocks_another_computed(tiny_dir, tiny_model, store, switches):
    first = engine(tiny_dir, tiny_model, store.url, **switches)
    out = first.generate([PROMPT], PARAMS)[0].token_ids
    written(first, 9)  # the prompt's 8 full blocks and the one its answer filled
    assert remote_stats(first)["blocks_written"] == 9

    second = engine(tiny_dir, tiny_model, store.url, **switches)
    assert second.generate([PROMPT], PARAMS)[0].token_ids == out  # what computing them gives
    if not switches:  # lossless: the oracle's tokens
        assert out == naive(tiny_model, PROMPT, PARAMS)
    stats = remote_stats(second)
    assert stats["blocks_read"] == 8 and stats["hit_blocks"] == 8 and stats["bytes_read"] > 0
    assert second.engine.stats.tokens_computed == first.engine.stats.tokens_computed - 8 * BLOCK
    # installed blocks are not written back: only the block its answer filled is offered (it is
    #   there already), and the installed ones would have been queued before it
    written(second, 1)
    assert stats["blocks_written"] == 0 and remote_stats(second)["already_stored"] == 1
    shown = parse_metrics(prometheus(metric_values(EngineLoop(second.engine))))  # what /metrics says
    assert shown["remote_kv_blocks_read_total"] == 8 and shown["remote_kv_refused_total"]["checksum"] == 0


def test_a_store_that_dies_means_recompute_and_one_warning_per_outage(
    tiny_dir, tiny_model, store, caplog, monkeypatch
):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.2)
    prompts = [PROMPT, PROMPT[:20] + [5] * 13, [9] * 30, PROMPT[:9] + [4] * 20]
    expected = [naive(tiny_model, prompt, PARAMS) for prompt in prompts]
    with caplog.at_level(logging.WARNING, logger="minillm"):
        llm = engine(tiny_dir, tiny_model, store.url)
        assert llm.generate([prompts[0]], PARAMS)[0].token_ids == expected[0]
        store.stop()  # between requests
        assert llm.generate([prompts[1]], PARAMS)[0].token_ids == expected[1]
        assert outages(caplog, store.url) == 1

        store.start()  # the same port: it comes back by itself once the backoff is over
        wait_until(lambda: remote_stats(llm)["available"], what="the backoff's end")
        before = remote_stats(llm)["blocks_written"]
        assert llm.generate([prompts[2]], PARAMS)[0].token_ids == expected[2]
        written(llm, before + 1)

        engine_ = llm.engine  # during a request: the store dies between its steps
        engine_.add_request(prompts[3], PARAMS, request_id="during")
        engine_.step()
        store.stop()
        outputs = {}
        while engine_.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine_.step())
        assert outputs["during"].token_ids == expected[3] and outputs["during"].finish_reason == "length"
        llm.generate([prompts[1]], PARAMS)  # a fetch tried on the dead store, or skipped in its backoff
    assert outages(caplog, store.url) == 2
    assert remote_stats(llm)["store_errors"] >= 2


@pytest.mark.parametrize("damage", ["checksum", "tokens"])
def test_a_damaged_block_is_refused_and_recomputed(tiny_dir, tiny_model, store, caplog, damage):
    first = engine(tiny_dir, tiny_model, store.url)
    first.generate([PROMPT], PARAMS)
    written(first, 9)
    client = store.client()
    key, value = stored_value(client, PROMPT[3 * BLOCK : 4 * BLOCK])  # the prompt's 4th block
    where = len(value) - 1 if damage == "checksum" else HEADER.size  # a payload byte, a token id
    client.set(key, value[:where] + bytes([value[where] ^ 0x01]) + value[where + 1 :])

    second = engine(tiny_dir, tiny_model, store.url)
    with caplog.at_level(logging.WARNING, logger="minillm"):
        assert second.generate([PROMPT], PARAMS)[0].token_ids == naive(tiny_model, PROMPT, PARAMS)
    stats = remote_stats(second)
    assert stats["refused"][damage] == 1 and stats["hit_blocks"] == 3  # the blocks before it came
    assert f"({damage} mismatch)" in caplog.text


def test_another_models_blocks_are_never_read(tiny_dir, tiny_model, store, tmp_path):
    other_dir = write_checkpoint(tmp_path / "other", TINY_CONFIG, random_llama_tensors(TINY_CONFIG, seed=1))
    other = engine(other_dir, load_model(other_dir), store.url)
    other.generate([PROMPT], PARAMS)
    written(other, 9)
    client = store.client()
    theirs = set(client.keys(b"minillm:kv:*"))

    ours = engine(tiny_dir, tiny_model, store.url)
    assert ours.generate([PROMPT], PARAMS)[0].token_ids == naive(tiny_model, PROMPT, PARAMS)
    assert client.info("stats")["keyspace_hits"] == 0  # not one of its keys was even found
    assert remote_stats(ours)["blocks_read"] == 0
    written(ours, 9)

    # a value of the other model's forged under our key of the prompt's first block: refused
    first_block = PROMPT[:BLOCK]
    ours_now = set(client.keys(b"minillm:kv:*")) - theirs
    our_key = next(key for key in ours_now if _holds(client, key, first_block))
    their_key = next(key for key in theirs if _holds(client, key, first_block))
    client.set(our_key, client.get(their_key))
    again = engine(tiny_dir, tiny_model, store.url)
    assert again.generate([PROMPT], PARAMS)[0].token_ids == naive(tiny_model, PROMPT, PARAMS)
    stats = remote_stats(again)
    assert stats["refused"]["namespace"] == 1 and stats["hit_blocks"] == 0


def _holds(client, key: bytes, tokens: list[int]) -> bool:
    value = client.get(key)
    return list(struct.unpack_from(f"<{len(tokens)}i", value, HEADER.size)) == tokens


def test_a_full_store_fails_writes_with_one_warning(tiny_dir, tiny_model, tmp_path, caplog):
    with RedisServer(tmp_path, "--maxmemory", "1024", "--maxmemory-policy", "noeviction") as full:
        with caplog.at_level(logging.WARNING, logger="minillm"):
            llm = engine(tiny_dir, tiny_model, full.url)
            for prompt in (PROMPT, PROMPT[:17] + [3] * 16):
                assert llm.generate([prompt], PARAMS)[0].token_ids == naive(tiny_model, prompt, PARAMS)
            wait_until(lambda: remote_stats(llm)["store_errors"] >= 1, what="the OOM reply")
        assert outages(caplog, full.url) == 1 and "maxmemory" in caplog.text  # the OOM reply
        assert remote_stats(llm)["blocks_written"] == 0


def test_a_slow_store_holds_only_the_request_that_waits_for_it(tiny_dir, tiny_model, store, monkeypatch):
    monkeypatch.setattr(remote, "FALLBACK_WAIT_S", 30.0)  # the fetch is waited for, however slow the machine
    first = engine(tiny_dir, tiny_model, store.url)
    first.generate([PROMPT], PARAMS)
    written(first, 9)
    short = [11, 12, 13]  # no full block to ask for: it never waits
    with delay_proxy(store.port, 0.05) as port:
        url = f"redis://127.0.0.1:{port}"
        alone = engine(tiny_dir, tiny_model, url)  # nothing else to run: steps wait, never fail
        assert alone.generate([PROMPT], PARAMS)[0].token_ids == naive(tiny_model, PROMPT, PARAMS)
        assert remote_stats(alone)["hit_blocks"] == 8

        slow = engine(tiny_dir, tiny_model, url).engine
        slow.add_request(PROMPT, PARAMS, request_id="fetching")
        slow.add_request(short, PARAMS, request_id="short")
        slow.add_request(PROMPT, PARAMS, request_id="aborted")
        slow.abort("aborted")
        outputs, stepped_while_held = {}, False
        while slow.has_unfinished_requests():
            held = "fetching" in slow.fetching
            for out in slow.step():
                outputs[out.request_id] = out
                stepped_while_held |= held and out.request_id == "short"
        assert stepped_while_held
        assert outputs["fetching"].token_ids == naive(tiny_model, PROMPT, PARAMS)
        assert outputs["short"].token_ids == naive(tiny_model, short, PARAMS)
        assert "aborted" not in outputs


def test_a_fetch_too_late_is_dropped_and_the_prompt_recomputed(tiny_dir, tiny_model, store, monkeypatch):
    monkeypatch.setattr(remote, "FALLBACK_WAIT_S", 0.0)  # recomputing is always quicker
    first = engine(tiny_dir, tiny_model, store.url)
    first.generate([PROMPT], PARAMS)
    written(first, 9)
    with delay_proxy(store.port, 0.05) as port:
        late = engine(tiny_dir, tiny_model, f"redis://127.0.0.1:{port}")
        assert late.generate([PROMPT], PARAMS)[0].token_ids == naive(tiny_model, PROMPT, PARAMS)
    stats = remote_stats(late)
    assert stats["late_fetches"] == 1 and stats["hit_blocks"] == 0


@pytest.mark.parametrize("url", ["http://x", "redis://", "redis://127.0.0.1:70000", "redis://127.0.0.1"])
def test_a_bad_store_url_is_one_line(tiny_dir, tiny_model, url):
    with pytest.raises(ConfigError) as refused:
        engine(tiny_dir, tiny_model, url)
    assert "redis://HOST:PORT[/DB]" in str(refused.value) and "\n" not in str(refused.value)


def test_the_store_needs_the_prefix_cache(tiny_dir, tiny_model):
    with pytest.raises(ConfigError, match="prefix_caching=True"):
        LLM(tiny_dir, model=tiny_model, remote_kv="redis://127.0.0.1:6379")


def test_an_unreachable_store_warns_once_and_the_engine_serves(tiny_dir, tiny_model, caplog):
    url = f"redis://127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="minillm"):
        llm = engine(tiny_dir, tiny_model, url)
        for prompt in (PROMPT, PROMPT[:13] + [8] * 20):
            assert llm.generate([prompt], PARAMS)[0].token_ids == naive(tiny_model, prompt, PARAMS)
        wait_until(lambda: remote_stats(llm)["store_errors"] >= 1, what="the refused connection")
    assert outages(caplog, url) == 1


def test_a_full_write_queue_drops_writes_and_never_blocks(tiny_dir, tiny_model, store, monkeypatch):
    monkeypatch.setattr(remote, "WRITE_QUEUE", 0)
    llm = engine(tiny_dir, tiny_model, store.url)
    assert llm.generate([PROMPT], PARAMS)[0].token_ids == naive(tiny_model, PROMPT, PARAMS)
    stats = remote_stats(llm)
    assert stats["dropped_writes"] == 9 and stats["blocks_written"] == 0
