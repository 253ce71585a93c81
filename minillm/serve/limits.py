"""What one client may ask of the server: the limits a shared server needs, each a `minillm serve` flag.

A server that takes anything it is sent can be stopped by one client: a body of 20 MB (tokenized
for seconds), 4,000 prompts with n=16 (64,000 sequences queued), a thousand stop strings searched
in every piece of text, connections opened and never finished (slowloris), a stream never read
(its outputs pile up in the server). `ServeLimits` bounds each, and every bound is a flag (the
dataclass below is the one place they are declared; `cli/serve.py` makes the flags from it):

    max_body_kb             request body; a bigger one gets a 413 (by its Content-Length first; the
                            rest is read and dropped, so the client reads the 413: `body.py`)
    max_prompts_per_request prompts in one completion request (a 400)
    max_request_tokens      prompt tokens + prompts x n x max_tokens of one request (a 400; 16
                            full contexts of SmolLM2, with room for their prompts)
    max_stop_strings,       stop strings and their length: the search for them in each new piece
    max_stop_chars          of text is then bounded (a 400)
    max_waiting_requests    engine requests waiting beyond the batch (max_num_seqs); past that a 429
                            with Retry-After, as vLLM-style servers answer under overload
    max_connections         connections at once; past that a 503 in OpenAI's body
    read_timeout            seconds to send a request's head, and then its body (a 408)
    max_stream_backlog      engine steps a stream may fall behind its reader; past that it is aborted

The app enforces the ones about requests and streams (`protocol.py`, `body.py`, `engine_loop.py`),
the server's HTTP protocol the ones about connections (`connections.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def limit(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ServeLimits:
    max_body_kb: int = limit(4096, "request body size in KB at most; a bigger one gets a 413")
    max_prompts_per_request: int = limit(64, "prompts in one completion request at most")
    max_request_tokens: int = limit(
        262144, "tokens one request may ask for: its prompts' + prompts x n x max_tokens"
    )
    max_stop_strings: int = limit(16, "stop strings in one request at most")
    max_stop_chars: int = limit(256, "characters in one stop string at most")
    max_waiting_requests: int = limit(
        256, "requests waiting beyond the running batch (--max-num-seqs); more get a 429 with Retry-After"
    )
    max_connections: int = limit(128, "connections at once; more get a 503")
    read_timeout: float = limit(30.0, "seconds a client has to send a request's head, then its body")
    max_stream_backlog: int = limit(
        256, "engine steps a stream may fall behind its reader by before it is aborted"
    )

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_kb * 1024

    @classmethod
    def flags(cls):
        """(field name, default, help) of each limit, in the table's order: one flag each."""
        return [(f.name, f.default, f.metadata["help"]) for f in fields(cls)]
