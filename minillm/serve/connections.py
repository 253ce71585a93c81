"""The connections: uvicorn, with at most `max_connections` of them and a deadline for each request's head.

`uvicorn_config` is how both `minillm serve` and the tests run the app (`serving_in_a_thread`:
beside the caller's own work, as the tests and the scripts do). uvicorn has no deadline
for a request's head: its keep-alive timer restarts on every byte, so a client that sends one byte
a second (slowloris) holds its connection, and one of the few a server allows, for ever.
`ServerProtocol` is uvicorn's HTTP/1.1 protocol with that deadline (the body's is the app's,
`body.read_body`) and with the connection cap: a request on a connection past `max_connections`
gets a 503 in OpenAI's error body and the connection closes (uvicorn's own `limit_concurrency`
answers in plain text). The protocol's own errors are OpenAI's body too: a head begun and not
finished by the deadline gets a 408 (an idle keep-alive connection is just closed), bytes that are
not HTTP a 400 (uvicorn answers "Invalid HTTP request received." in plain text).

It also turns off Nagle's algorithm on every connection. asyncio does that only for a socket made
with proto IPPROTO_TCP, and `socket.create_server` (how `minillm serve` takes its address before
the weights load) makes proto 0: uvicorn writes a response's head and body apart, so on a
keep-alive connection the body waited for the client's delayed ACK, 40 ms a request (an
evaluation harness sends thousands of small ones).
"""

from __future__ import annotations

import contextlib
import functools
import json
import socket
import threading
import time
from http import HTTPStatus

from uvicorn import Config, Server
from uvicorn.protocols.http.h11_impl import H11Protocol

from minillm.serve.errors import error_body
from minillm.serve.limits import ServeLimits


async def too_many_connections(scope, receive, send) -> None:
    """The answer to a request past the connection cap: 503, OpenAI's body, and the connection closed."""
    message = "The server has as many connections open as it takes (--max-connections); retry later."
    body = json.dumps(error_body(503, message)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": [*head, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class ServerProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with `read_timeout` seconds for a request's head (its request
    line and headers), counted from when the connection opens or its last response ends (a
    connection that misses it is closed), and `max_connections` (one past it gets a 503)."""

    def __init__(self, *args, read_timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.head_deadline = None
        self.max_connections = max_connections
        self.served_app = self.app

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see the module's docstring
        super().connection_made(transport)
        self.start_head_deadline()

    def on_response_complete(self) -> None:
        self.start_head_deadline()  # first: a pipelined request's head, handled below, cancels it
        super().on_response_complete()

    def handle_events(self) -> None:
        # a request that arrives in these events is answered by the app uvicorn finds in self.app
        over_cap = len(self.connections) > self.max_connections  # uvicorn counts this one among them
        self.app = too_many_connections if over_cap else self.served_app
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:  # a request's head arrived
            self.cancel_head_deadline()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes h11 cannot parse as HTTP/1.1 ("Invalid HTTP request received.")
        or an upgrade it cannot serve, in OpenAI's body."""
        self.answer_and_close(400, msg)

    def head_deadline_passed(self) -> None:
        """No whole request head within read_timeout: a client that began one hears why."""
        if self.conn.trailing_data[0]:  # bytes of a head received, not yet a whole one
            message = f"The request head did not arrive within {self.read_timeout:g} s (--read-timeout)."
            self.answer_and_close(408, message)
        else:
            self.transport.close()

    def answer_and_close(self, status: int, message: str) -> None:
        """An error written straight to the connection, outside any request h11 has read."""
        body = json.dumps(error_body(status, message)).encode()
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self.cancel_head_deadline()
        super().connection_lost(exc)

    def start_head_deadline(self) -> None:
        self.cancel_head_deadline()
        self.head_deadline = self.loop.call_later(self.read_timeout, self.head_deadline_passed)

    def cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None


def uvicorn_config(app, limits: ServeLimits, **options) -> Config:
    """uvicorn's Config for `app` under `limits` (`options`: uvicorn's own, like log_level)."""
    protocol = functools.partial(
        ServerProtocol, read_timeout=limits.read_timeout, max_connections=limits.max_connections
    )
    return Config(app, http=protocol, **options)


@contextlib.contextmanager
def serving_in_a_thread(config: Config, start_s: float = 30.0, stop_s: float = 30.0):
    """The app `config` names, served by uvicorn in a thread on a free port of 127.0.0.1: its base
    URL while the block runs (how the tests and the scripts run an app beside their own work).
    Raises RuntimeError if it has not started within `start_s` or not stopped within `stop_s`."""
    sock = socket.create_server(("127.0.0.1", 0))  # a free port, held from now on
    server = Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=stop_s)
        if thread.is_alive():
            raise RuntimeError(f"uvicorn did not stop within {stop_s:.0f} s")
