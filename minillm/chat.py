"""`minillm chat`: a multi-turn conversation in the terminal, and what it costs, turn by turn.

A chat model has no memory between turns: every turn's prompt is the whole conversation so far,
rendered by the chat template, so the prompt grows with each turn. Run on the serving engine with
the prefix cache on, the KV blocks an earlier turn computed are found in the cache, and only the
newest turn is prefilled. /stats shows it after each reply: the prompt's tokens and how many of
them were reused from the cache, time to first token, decode speed, the KV memory the
conversation holds, and the pool's cached and free blocks.

With `--session NAME` the conversation outlives the process: when the chat ends, its KV blocks and
messages are parked in one file (`memory/sessions.py`), and the next `minillm chat --session NAME`
loads them back as cached prefix blocks — its first reply prefills only the new turn.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

from minillm.memory import SessionError
from minillm.report import console, print_table

CHAT_HELP = ("/reset clears the conversation, /stats shows speed, KV memory and prefix reuse, /sessions lists "
             "parked sessions, /exit quits.")
SESSION_NAME = re.compile(r"\w[\w.-]*")
DEFAULT_SESSIONS_DIR = Path.home() / ".cache" / "minillm" / "sessions"


def session_path(sessions_dir: Path, name: str) -> Path:
    """The file of session `name`; a name is a plain word, so the file stays inside the folder."""
    if not SESSION_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"Session name {name!r} must be letters, digits, '_', '-' or '.', like 'work-notes'.")
    return Path(sessions_dir) / f"{name}.safetensors"


def list_sessions(sessions_dir: Path) -> list[tuple[str, int, int]]:
    """(name, tokens of KV, bytes on disk) of each parked session, by name."""
    found = []
    for path in sorted(Path(sessions_dir).glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as f:
                tokens = f.get_slice("token_ids").get_shape()[0]
        except Exception:  # a damaged file is still listed, so the user can find and delete it
            tokens = -1
        found.append((path.stem, tokens, path.stat().st_size))
    return found


class Chat:
    """One conversation on `llm`, an `LLM` built with prefix_caching=True; it owns the history."""

    def __init__(self, llm, params, system: str | None, session: Path | None = None):
        self.llm, self.params, self.session = llm, params, session
        self.initial = [{"role": "system", "content": system}] if system else []
        self.reset()
        self.resumed_tokens = 0  # KV tokens the session brought back, until the first reply uses them

    def resume(self) -> None:
        """Load the parked session: its messages become the history, its KV the prefix cache's."""
        token_ids, extra = self.llm.engine.load_session(self.session)
        messages = extra.get("messages")
        if not (isinstance(messages, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in messages)):
            raise SessionError(f"Session {self.session.stem} holds no chat messages; start a new session.")
        self.history = messages
        self.resumed_tokens = len(token_ids)
        console.print(f"[dim]resumed session {self.session.stem}: {len(self.history)} messages, "
                      f"{len(token_ids):,} tokens of KV loaded from disk[/dim]")

    def park(self) -> None:
        """Write the conversation's KV and messages to the session file (if there was a reply)."""
        if self.session is None or self.last is None:
            return
        out = self.last[0]
        try:
            kept = self.llm.engine.save_session(self.session, out.prompt_token_ids + out.token_ids,
                                                extra={"messages": self.history})
        except OSError as err:
            console.print(f"[red]error:[/red] session {self.session.stem} could not be parked in "
                          f"{self.session.parent} ({err.strerror or err}); choose another --sessions-dir.")
            return
        console.print(f"[dim]parked session {self.session.stem}: {kept:,} tokens of KV, "
                      f"{self.session.stat().st_size / 2**20:.1f} MiB on disk[/dim]")

    def reset(self) -> None:
        self.history: list[dict[str, str]] = list(self.initial)
        self.last = None  # (output, prompt tokens reused from the prefix cache) of the newest reply

    def reply(self, user: str) -> None:
        """Stream the answer to `user`. A turn that fails (e.g. the conversation outgrew the
        context) leaves the history as it was."""
        tokenizer, cache = self.llm.engine.tokenizer, self.llm.engine.block_manager.prefix_cache
        self.history.append({"role": "user", "content": user})
        hits_before = cache.hit_blocks
        text, out = tokenizer.stream_decoder(), None
        console.print("[bold blue]smol>[/bold blue] ", end="")
        for out in self.llm.stream(tokenizer.encode_chat(self.history), self.params):
            token = out.token_ids[-1] if out.token_ids else None
            if token is not None and token != tokenizer.eos_token_id:
                console.print(text.feed(token), end="", markup=False, highlight=False)
        if out.finish_reason == "error":
            self.history.pop()
            console.print(f"\n[red]error:[/red] {out.error} Type /reset to start over.")
            return
        console.print(text.flush())
        self.history.append({"role": "assistant", "content": out.text})
        self.last = (out, (cache.hit_blocks - hits_before) * cache.block_size)
        if self.resumed_tokens:
            self.show_resume_saving()

    def show_resume_saving(self) -> None:
        """After the first reply of a resumed session: the prefill the session saved, and what
        recomputing it would have cost at the prefill rate this run measured."""
        out, reused = self.last
        rate = self.llm.engine.swap_cost.prefill_rate()
        estimate = f"; recomputing them would take ~{reused / rate * 1000:.0f} ms here" if rate else ""
        console.print(f"[dim]{reused:,} of {len(out.prompt_token_ids):,} prompt tokens came from the session, "
                      f"first token in {out.ttft * 1000:.0f} ms{estimate}[/dim]")
        self.resumed_tokens = 0

    def stats(self) -> str:
        if self.last is None:
            return "[dim]no reply yet[/dim]"
        out, reused_tokens = self.last
        engine = self.llm.engine
        per_token = engine.pool.bytes_per_slot
        held = len(out.prompt_token_ids) + len(out.token_ids)
        decode = f"{1 / out.tpot:.1f} tok/s" if out.tpot else "n/a"
        return (f"prompt {len(out.prompt_token_ids)} tokens ({reused_tokens} reused from the prefix cache), "
                f"reply {len(out.token_ids)} tokens | first token {out.ttft * 1000:.0f} ms | decode {decode} | "
                f"KV cache {per_token:,} B/token x {held} tokens = {per_token * held / 2**20:.1f} MiB; "
                f"{len(engine.block_manager.prefix_cache.entries)} blocks cached, "
                f"{engine.block_manager.num_free_blocks} of {engine.block_manager.num_blocks} blocks free")

    def show_sessions(self) -> None:
        folder = self.session.parent if self.session else DEFAULT_SESSIONS_DIR
        rows = [[name, f"{tokens:,}" if tokens >= 0 else "damaged", f"{size / 2**20:.1f} MiB"]
                for name, tokens, size in list_sessions(folder)]
        if rows:
            print_table(console, f"sessions in {folder}", ["name", "KV tokens", "on disk"], rows)
        else:
            console.print(f"[dim]no sessions in {folder}[/dim]")

    def run(self, model_name: str) -> None:
        """Read a line, run it as a command or answer it; until /exit or the end of the input,
        then park the session if there is one."""
        console.print(f"[bold]minillm chat[/bold] — {model_name}, paged KV with prefix caching. {CHAT_HELP}")
        if self.session is not None and self.session.exists():
            self.resume()
        self.converse()
        self.park()

    def converse(self) -> None:
        while True:
            try:
                user = console.input("[bold green]you>[/bold green] ").strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return
            if user in ("/exit", "/quit"):
                return
            if user == "/sessions":
                self.show_sessions()
            elif user == "/reset":
                self.reset()
                console.print("[dim]conversation cleared[/dim]")
            elif user == "/stats":
                console.print(self.stats())
            elif user:
                self.reply(user)
