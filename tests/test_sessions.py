"""Sessions: a conversation's KV parked in a file and resumed by another engine (another run)
gives the tokens naive decoding gives, computing only the new turn; a file from another model,
block size or KV format, or a damaged one, is refused in one line."""

import errno
import json
import random
import re

import pytest
import torch
from helpers import TINY_CONFIG, free_and_intact, random_llama_tensors, write_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file

from minillm.cli import main
from minillm.decoding import generate
from minillm.engine import LLM, SamplingParams
from minillm.memory import SessionError
from minillm.weights import load_model

BLOCK = 4
POOL = dict(
    block_size=BLOCK, prefix_caching=True, kv_cache_bytes=64 * BLOCK * 768
)  # 64 blocks: quick to build


def conversation(seed, length=30, vocab=97):
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def park(tiny_dir, tiny_model, path, **switches):
    """Run the first turn and park it; return the tokens of the whole turn (prompt and reply)."""
    llm = LLM(tiny_dir, model=tiny_model, **{**POOL, **switches})
    prompt = conversation(1)
    out = llm.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True))[0]
    turn = prompt + out.token_ids
    kept = llm.engine.save_session(path, turn, extra={"note": "hi"})
    # every computed full block (the last token has no KV yet)
    assert kept == (len(turn) - 1) // BLOCK * BLOCK
    return turn


@pytest.mark.parametrize("switches", [{}, {"kv_dtype": "int8"}, {"kv_dtype": "int4"}])
def test_a_resumed_session_computes_only_the_new_turn(tiny_dir, tiny_model, tmp_path, switches):
    path = tmp_path / "chat.safetensors"
    turn = park(tiny_dir, tiny_model, path, **switches)
    resumed = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True, **switches)
    token_ids, extra = resumed.engine.load_session(path)
    assert token_ids == turn[: len(token_ids)] and extra == {"note": "hi"}
    next_prompt = turn + conversation(2, length=6)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    out = resumed.generate([next_prompt], params)[0]
    fresh = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, **switches).generate([next_prompt], params)[0]
    assert out.token_ids == fresh.token_ids  # bit for bit what computing the history again gives
    if not switches:
        assert out.token_ids == generate(tiny_model, next_prompt, params, "naive").token_ids
    assert resumed.engine.snapshot().prefix_cache["hit_blocks"] * BLOCK == len(
        token_ids
    )  # the whole parked history was reused
    assert resumed.engine.stats.tokens_computed == len(next_prompt) - len(token_ids) + 7


def test_a_session_is_refused_by_another_block_size_format_or_model(tiny_dir, tiny_model, tmp_path):
    path = tmp_path / "chat.safetensors"
    park(tiny_dir, tiny_model, path)
    for switches, field in [({"block_size": 8}, "block_size"), ({"kv_dtype": "int8"}, "kv_dtype")]:
        other = LLM(tiny_dir, model=tiny_model, prefix_caching=True, **{"block_size": BLOCK, **switches})
        with pytest.raises(SessionError, match=f"written with {field}="):
            other.engine.load_session(path)
    other_dir = write_checkpoint(tmp_path / "other", TINY_CONFIG, random_llama_tensors(TINY_CONFIG, seed=1))
    other = LLM(other_dir, model=load_model(other_dir), block_size=BLOCK, prefix_caching=True)
    with pytest.raises(SessionError, match="written with model="):
        other.engine.load_session(path)


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-5],
        lambda data: data[:-1] + bytes([data[-1] ^ 1]),
        lambda data: b"not a session at all",
    ],
)
def test_a_damaged_session_file_is_refused_in_one_line(tiny_dir, tiny_model, tmp_path, damage):
    path = tmp_path / "chat.safetensors"
    park(tiny_dir, tiny_model, path)
    path.write_bytes(damage(path.read_bytes()))
    llm = LLM(tiny_dir, model=tiny_model, block_size=BLOCK, prefix_caching=True)
    with pytest.raises(SessionError) as refused:
        llm.engine.load_session(path)
    assert "\n" not in str(refused.value) and "delete it" in str(refused.value)
    assert free_and_intact(llm.engine)


