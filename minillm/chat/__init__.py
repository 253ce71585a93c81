"""`minillm chat`: a conversation in the terminal with its KV memory in view.

repl.py      the conversation: replies, /commands
compare.py   /compare: the last prompt answered twice, side by side
view.py      the KV pool drawn as a block map, live while a reply streams
sessions.py  a conversation parked on disk, found again by its name; /save, /load, /sessions
switches.py  what /set and /compare can change, lossy or lossless
"""

from minillm.chat.repl import CHAT_HELP, Chat
from minillm.chat.sessions import DEFAULT_SESSIONS_DIR, session_path

__all__ = ["CHAT_HELP", "DEFAULT_SESSIONS_DIR", "Chat", "session_path"]
