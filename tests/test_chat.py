"""The chat REPL: /set keeps the conversation and changes the engine, /compare answers as fresh
engines do, the memory view counts what the engine counts, a bad command is one line and the
chat goes on, and without a terminal there is no live panel and no escape code.

A tiny random model with the real tokenizer (and an untied output layer, so that its replies do
not repeat one token) keeps these fast; what it says is noise, but noise is exact."""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from helpers import heard_snapshot, set_chat_template, tiny_with_real_tokenizer
from rich.console import Console
from safetensors import SafetensorError
from upstream import upstream_file

import minillm.chat.view
from minillm.chat import Chat
from minillm.chat.compare import first_difference
from minillm.chat.view import STATES, state_counts, summary_lines
from minillm.config import SWITCHES
from minillm.engine import LLM, SamplingParams
from minillm.memory.block_ledger import tier_of
from minillm.memory.pool import bytes_per_slot
from minillm.tokenizer import Tokenizer
from minillm.weights import load_model

REPO = Path(__file__).parent.parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
POOL = dict(prefix_caching=True, kv_cache_bytes=96 * 16 * 768)  # 96 blocks of the tiny model's fp32 KV


@pytest.fixture(scope="module")
def chat_dir(real_dir, tmp_path_factory) -> Path:
    return tiny_with_real_tokenizer(
        tmp_path_factory.mktemp("tiny-chat"), real_dir, max_position_embeddings=1024
    )


@pytest.fixture(scope="module")
def parts(chat_dir):
    return load_model(chat_dir), Tokenizer(chat_dir)


def fresh_llm(chat_dir, parts, **switches) -> LLM:
    model, tokenizer = parts
    return LLM(chat_dir, model=model, tokenizer=tokenizer, **{**POOL, **switches})


def new_chat(chat_dir, parts, console=None, sessions_dir=None, session=None, **switches) -> Chat:
    console = console or Console(file=io.StringIO(), width=80)
    return Chat(
        fresh_llm(chat_dir, parts, **switches),
        SamplingParams(max_tokens=24),
        None,
        session=session,
        sessions_dir=sessions_dir or Path("."),
        console=console,
    )


def printed(chat: Chat) -> str:
    return chat.console.file.getvalue()


def test_set_keeps_the_conversation_and_rebuilds_the_engine(chat_dir, parts):
    chat = new_chat(chat_dir, parts)
    chat.reply("Say hello.")
    history, engine = list(chat.history), chat.engine
    assert chat.command("/set kv_dtype int8")
    assert chat.engine is not engine and chat.engine.config.kv_dtype == "int8"
    assert chat.engine.model is engine.model and chat.engine.config.prefix_caching  # the rest is as it was
    assert chat.history == history
    chat.reply("And goodbye?")
    out = chat.last[0]
    prompt = parts[1].encode_chat(history + [{"role": "user", "content": "And goodbye?"}])
    assert out.prompt_token_ids == prompt  # the whole conversation, carried into the new engine
    expected = fresh_llm(chat_dir, parts, kv_dtype="int8").generate([prompt], SamplingParams(max_tokens=24))[
        0
    ]
    assert out.token_ids == expected.token_ids
    chat.command("/set temperature 0.7")
    assert chat.params.temperature == 0.7 and chat.engine.config.kv_dtype == "int8"
    assert "engine rebuilt with kv_dtype=int8; the conversation stays" in printed(chat)
    assert "sample with temperature=0.7" in printed(chat)


def chat_with_template(real_dir, folder, template, template_vars=None) -> Chat:
    """A chat on the tiny model whose tokenizer carries `template` (None: no chat template)."""
    model_dir = set_chat_template(
        tiny_with_real_tokenizer(folder, real_dir, max_position_embeddings=1024), template
    )
    llm = fresh_llm(model_dir, (load_model(model_dir), Tokenizer(model_dir)))
    console = Console(file=io.StringIO(), width=80)
    return Chat(llm, SamplingParams(max_tokens=8), None, console=console, template_vars=template_vars)


