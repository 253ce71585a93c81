"""`minillm chat`: a multi-turn conversation in the terminal, with its KV memory in view.

A chat model has no memory between turns: every turn's prompt is the whole conversation so far,
rendered by the chat template, so the prompt grows with each turn. Run on the serving engine with
the prefix cache on, the KV blocks an earlier turn computed are found in the cache, and only the
newest turn is prefilled. While a reply streams, a panel below it draws the KV pool block by
block (`view.py`): which blocks this conversation holds, which are shared with the prefix
cache, which wait cached for a later prompt, which are free; bytes per token, prefix tokens
reused, time to first token and tokens per second. Without a terminal the same numbers come as
plain lines after each reply.

Commands change the engine while the conversation stays: `/set kv_dtype int8` rebuilds it with
int8 KV (the next reply prefills the conversation again into the new pool); `/compare kv_dtype
int4` answers the last prompt on two fresh engines, as now and changed (`compare.py`; the switches
are `switches.py`'s); `/memory` draws every block; `/save` and `/load` park and resume the
conversation (`sessions.py`).

Signals keep a terminal's meaning, whatever the process inherited (`stop_signals.py`): Ctrl-C
stops the reply streaming (after the step in flight; the engine is never cut mid-step, and what
was said stays in the conversation) or the command running, and at the prompt ends the chat;
SIGTERM ends the chat the same way, the session parked first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from minillm.chat.compare import Answer, answer, comparison_table, difference_line
from minillm.chat.sessions import DEFAULT_SESSIONS_DIR, SessionCommands
from minillm.chat.switches import SETTINGS, Setting, parse_setting
from minillm.chat.view import LiveView, ReplyMeter, full_map, stats_line, summary_lines
from minillm.config import ConfigError
from minillm.report import console as default_console
from minillm.stop_signals import handling_stop_signals

COMMANDS = {  # command -> (its arguments, what it does); /help prints them in this order
    "/set": ("SWITCH VALUE", "change a switch; the engine is rebuilt if it must be, the conversation stays"),
    "/compare": ("SWITCH VALUE", "answer the last prompt again with the switch changed, side by side"),
    "/memory": ("", "every KV block, per tier, and the engine's accounting"),
    "/stats": ("", "the last reply: prompt reuse, first token, decode speed, KV memory"),
    "/why": ("", "why the last prompt's prefix-cache hit ended where it did (the token it parted at)"),
    "/save": ("[NAME]", "park the conversation (KV and messages) as session NAME"),
    "/load": ("NAME", "resume session NAME (parking this one first): its messages, its KV as cached blocks"),
    "/sessions": ("", "list the parked sessions"),
    "/reset": ("", "clear the conversation"),
    "/help": ("", "this list, and the switches"),
    "/exit": ("", "quit (parking the --session, if there is one)"),
}
CHAT_HELP = (
    "Commands: /set, /compare, /memory, /stats, /save, /load, /sessions, /reset, /help, /exit; "
    "a panel shows the KV pool while a reply streams."
)


# ----------------------------------------------------------------------------- the chat
class Chat(SessionCommands):
    """One conversation on `llm`, an `LLM` (prefix caching on, normally); it owns the history.
    `live`: draw the memory panel while replies stream, when the console is a terminal.
    `template_vars`: the chat template's own variables, every turn (Qwen3's enable_thinking).
    /save, /load and /sessions are `SessionCommands`' (sessions.py)."""

    def __init__(
        self,
        llm,
        params,
        system: str | None,
        session: Path | None = None,
        sessions_dir: Path = DEFAULT_SESSIONS_DIR,
        console: Console = default_console,
        live: bool = True,
        template_vars: dict | None = None,
    ):
        self.llm, self.params, self.session, self.console, self.live = llm, params, session, console, live
        self.template_vars = template_vars or {}
        self.sessions_dir = session.parent if session is not None else Path(sessions_dir)
        self.initial = [{"role": "system", "content": system}] if system else []
        self.reset()
        self.resumed_tokens = 0  # KV tokens the session brought back, until the first reply uses them
        self.defer_signals = False  # a reply streams, or the session parks: a signal only sets flags
        self.stop_reply = False  # a signal came while a reply streamed: it stops after its step
        self.terminated = False  # SIGTERM: the chat ends once what runs has stopped

    @property
    def engine(self):
        return self.llm.engine

    def say(self, line: str, style: str = "dim") -> None:
        """One line, never read as markup; wrapped to fit a terminal, whole in a pipe."""
        self.console.print(f"[{style}]{escape(line)}[/{style}]", soft_wrap=not self.console.is_terminal)

    def error(self, message: str) -> None:
        self.console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=not self.console.is_terminal)

    # ------------------------------------------------------------------ replies
    def reset(self) -> None:
        self.history: list[dict[str, str]] = list(self.initial)
        self.last = None  # (output, its ReplyMeter) of the newest reply

    def reply(self, user: str) -> None:
        """Stream the answer to `user`. A turn that fails (e.g. the conversation outgrew the
        context, or the chat template refuses it) leaves the history as it was; one stopped by a
        signal keeps what was said."""
        self.history.append({"role": "user", "content": user})
        try:
            prompt_ids = self.engine.tokenizer.encode_chat(self.history, **self.template_vars)
        except ValueError as err:  # ConfigError too: no chat template, or it fails on this turn
            self.history.pop()
            self.error(str(err))
            return
        self.defer_signals, self.stop_reply = True, False
        try:
            out, meter = self.stream(prompt_ids)
        finally:
            self.defer_signals = False
        if out.finish_reason == "error":
            self.history.pop()
            self.error(f"{out.error} Type /reset to start over.")
            return
        self.history.append({"role": "assistant", "content": out.text})
        self.last = (out, meter)
        if not out.finished:
            self.say(f"reply stopped after {len(out.token_ids)} tokens; what it said stays in the chat")
        for line in summary_lines(self.engine, meter):
            self.say(line)
        if self.resumed_tokens:
            self.show_resume_saving()

    def stream(self, prompt_ids: list[int]):
        """Run the prompt, showing the reply as it comes: under the live panel in a terminal,
        as plain text otherwise. Returns the final output and its meter."""
        engine, tokenizer = self.engine, self.engine.tokenizer
        meter, decoder, hits_before = ReplyMeter(), tokenizer.stream_decoder(), engine.prefix_hit_tokens()
        live = self.live and self.console.is_terminal
        view = LiveView(self.console, engine, meter) if live else None
        if not live:
            self.console.print("[bold blue]smol>[/bold blue] ", end="")
        text, out, shown = "", None, 0
        stream = self.llm.stream(prompt_ids, self.params)
        with view or contextlib.nullcontext(), contextlib.closing(stream):  # closed early: aborted
            for out in stream:  # a step may bring several tokens
                meter.reused_tokens = engine.prefix_hit_tokens() - hits_before
                for token in out.token_ids[shown:]:
                    meter.count_token()
                    if token in engine.eos_token_ids:
                        continue
                    piece = decoder.feed(token)
                    text += piece
                    if view:
                        view.feed(piece)
                    else:
                        self.console.print(piece, end="", markup=False, highlight=False)
                shown = len(out.token_ids)
                if self.stop_reply:  # a signal came: the stream stops here
                    break
        rest = decoder.flush()
        if live:  # the drawing is gone: the reply stays, printed once
            self.console.print(Text("smol> ", style="bold blue") + Text(text + rest))
        else:
            self.console.print(rest, markup=False, highlight=False)
        return out, meter

    def show_resume_saving(self) -> None:
        """After the first reply of a resumed session: the prefill the session saved, and what
        recomputing it would have cost at the prefill rate this run measured."""
        out, meter = self.last
        rate = self.engine.snapshot().prefill_rate
        estimate = (
            f"; recomputing them would take ~{meter.reused_tokens / rate * 1000:.0f} ms here" if rate else ""
        )
        self.say(
            f"{meter.reused_tokens:,} of {len(out.prompt_token_ids):,} prompt tokens came from the session, "
            f"first token in {out.ttft * 1000:.0f} ms{estimate}"
        )
        self.resumed_tokens = 0

    def stats(self) -> str:
        if self.last is None:
            return "no reply yet"
        out, meter = self.last
        return stats_line(self.engine.snapshot(), out, meter)

    # ------------------------------------------------------------------ /set and /compare
    def engine_with(self, fields: dict):
        """A new LLM: this one's switches with `fields` changed; the model is kept unless its dtype
        or weights change (or whether its layers are fused)."""
        from minillm.engine import LLM

        config, engine = self.engine.config, self.engine
        switches = {
            f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "model_dir"
        }
        switches |= fields
        same_model = all(
            switches[name] == getattr(config, name) for name in ("dtype", "weights", "fused_decode")
        )
        model = engine.model if same_model else None
        return LLM(config.model_dir, model=model, tokenizer=engine.tokenizer, **switches)

    def current(self, switch: Setting, fields: dict) -> str:
        owner = self.params if switch.where == "sampling" else self.engine.config
        return " ".join(f"{name}={getattr(owner, name)}" for name in fields)

    def do_set(self, words: str) -> None:
        switch, fields = parse_setting(words)
        if switch.where == "view":
            self.live = fields["live"]
            terminal = "" if self.console.is_terminal else " (stdout is not a terminal: plain lines stay)"
            self.say(f"live panel {'on' if self.live else 'off'}{terminal}")
        elif switch.where == "sampling":
            self.params = dataclasses.replace(self.params, **fields)
            self.say(f"next replies sample with {self.current(switch, fields)}")
        else:
            self.llm = self.engine_with(fields)
            carried = ""
            if self.history:
                history_ids = self.engine.tokenizer.encode_chat(
                    self.history, add_generation_prompt=False, **self.template_vars
                )
                tokens = len(history_ids)
                carried = (
                    f"; the conversation stays: its next reply prefills its {tokens:,} tokens "
                    "into the new pool"
                )
            self.say(f"engine rebuilt with {self.current(switch, fields)}{carried}")

    def do_compare(self, words: str) -> None:
        switch, fields = parse_setting(words)
        if switch.where == "view":
            raise ValueError("live changes only the drawing; /compare an engine or sampling switch")
        if self.last is None:
            raise ValueError("nothing to compare yet: ask something first, then /compare SWITCH VALUE")
        prompt_ids = self.last[0].prompt_token_ids
        changed_params = (
            dataclasses.replace(self.params, **fields) if switch.where == "sampling" else self.params
        )
        # a bad combination fails here, first
        changed = self.engine_with(fields if switch.where == "engine" else {})
        self.say(
            f"answering the last prompt ({len(prompt_ids):,} tokens) on two fresh engines: as now, "
            f"and with {words}"
        )
        before = answer(self.engine_with({}), prompt_ids, self.params)
        after = answer(changed, prompt_ids, changed_params)
        self.show_comparison(switch, f"now: {self.current(switch, fields)}", f"with {words}", before, after)

    def show_comparison(self, switch: Setting, name_a: str, name_b: str, a: Answer, b: Answer) -> None:
        title = f"/compare {switch.name} ({'lossy' if switch.lossy else 'lossless'})"
        self.console.print(comparison_table(title, name_a, name_b, a, b))
        self.say(difference_line(a, b, self.engine.tokenizer.decode), style="bold")

    # ------------------------------------------------------------------ the loop
    def do_help(self, _: str) -> None:
        commands = Table.grid(padding=(0, 2))
        for command, (arguments, what) in COMMANDS.items():
            commands.add_row(f"{command} {arguments}", what)
        switches = Table.grid(padding=(0, 2))
        for switch in SETTINGS.values():
            kind = "view" if switch.where == "view" else "lossy" if switch.lossy else "lossless"
            switches.add_row(switch.name, switch.accepts, kind)
        self.console.print(commands, "switches of /set and /compare:", switches)

    def command(self, line: str) -> bool:
        """Run a /command (method `do_` + its name); False when it ends the chat. A mistake is
        one line, and the chat goes on."""
        name, _, words = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name not in COMMANDS:
            self.error(f"unknown command {name}; /help lists the commands")
            return True
        try:
            getattr(self, "do_" + name[1:])(words.strip())
        except (ConfigError, ValueError, OSError) as err:  # SessionError is a ConfigError; OSError: a disk
            self.error(str(err))
        return True

    def do_memory(self, _: str) -> None:
        full_map(self.engine, self.console)

    def do_stats(self, _: str) -> None:
        self.say(self.stats(), style="none")

    def do_why(self, _: str) -> None:
        if self.last is None:
            self.say("no reply yet")
            return
        report = self.last[0].prefix_miss_report()
        self.say(report["summary"] if report else "prefix caching is off: /set prefix_caching on")

    def do_reset(self, _: str) -> None:
        self.reset()
        self.say("conversation cleared")

    def run(self, model_name: str) -> None:
        """Read a line, run it as a command or answer it; until /exit or the end of the input,
        then park the session if there is one."""
        self.console.print(
            f"[bold]minillm chat[/bold] — {model_name}, paged KV with prefix caching. {CHAT_HELP}",
            highlight=False,
        )
        if self.session is not None and self.session.exists():
            self.resume(self.session)
        with handling_stop_signals(self.on_signal):
            self.converse()
            self.defer_signals = True  # parking is not cut short by a signal
            self.park()

    def on_signal(self, signum: int, frame) -> None:
        """Ctrl-C or SIGTERM: a reply stops after its step; otherwise (at the prompt, in a
        command) KeyboardInterrupt stops what runs. After SIGTERM the chat then ends."""
        self.terminated = self.terminated or signum == signal.SIGTERM
        if self.defer_signals:
            self.stop_reply = True
        else:
            raise KeyboardInterrupt

    def converse(self) -> None:
        """Read a line and carry it out, until /exit, the end of the input, Ctrl-C at the
        prompt, or SIGTERM; Ctrl-C in a command or a reply stops only that."""
        while not self.terminated:
            try:
                line = self.console.input("[bold green]you>[/bold green] ").strip()
            except (EOFError, KeyboardInterrupt):
                self.console.print()
                return
            try:
                if line.startswith("/"):
                    if not self.command(line):
                        return
                elif line:
                    self.reply(line)
            except KeyboardInterrupt:
                self.console.print()
                self.say(f"{line.split()[0]} stopped")
