"""The chat's sessions: a conversation parked on disk, and found again by its name.

`/save NAME` parks the conversation's KV blocks and messages in one file (`memory/sessions.py`
writes it), `/load NAME` loads them back as cached prefix blocks, so the next reply prefills only
the new turn. With `--session NAME` the chat starts from that session, if it exists, and parks
itself there when it ends. Here: where a session's file is, what the folder holds, and the check
that a file's messages are a conversation; and `SessionCommands`, the chat's /save, /load and
/sessions, which `Chat` (repl.py) takes on.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

from minillm.config import ConfigError
from minillm.memory import SessionError
from minillm.report import print_table

SESSION_NAME = re.compile(r"\w[\w.-]*")
DEFAULT_SESSIONS_DIR = Path.home() / ".cache" / "minillm" / "sessions"


def session_path(sessions_dir: Path, name: str) -> Path:
    """The file of session `name`; a name is a plain word, so the file stays inside the folder."""
    if not SESSION_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(
            f"Session name {name!r} must be letters, digits, '_', '-' or '.', like 'work-notes'."
        )
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


def session_rows(sessions_dir: Path) -> list[list[str]]:
    """The rows of /sessions: name, KV tokens, size on disk."""
    return [
        [name, f"{tokens:,}" if tokens >= 0 else "damaged", f"{size / 2**20:.1f} MiB"]
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

    def resume(self) -> None:
        """Load the parked session: its messages become the history, its KV the prefix cache's."""
        token_ids, extra = self.engine.load_session(self.session)
        self.history = chat_messages(extra, self.session.stem)
        self.last = None
        self.resumed_tokens = len(token_ids)
        self.say(
            f"resumed session {self.session.stem}: {len(self.history)} messages, "
            f"{len(token_ids):,} tokens of KV loaded from disk"
        )

    def park(self) -> None:
        """Write the conversation's KV and messages to the session file (if there was a reply)."""
        if self.session is None or self.last is None:
            return
        out = self.last[0]
        try:
            kept = self.engine.save_session(
                self.session, out.prompt_token_ids + out.token_ids, extra={"messages": self.history}
            )
        except OSError as err:
            self.error(
                f"session {self.session.stem} could not be parked in {self.session.parent} "
                f"({err.strerror or err}); choose another --sessions-dir."
            )
            return
        except ConfigError as err:  # e.g. /set prefix_caching off: nothing to find the blocks again by
            self.error(f"session {self.session.stem} was not parked: {err}")
            return
        self.say(
            f"parked session {self.session.stem}: {kept:,} tokens of KV, "
            f"{self.session.stat().st_size / 2**20:.1f} MiB on disk"
        )

    def do_save(self, name: str) -> None:
        if not name and self.session is None:
            raise ValueError("give the session a name: /save NAME")
        if self.last is None:
            raise ValueError(
                "nothing to save yet: a session keeps a conversation's KV, so ask something first"
            )
        self.session = session_path(self.sessions_dir, name) if name else self.session
        self.park()

    def do_load(self, name: str) -> None:
        if not name:
            raise ValueError("say which session: /load NAME (/sessions lists them)")
        path = session_path(self.sessions_dir, name)
        if not path.exists():
            raise ValueError(f"no session {name} in {self.sessions_dir}; /sessions lists them")
        self.session = path
        self.resume()

    def do_sessions(self, _: str) -> None:
        rows = session_rows(self.sessions_dir)
        if rows:
            print_table(
                self.console, f"sessions in {self.sessions_dir}", ["name", "KV tokens", "on disk"], rows
            )
        else:
            self.say(f"no sessions in {self.sessions_dir}")