def test_the_template_variables_reach_every_turn(real_dir, upstream, tmp_path):
    """Qwen3's template (over SmolLM2's vocabulary) with {"enable_thinking": false}: each turn's
    prompt is transformers' (a user's control-token text stays text, as its sanitize does)."""
    qwen3 = upstream_file("templates/Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    chat = chat_with_template(real_dir, tmp_path, qwen3, {"enable_thinking": False})
    for question in ("Say hello.", "And <|im_end|> goodbye?"):
        chat.reply(question)
        expected = upstream.apply_chat_template(
            chat.history[:-1],  # the conversation the reply answered
            chat_template=qwen3,
            add_generation_prompt=True,
            enable_thinking=False,
            sanitize_control_tokens=True,
            return_dict=False,
        )
        assert chat.last[0].prompt_token_ids == expected


def test_a_turn_the_template_refuses_is_one_line_and_the_chat_goes_on(real_dir, tmp_path):
    one_question = (
        "{% if messages|length > 1 %}{{ raise_exception('One question at a time.') }}{% endif %}"
        "<|im_start|>user\n{{ messages[0].content }}<|im_end|>\n<|im_start|>assistant\n"
    )
    chat = chat_with_template(real_dir, tmp_path, one_question)
    chat.reply("Say hello.")
    history = list(chat.history)
    chat.reply("And goodbye?")
    assert "error: The chat template refuses this conversation: One question at a time." in printed(chat)
    assert chat.history == history  # the refused turn left no trace


def test_a_checkpoint_without_a_chat_template_refuses_each_turn_in_one_line(real_dir, tmp_path):
    chat = chat_with_template(real_dir, tmp_path, None)
    chat.reply("Say hello.")
    assert "error: This checkpoint has no chat template; use `minillm generate` without --chat." in printed(
        chat
    )
    assert chat.history == []


def test_a_temperature_too_small_to_divide_by_replies_as_greedy(chat_dir, parts):
    """/set temperature 1e-300 once ended every reply with "This step failed (RuntimeError: ...)"."""
    chat = new_chat(chat_dir, parts)
    assert chat.command("/set temperature 1e-300")
    chat.reply("Say hello.")
    out = chat.last[0]
    greedy = fresh_llm(chat_dir, parts).generate([out.prompt_token_ids], SamplingParams(max_tokens=24))[0]
    assert out.error is None and out.token_ids == greedy.token_ids and "error" not in printed(chat)


@pytest.mark.parametrize(
    "switch, changes",
    [
        ("block_size 4", {"block_size": 4}),
        ("prefix_caching off", {"prefix_caching": False}),
        ("speculative ngram", {"speculative": "ngram"}),
        ("kv_dtype int4", {"kv_dtype": "int4"}),
        ("eviction window 16", {"eviction": "window", "kv_budget": 16}),
    ],
)
def test_compare_answers_as_two_fresh_engines_do(chat_dir, parts, switch, changes):
    chat = new_chat(chat_dir, parts)
    chat.reply("Say hello.")
    chat.command(f"/compare {switch}")
    prompt, params = chat.last[0].prompt_token_ids, SamplingParams(max_tokens=24)
    now = fresh_llm(chat_dir, parts).generate([prompt], params)[0].token_ids
    changed = fresh_llm(chat_dir, parts, **changes).generate([prompt], params)[0].token_ids
    said = " ".join(printed(chat).split())
    index = first_difference(now, changed)
    if "kv_dtype" in changes or "eviction" in changes:  # lossy: they part, and the chat says where
        assert index is not None and f"first differs at token {index}:" in said
    else:  # lossless: the very same tokens
        assert index is None and f"identical: all {len(now)} tokens are the same" in said
    assert f"tokens │ {len(now)} │ {len(changed)} │" in said


def test_compare_a_sampling_switch_changes_only_the_sampling(chat_dir, parts):
    chat = new_chat(chat_dir, parts)
    chat.reply("Say hello.")
    chat.command("/compare temperature 1.5 ")  # the seed is unset: the text differs from run to run
    assert "/compare temperature (lossy)" in printed(chat) and chat.params.temperature == 0


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_block_map_counts_equal_the_engines_memory_stats(chat_dir, parts, kv_dtype):
    """Mid-reply and after it, with a small pool whose cached blocks spill to a host tier (every
    one of them: the rule that spills only reused blocks may leave the host row empty here)."""
    per_block = 16 * bytes_per_slot(parts[0].config, kv_dtype, "channel", 16, parts[0].dtype)
    pools = {"kv_cache_bytes": 12 * per_block, "host_cache_bytes": 8 * per_block}
    chat = new_chat(chat_dir, parts, **pools, kv_dtype=kv_dtype, spill="all")
    engine = chat.engine
    filling_seen = 0
    for turn in range(3):
        prompt = parts[1].encode_chat([{"role": "user", "content": f"Question {turn}: " + "why? " * 30}])
        for step, out in enumerate(chat.llm.stream(prompt, SamplingParams(max_tokens=20, ignore_eos=True))):
            if step % 7 == 3 or out.finished:
                tiers, stats = engine.snapshot().blocks, engine.memory_stats()
                device, host = state_counts(tiers["device"]), state_counts(tiers["host"])
                assert (device["private"] + device["filling"] + device["shared"]) * 16 == stats.reserved_slots
                assert (device["free"] + device["cached"]) * 16 == stats.total_slots - stats.reserved_slots
                state = heard_snapshot(engine)  # the prefix cache's entries, and who holds which block
                held = Counter(block for table in state.tables.values() for block in table)
                tiers_of = [tier_of(block, state.num_blocks, state.host_blocks) for block, *_ in state.cached]
                assert device["cached"] == sum(
                    tier == "device" and not held[block] for tier, (block, *_) in zip(tiers_of, state.cached)
                )
                assert device["filling"] <= 1 and (kv_dtype != "auto" or device["filling"] == 0)
                filling_seen += device["filling"]
                assert (host["private"] + host["shared"]) * 16 == stats.host_reserved_slots
                assert host["cached"] == tiers_of.count("host")
                lines = summary_lines(engine, minillm.chat.view.ReplyMeter())
                names = ", ".join(
                    f"{device[s]:,} {name}"
                    for s, (_, _, name) in STATES.items()
                    if s != "filling" or device[s]
                )
                assert lines[0] == f"blocks: {names} of 12"
                swapped = host["private"] + host["shared"]
                assert lines[1].startswith(f"host: {swapped} swapped out, {host['cached']} spilled")
    assert engine.snapshot().counters["spilled"] > 0  # the host row had something to show
    assert (filling_seen > 0) == (kv_dtype != "auto")  # an int8 reply's last block fills in full precision


def test_save_and_load_carry_the_conversation_and_its_kv(chat_dir, parts, tmp_path):
    chat = new_chat(chat_dir, parts, sessions_dir=tmp_path)
    chat.reply("Name a color.")
    chat.command("/save notes")
    assert (tmp_path / "notes.safetensors").exists() and "parked session notes" in printed(chat)
    other = new_chat(chat_dir, parts, sessions_dir=tmp_path)
    other.command("/load notes")
    assert other.history == chat.history
    other.reply("And a fruit?")
    assert other.last[1].reused_tokens >= 32  # the first turn's full blocks came from the file


def last_line(chat: Chat) -> str:
    return printed(chat).rstrip("\n").rpartition("\n")[2]


def test_a_refused_load_leaves_the_session_and_never_overwrites_another(chat_dir, parts, tmp_path):
    """Session a parked with full-precision KV; a chat on int8 KV as session b asks for it."""
    first = new_chat(chat_dir, parts, sessions_dir=tmp_path)
    first.reply("Name a color.")
    first.command("/save a")
    parked_a = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "broken.safetensors").write_bytes(b"not a session at all")
    chat = new_chat(chat_dir, parts, session=tmp_path / "b.safetensors", kv_dtype="int8")
    chat.reply("Name a fruit.")
    history = list(chat.history)
    for name, refusal in [("a", "written with kv_dtype='auto'"), ("broken", "cannot be read")]:
        assert chat.command(f"/load {name}")
        assert last_line(chat).startswith("error: ") and refusal in last_line(chat)
        assert chat.session == tmp_path / "b.safetensors" and chat.history == history
    chat.park()  # what the end of the chat does
    assert (tmp_path / "a.safetensors").read_bytes() == parked_a
    _, extra = fresh_llm(chat_dir, parts, kv_dtype="int8").engine.load_session(tmp_path / "b.safetensors")
    assert extra["messages"] == history