def rewritten(path, change):
    """The session file written again with `change` applied to its tensors and metadata, its
    recorded checksum kept: what an edit by hand, or damage that safetensors still reads, leaves."""
    with safe_open(path, "pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    change(tensors, metadata)
    save_file(tensors, path, metadata=metadata)


def edit_messages(tensors, metadata):
    metadata["extra"] = json.dumps({"note": "something else"})


def reinterpret_token_ids(tensors, metadata):
    tensors["token_ids"] = tensors["token_ids"].view(torch.float64)  # the very same bytes


def reshape_a_block(tensors, metadata):
    name = next(name for name in tensors if name.startswith("block.0."))
    tensors[name] = tensors[name].reshape(-1)


@pytest.mark.parametrize("change", [edit_messages, reinterpret_token_ids, reshape_a_block])
def test_the_checksum_covers_everything_the_file_holds(tiny_dir, tiny_model, tmp_path, change):
    path = tmp_path / "chat.safetensors"
    park(tiny_dir, tiny_model, path)
    rewritten(path, change)
    llm = LLM(tiny_dir, model=tiny_model, **POOL)
    with pytest.raises(SessionError, match="is damaged \\(checksum mismatch\\); delete it"):
        llm.engine.load_session(path)


@pytest.mark.parametrize("failing", ["os.replace", "os.fsync"])
def test_a_failed_write_leaves_the_parked_session_whole_and_no_temporary_file(
    tiny_dir, tiny_model, tmp_path, monkeypatch, failing
):
    """A crash before the rename (or a full disk that fsync finds) must not cost the old session."""
    path, llm = tmp_path / "chat.safetensors", LLM(tiny_dir, model=tiny_model, **POOL)
    prompt = conversation(1)
    turn = prompt + llm.generate([prompt], SamplingParams(max_tokens=9, ignore_eos=True))[0].token_ids
    llm.engine.save_session(path, turn)
    parked = path.read_bytes()

    def fail(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(failing, fail)
    with pytest.raises(SessionError) as refused:
        llm.engine.save_session(path, turn, extra={"note": "a later turn"})
    assert str(refused.value) == (
        f"Session file {path} cannot be written (No space left on device); "
        "free some space or write it to another folder."
    )
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == parked


def chat(monkeypatch, capsys, real_dir, folder, lines, *flags):
    feed = iter(lines)
    monkeypatch.setattr("minillm.report.console.input", lambda prompt="": next(feed))
    code = main(
        [
            "chat",
            "--max-tokens",
            "6",
            "--model",
            str(real_dir),
            "--session",
            "notes",
            "--sessions-dir",
            str(folder),
            *flags,
        ]
    )
    out, err = capsys.readouterr()
    return code, " ".join(out.split()), err


@pytest.mark.slow  # a program started as a user starts it (7-12 s); in-process tests cover it
def test_cli_chat_session_survives_a_restart(monkeypatch, capsys, real_dir, tmp_path):
    code, out, _ = chat(monkeypatch, capsys, real_dir, tmp_path, ["Name a color.", "/exit"])
    assert code == 0 and "parked session notes" in out
    code, out, _ = chat(monkeypatch, capsys, real_dir, tmp_path, ["/sessions", "And a fruit?", "/exit"])
    assert code == 0 and "resumed session notes: 2 messages" in out and "│ notes │" in out
    reused = int(re.search(r"(\d+) of \d+ prompt tokens came from the session", out).group(1))
    assert reused >= 32  # the first turn's full blocks, read from disk instead of recomputed
    code, _, err = chat(monkeypatch, capsys, real_dir, tmp_path, ["/exit"], "--kv-dtype", "int8")
    assert code == 2 and err.count("\n") == 1 and "written with kv_dtype='auto'" in err
    code, _, err = chat(monkeypatch, capsys, real_dir, tmp_path / "x", ["/exit"], "--session", "../up")
    assert code == 2 and "Session name '../up'" in err
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    code, out, _ = chat(monkeypatch, capsys, real_dir, a_file, ["Hi.", "/exit"])
    assert code == 0 and "was not parked" in out  # the reply stands; one line says why nothing was kept


WRITER = """
import sys, torch
from pathlib import Path
from minillm.memory.sessions import write_whole
path = Path(sys.argv[1])
for version in range(10**9):  # until killed
    tensors = {"block.0.k": torch.full((2 * 2**20,), float(version))}  # 8 MB, every number the version
    write_whole(path, tensors, {"version": str(version)})
"""


@pytest.mark.parametrize("after_versions", [1, 3, 6])
def test_a_writer_killed_mid_write_leaves_a_whole_session_file(tmp_path, after_versions):
    """kill -9 of a process rewriting a session file over and over, once it has written a few: the
    file at the path is always one whole version (its numbers all that version), never a mix or a
    cut; only the killed write's hidden temporaries (its own, and safetensors') may be left beside it."""
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "chat.safetensors"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)])
    try:
        version, deadline = -1, time.monotonic() + 60
        while version < after_versions:
            assert writer.poll() is None, "the writer stopped by itself"
            assert time.monotonic() < deadline, f"the writer reached version {version} only, in 60 s"
            time.sleep(0.01)
            if path.exists():
                with safe_open(path, "pt") as whole:
                    version = int(whole.metadata()["version"])
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    with safe_open(path, "pt") as whole:
        version, numbers = int(whole.metadata()["version"]), whole.get_tensor("block.0.k")
    assert version >= after_versions and bool((numbers == version).all())
    leftovers = {p.name for p in tmp_path.iterdir()} - {path.name}
    assert all(name.startswith(".") for name in leftovers), leftovers  # the killed write's temporaries
