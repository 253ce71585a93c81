"""The chat's sessions: a conversation parked on disk, and found again by its name.

`/save NAME` parks the conversation's KV blocks and messages in one file (`memory/sessions.py`
writes it), `/load NAME` loads them back as cached prefix blocks, so the next reply prefills only
the new turn. With `--session NAME` the chat starts from that session, if it exists, and parks
itself there when it ends. Here: where a session's file is, what the folder holds, and the check
that a file's messages are a conversation; and `SessionCommands`, the chat's /save, /load and
/sessions, which `Chat` (repl.py) takes on.

No command loses a conversation: the chat's session changes only once a save or a load has
succeeded, so a refused `/load` never lets the next park overwrite the file it named, and `/load`
parks the current conversation before another takes its place. Every failure is one line.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

from minillm.config import ConfigError
from minillm.memory import SessionError
from minillm.report import print_table

SESSION_NAME = re.compile(r"\w[\w.-]*")
# most file systems stop at 255 bytes a name; ".safetensors" and a save's temporary name add to it
MAX_NAME_BYTES = 100
DEFAULT_SESSIONS_DIR = Path.home() / ".cache" / "minillm" / "sessions"


def session_path(sessions_dir: Path, name: str) -> Path:
    """The file of session `name`; a name is a plain word, so the file stays inside the folder."""
    if not SESSION_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"Session name {name!r} must be letters, digits, '_', '-' or '.', like 'work-notes'."
        )
    if len(name.encode()) > MAX_NAME_BYTES:
        raise ValueError(
            f"Session name {name[:20]}... is {len(name.encode())} bytes long; keep it to "
            f"{MAX_NAME_BYTES} bytes or fewer, like 'work-notes'."
        )
    return Path(sessions_dir) / f"{name}.safetensors"


def list_sessions(sessions_dir: Path) -> list[tuple[str, int, int]]:
    """(name, tokens of KV, bytes on disk) of each parked session, by name. A file that cannot be
    read (damaged, or a link to nowhere) is listed with -1 tokens, so the user can find and delete it."""
    found = []
    for path in sorted(Path(sessions_dir).glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as f:
                tokens = f.get_slice("token_ids").get_shape()[0]
        except Exception:  # whatever it holds, the listing goes on
            tokens = -1
        found.append((path.stem, tokens, path.stat().st_size if path.exists() else 0))
    return found


def session_rows(sessions_dir: Path) -> list[list[str]]:
    """The rows of /sessions: name, KV tokens, size on disk."""
    return [
        [name, f"{tokens:,}" if tokens >= 0 else "unreadable", f"{size / 2**20:.1f} MiB"]
        for name, tokens, size in list_sessions(sessions_dir)
    ]


def chat_messages(extra: dict, name: str) -> list[dict[str, str]]:
    """The conversation a session file carries, checked: a list of {"role", "content"} strings."""
    messages = extra.get("messages")
    if not (
        isinstance(messages, list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
    ):
        raise SessionError(f"Session {name} holds no chat messages; start a new session.")
    return messages


# ----------------------------------------------------------------------------- the chat's commands
class SessionCommands:
    """The session half of `Chat`: it reads and sets the chat's `session`, `history`, `last` and
    `resumed_tokens`, and speaks through its `say` and `error`."""

    def resume(self, path: Path) -> None:
        """Make `path` the session: its messages the history, its KV the prefix cache's. A file
        that cannot be resumed raises SessionError and leaves the chat as it was."""
        token_ids, extra = self.engine.load_session(path)
        history = chat_messages(extra, path.stem)
        self.session, self.history, self.last, self.resumed_tokens = path, history, None, len(token_ids)
        self.say(
            f"resumed session {path.stem}: {len(history)} messages, "
            f"{len(token_ids):,} tokens of KV loaded from disk"
        )

    def save_as(self, path: Path | None) -> None:
        """Write the conversation's KV and messages to `path`, which becomes the session (nothing
        to write without a session or a reply). A failed write raises SessionError and leaves the
        session, and the file it had, as they were."""
        if path is None or self.last is None:
            return
        out = self.last[0]
        kept = self.engine.save_session(
            path, out.prompt_token_ids + out.token_ids, extra={"messages": self.history}
        )
        self.session = path
        size_mib = path.stat().st_size / 2**20
        self.say(f"parked session {path.stem}: {kept:,} tokens of KV, {size_mib:.1f} MiB on disk")

    def park(self) -> None:
        """When the chat ends: write the conversation to its session; a failure is one line."""
        try:
            self.save_as(self.session)
        except (ConfigError, OSError) as err:  # e.g. /set prefix_caching off: no blocks to find again
            self.error(f"session {self.session.stem} was not parked: {err}")

    def do_save(self, name: str) -> None:
        if not name and self.session is None:
            raise ValueError("give the session a name: /save NAME")
        if self.last is None:
            raise ValueError(
                "nothing to save yet: a session keeps a conversation's KV, so ask something first"
            )
        self.save_as(session_path(self.sessions_dir, name) if name else self.session)

    def do_load(self, name: str) -> None:
        if not name:
            raise ValueError("say which session: /load NAME (/sessions lists them)")
        path = session_path(self.sessions_dir, name)
        if not path.is_file():
            raise ValueError(f"no session {name} in {self.sessions_dir}; /sessions lists them")
        try:
            self.save_as(self.session)  # the conversation so far is parked before another takes its place
        except SessionError as err:
            raise SessionError(f"/load {name} refused, so as not to lose this conversation: {err}") from None
        self.resume(path)

    def do_sessions(self, _: str) -> None:
        rows = session_rows(self.sessions_dir)
        if rows:
            print_table(
                self.console, f"sessions in {self.sessions_dir}", ["name", "KV tokens", "on disk"], rows
            )
        else:
            self.say(f"no sessions in {self.sessions_dir}")