def test_load_parks_the_conversation_it_replaces(chat_dir, parts, tmp_path):
    first = new_chat(chat_dir, parts, sessions_dir=tmp_path)
    first.reply("Name a color.")
    first.command("/save a")
    chat = new_chat(chat_dir, parts, session=tmp_path / "b.safetensors")
    chat.reply("Name a fruit.")
    history = list(chat.history)
    chat.command("/load a")
    assert chat.session == tmp_path / "a.safetensors" and chat.history == first.history
    _, extra = fresh_llm(chat_dir, parts).engine.load_session(tmp_path / "b.safetensors")
    assert extra["messages"] == history


def failing_write(reason: str):
    """safetensors' save_file as it fails when the folder is read-only or the disk is full."""

    def save_file(*args, **kwargs):
        raise SafetensorError(f"Error while serializing: I/O error: {reason}")

    return save_file


@pytest.mark.parametrize(
    "case",
    ["a 300-character name", "a dangling link", "a read-only folder", "a full disk"],
)
def test_every_failed_save_or_load_is_one_line_and_the_chat_goes_on(
    chat_dir, parts, tmp_path, monkeypatch, case
):
    """The session, its file and the conversation stay as they were, and the chat still answers."""
    chat = new_chat(chat_dir, parts, session=tmp_path / "notes.safetensors")
    chat.reply("Name a color.")
    chat.command("/save")
    parked = (tmp_path / "notes.safetensors").read_bytes()
    if case == "a 300-character name":
        commands, said = ["/save " + "x" * 300, "/load " + "x" * 300], "is 300 bytes long"
    elif case == "a dangling link":
        (tmp_path / "gone.safetensors").symlink_to(tmp_path / "nowhere" / "gone.safetensors")
        commands, said = ["/load gone", "/sessions"], "unreadable"
    else:
        reason, code = (
            ("Read-only file system", 30) if "read-only" in case else ("No space left on device", 28)
        )
        monkeypatch.setattr("minillm.memory.sessions.save_file", failing_write(f"{reason} (os error {code})"))
        commands, said = ["/save other", "/save"], f"cannot be written ({reason}); free some space"
    history = list(chat.history)
    for command in commands:
        assert chat.command(command)
    assert said in printed(chat)
    if case != "a dangling link":
        assert last_line(chat).startswith("error: ")
    assert chat.session == tmp_path / "notes.safetensors" and chat.history == history
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "gone.safetensors") == ["notes.safetensors"]
    assert (tmp_path / "notes.safetensors").read_bytes() == parked  # no temporary file left, the file whole
    chat.park()
    assert last_line(chat).startswith(("error: session notes was not parked", "parked session notes"))
    chat.reply("And a fruit?")
    assert chat.last[0].finish_reason != "error"


