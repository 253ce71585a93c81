"""The chat's sessions: a conversation parked on disk, and found again by its name.

`/save NAME` parks the conversation's KV blocks and messages in one file (`memory/sessions.py`
writes it), `/load NAME` loads them back as cached prefix blocks, so the next reply prefills only
the new turn. With `--session NAME` the chat starts from that session, if it exists, and parks
itself there when it ends. Here: where a session's file is, what the folder holds, and the check
that a file's messages are a conversation.
"""

from __future__ import annotations

import re
from pathlib import Path

from safetensors import safe_open

from minillm.memory import SessionError

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
