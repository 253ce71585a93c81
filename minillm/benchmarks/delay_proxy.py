"""A slow network on one machine: a TCP proxy that holds every reply chunk for a while.

What waits on a store a network away (the remote KV tier, `memory/remote.py`) must be tried
against a slow one, and a store on 127.0.0.1 answers in microseconds. `delay_proxy(port, delay_s)`
listens on a free local port and forwards each connection to `port`; requests go through at once,
and every chunk of a reply is held `delay_s` seconds from its arrival before it is passed on (a
latency, not a bandwidth limit: chunks that arrive together leave together, in order).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

POLL_S = 0.1  # how often a blocked thread looks whether the proxy is closing
CONNECT_TIMEOUT_S = 2.0


@contextmanager
def delay_proxy(port: int, delay_s: float, host: str = "127.0.0.1") -> Iterator[int]:
    """A proxy to `host:port` delaying its replies by `delay_s`; yields the port to connect to.
    Every connection is closed when the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(POLL_S)
    closing = threading.Event()
    accepting = threading.Thread(
        target=_accept, args=(listener, (host, port), delay_s, closing), name="delay-proxy", daemon=True
    )
    accepting.start()
    try:
        yield listener.getsockname()[1]
    finally:
        closing.set()
        accepting.join(timeout=5 * POLL_S)
        listener.close()


def _accept(listener: socket.socket, target: tuple[str, int], delay_s: float, closing: threading.Event):
    while not closing.is_set():
        try:
            client, _ = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        try:
            server = socket.create_connection(target, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            client.close()  # the server is down: so is the proxy's connection
            continue
        replies: queue.Queue = queue.Queue()
        for target_fn, args in (
            (_forward, (client, server, closing)),
            (_receive, (server, replies, delay_s, closing)),
            (_send_when_due, (replies, client, closing)),
        ):
            threading.Thread(target=target_fn, args=args, daemon=True).start()


def _forward(source: socket.socket, destination: socket.socket, closing: threading.Event) -> None:
    """Requests, as they come; when either side ends, both connections close."""
    source.settimeout(POLL_S)
    try:
        while not closing.is_set():
            try:
                chunk = source.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                break
            destination.sendall(chunk)
    except OSError:
        pass
    finally:
        _close(source, destination)


def _receive(server: socket.socket, replies: queue.Queue, delay_s: float, closing: threading.Event) -> None:
    """Each reply chunk, stamped with when it may leave; None when the server's side ends."""
    server.settimeout(POLL_S)
    try:
        while not closing.is_set():
            try:
                chunk = server.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                break
            replies.put((time.monotonic() + delay_s, chunk))
    except OSError:
        pass
    finally:
        replies.put(None)


def _send_when_due(replies: queue.Queue, client: socket.socket, closing: threading.Event) -> None:
    try:
        while not closing.is_set():
            try:
                item = replies.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                break
            due, chunk = item
            time.sleep(max(0.0, due - time.monotonic()))
            client.sendall(chunk)
    except OSError:
        pass
    finally:
        _close(client)


def _close(*connections: socket.socket) -> None:
    for connection in connections:
        try:
            connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        connection.close()