@pytest.mark.slow  # a program started as a user starts it (7-12 s); in-process tests cover it
def test_bad_commands_are_one_line_and_the_chat_goes_on_without_a_terminal(chat_dir, tmp_path):
    """Piped input and output, as in CI: every mistake is one `error:` line, the chat answers
    afterwards, and nothing is drawn live: no escape codes, no panel."""
    bad = [
        "/set",
        "/set foo 1",
        "/set kv_dtype int9",
        "/set block_size 0",
        "/set block_size x",
        "/set kv_budget 5",
        "/set eviction h2o",
        "/set temperature -1",
        "/compare block_size 8",
        "/compare live off",
        "/bogus",
        "/load nosuch",
        "/load ../up",
        "/save",
    ]
    lines = bad + ["Say hello.", "/compare kv_cache_mb 0", "/stats", "/memory", "/help", "/exit"]
    forcing = ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")  # would make rich colour a pipe
    env = {
        **{k: v for k, v in os.environ.items() if k not in forcing},
        "PYTHONPATH": str(REPO),
        "COLUMNS": "80",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "minillm.cli",
            "chat",
            "--model",
            str(chat_dir),
            "--max-tokens",
            "8",
            "--sessions-dir",
            str(tmp_path),
        ],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0 and done.stderr == ""
    answers = done.stdout.split("you> ")[1:]  # what each line got
    for line, said in zip(bad + [None, "/compare kv_cache_mb 0"], answers):
        if line:
            assert said.startswith("error: ") and said.count("\n") == 1, (line, said)
    assert "blocks: " in answers[len(bad)] and "first token" in answers[len(bad)]  # a reply, then plain lines
    assert "KV pool:" in answers[len(bad) + 3] and "/compare SWITCH VALUE" in answers[len(bad) + 4]
    assert not ANSI.search(done.stdout) and "╭" not in done.stdout  # no colour, no live panel


@pytest.mark.parametrize("columns", [80, 60])
def test_the_live_panel_is_drawn_in_a_terminal_within_its_columns(chat_dir, parts, monkeypatch, columns):
    monkeypatch.setattr(minillm.chat.view, "REDRAW_SECONDS", 0.0)  # draw on every token
    console = Console(file=io.StringIO(), width=columns, height=30, force_terminal=True)
    chat = new_chat(chat_dir, parts, console=console)
    chat.reply("Say hello " * 40)
    drawn = ANSI.sub("", printed(chat))
    panels = drawn.count("╭─ KV pool: 96 blocks x 16 tokens, float32")
    assert panels >= len(chat.last[0].token_ids) - 1  # redrawn as tokens came
    assert all(len(line) <= columns for line in re.split(r"[\r\n]", drawn))
    reply = " ".join(parts[1].decode(chat.last[0].token_ids).split())
    assert reply[:20] in " ".join(drawn.split())  # the reply stays once the panel goes
    chat.command("/set live off")
    chat.reply("Again.")
    assert ANSI.sub("", printed(chat)).count("╭─ KV pool") == panels


def test_bench_chat_view_times_both_views(capsys, chat_dir):
    from minillm.cli import main

    assert (
        main(["bench", "chat-view", "--json", "--rounds", "2", "--tokens", "4", "--model", str(chat_dir)])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    for view in ("live", "plain"):
        assert len(report[view]["samples_tok_s"]) == 2 and report[view]["tok_s"] > 0
    assert report["slowdown"] == pytest.approx(1 - report["live"]["tok_s"] / report["plain"]["tok_s"])
    assert report["panel_draw_ms"] > 0


def test_launch_flags_reach_the_engines_config(chat_dir, monkeypatch):
    """`minillm chat --admission ... --eviction ... --eviction-trigger ... --preemption ...`."""
    from minillm.cli import main

    started = []
    monkeypatch.setattr(Chat, "run", lambda chat, model_name: started.append(chat.engine.config))
    flags = ["--admission", "memory", "--eviction", "h2o", "--kv-budget", "256", "--eviction-trigger"]
    flags += ["pressure", "--host-cache-mb", "1", "--preemption", "swap"]
    assert main(["chat", *flags, "--model", str(chat_dir)]) == 0
    config = started[0]
    assert (config.admission, config.eviction, config.kv_budget) == ("memory", "h2o", 256)
    assert (config.eviction_trigger, config.preemption, config.host_cache_bytes) == (
        "pressure",
        "swap",
        2**20,
    )
    assert config.prefix_caching  # the chat's own choice stays


@pytest.mark.parametrize("admission", SWITCHES["admission"].choices)
def test_set_admission_eviction_trigger_and_preemption_reach_the_engine(chat_dir, parts, admission):
    chat = new_chat(chat_dir, parts, host_cache_bytes=1 << 20)
    chat.reply("Say hello.")
    for command in (f"/set admission {admission}", "/set eviction h2o 64", "/set eviction_trigger pressure"):
        assert chat.command(command)
    assert chat.command("/set preemption swap")
    config = chat.engine.config
    assert (config.admission, config.eviction, config.kv_budget) == (admission, "h2o", 64)
    assert (config.eviction_trigger, config.preemption) == ("pressure", "swap")
    assert f"engine rebuilt with admission={admission}" in printed(chat) and "error" not in printed(chat)
    chat.reply("And goodbye?")  # the rebuilt engine answers, the conversation carried
    assert chat.last[0].finish_reason != "error" and len(chat.history) == 4


@pytest.mark.parametrize(
    "command, said",
    [
        (
            "/set admission nope",
            "error: admission 'nope': give one of " + ", ".join(SWITCHES["admission"].choices),
        ),
        ("/set eviction_trigger later", "error: eviction_trigger 'later': give one of always, pressure"),
        ("/set eviction_trigger pressure", "error: eviction_trigger only applies with eviction"),
        ("/set preemption swap", "error: preemption='swap' needs somewhere to swap to"),
        ("/set preemption", "error: preemption needs a value: recompute|swap|auto"),
    ],
)
def test_a_bad_admission_trigger_or_preemption_is_one_line_and_changes_nothing(
    chat_dir, parts, command, said
):
    chat = new_chat(chat_dir, parts)
    engine = chat.engine
    assert chat.command(command)
    assert last_line(chat).startswith(said) and printed(chat).count("\n") == 1, printed(chat)
    assert chat.engine is engine  # not rebuilt


def test_a_bad_launch_flag_is_one_line(chat_dir, capsys):
    from minillm.cli import main

    assert main(["chat", "--admission", "nope", "--model", str(chat_dir)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: minillm chat: argument --admission: invalid choice: 'nope'")
        and err.count("\n") == 1
    )
    assert main(["chat", "--preemption", "swap", "--model", str(chat_dir)]) == 2  # no tier to swap to
    err = capsys.readouterr().err
    assert err.startswith("error: preemption='swap' needs somewhere to swap to") and err.count("\n") == 1


def test_why_says_where_the_last_prompts_prefix_hit_ended(chat_dir, parts):
    chat = new_chat(chat_dir, parts)
    chat.command("/why")
    assert "no reply yet" in printed(chat)
    chat.reply("Say hello.")
    chat.reply("And once more, please.")  # the first turn's blocks are cached: the second finds them
    chat.command("/why")
    miss = chat.last[0].prefix_miss
    assert miss.cached_tokens > 0 and miss.cause in ("hit", "diverged")
    assert f"{miss.cached_tokens} of {miss.cacheable_tokens} cacheable prompt tokens" in " ".join(
        printed(chat).split()
    )


# ----------------------------------------------------------------------------- signals


def scripted(chat: Chat, lines: list, monkeypatch) -> None:
    """The chat reads `lines` at its prompt; a signal number among them is sent to this process
    there instead (while the chat waits for input)."""
    feed = iter(lines)

    def read(prompt: str) -> str:
        line = next(feed)
        if isinstance(line, signal.Signals):
            os.kill(os.getpid(), line)
            time.sleep(5)  # the handler stops this wait; never reached
            raise AssertionError(f"{line.name} did not stop the prompt")
        return line

    monkeypatch.setattr(chat.console, "input", read)


def signal_in_reply(chat: Chat, signum: int, after: int, monkeypatch) -> None:
    """The next reply's stream sends `signum` to this process after `after` outputs: the handler
    runs in this thread, the main one, between two of the stream's steps."""
    stream = chat.llm.stream

    def stream_then_signal(prompt_ids, params):
        for i, out in enumerate(stream(prompt_ids, params)):
            if i == after:
                os.kill(os.getpid(), signum)
            yield out

    monkeypatch.setattr(chat.llm, "stream", stream_then_signal)


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_ctrl_c_stops_the_reply_and_the_chat_goes_on(chat_dir, parts, monkeypatch, inherited):
    """Whatever SIGINT was (ignored, as a background job inherits it), Ctrl-C during a reply stops
    it after a step: its request is aborted, every block back, what it said kept; the next line
    is answered; Ctrl-C at the prompt ends the chat, and the disposition is put back."""
    chat = new_chat(chat_dir, parts)
    chat.params = SamplingParams(max_tokens=200, ignore_eos=True)
    signal_in_reply(chat, signal.SIGINT, 3, monkeypatch)
    scripted(chat, ["Count to a hundred.", "And now?", signal.SIGINT], monkeypatch)
    before = signal.signal(signal.SIGINT, inherited)
    try:
        chat.run("tiny")
        assert signal.getsignal(signal.SIGINT) is inherited
    finally:
        signal.signal(signal.SIGINT, before)
    assert [m["role"] for m in chat.history] == ["user", "assistant"] * 2
    assert printed(chat).count("reply stopped after 4 tokens") == 2  # both replies: 4 steps, 1 token each
    assert chat.history[3]["content"] == chat.last[0].text != ""
    assert not chat.engine.has_unfinished_requests()
    snapshot = chat.engine.snapshot()
    assert snapshot.num_free_blocks == snapshot.num_blocks, "the stopped requests' blocks went back"


@pytest.mark.parametrize("where", ["in a reply", "at the prompt"])
def test_sigterm_ends_the_chat_and_parks_its_session(chat_dir, parts, tmp_path, monkeypatch, where):
    session = tmp_path / "work.safetensors"
    chat = new_chat(chat_dir, parts, sessions_dir=tmp_path, session=session)
    chat.params = SamplingParams(max_tokens=64, ignore_eos=True)
    if where == "in a reply":
        signal_in_reply(chat, signal.SIGTERM, 2, monkeypatch)
        scripted(chat, ["Tell me a story.", "never read"], monkeypatch)
    else:
        scripted(chat, ["Tell me a story.", signal.SIGTERM, "never read"], monkeypatch)
    chat.run("tiny")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert session.exists() and "parked session work" in printed(chat)
    replied = len(chat.last[0].token_ids)
    assert replied == (3 if where == "in a reply" else 64)
    resumed = new_chat(chat_dir, parts, sessions_dir=tmp_path)
    resumed.command("/load work")
    assert resumed.history == chat.history
