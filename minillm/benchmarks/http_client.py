"""The client `bench serve-http` measures a server with: one streaming completion over a plain socket.

The server it measures runs on the same machine, so the clients take as little CPU as they can:
HTTP/1.1 written by hand on an asyncio socket, the server-sent events read by hand, no client
library. They speak what every OpenAI-compatible server understands (minillm serve, vLLM,
llama.cpp's server): GET /v1/models, and POST /v1/completions with the prompt as token ids and
`"stream": true`. Per request they record when it was sent, when its first chunk came and when
its stream ended, and how many tokens it got: the `usage` the server sends at the end when asked
(`stream_options.include_usage`), else the chunks that carried text, one token each. Asked for
them (`return_token_ids`, vLLM's extension, which minillm serves too), they keep the token ids the
server made; a server that ignores the field sends none, and they keep None. A server that sends
nothing for SILENCE_S seconds in the middle of a request (a stuck one) fails that request with a
TimeoutError instead of holding the benchmark for ever.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import NamedTuple

from minillm.config import ConfigError

SILENCE_S = 120.0  # the longest a request waits for the server's next byte (a prefill under load: seconds)


class Endpoint(NamedTuple):
    """Where a server listens: plain HTTP on host:port."""

    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        return f"http://{host}:{self.port}"


def parse_url(url: str) -> Endpoint:
    """`http://HOST:PORT` (port 80 if none is given) as an Endpoint, else a one-line error."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        raise ConfigError(f"--url {url}: only http:// is supported (the clients speak plain HTTP/1.1)")
    try:
        port = parts.port or 80
    except ValueError:  # a port that is not a number, or out of range
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path.strip("/") or parts.query:
        raise ConfigError(f"--url {url!r} is not http://HOST:PORT, e.g. http://127.0.0.1:8080")
    return Endpoint(parts.hostname, port)


def get(endpoint: Endpoint, path: str) -> bytes:
    with urllib.request.urlopen(endpoint.url + path, timeout=60) as response:
        return response.read()


def model_name(endpoint: Endpoint) -> str:
    """The first model GET /v1/models lists: the one every request names."""
    try:
        return json.loads(get(endpoint, "/v1/models"))["data"][0]["id"]
    except urllib.error.HTTPError as err:
        raise ConfigError(
            f"{endpoint.url}/v1/models answered HTTP {err.code}; is it an OpenAI-compatible server?"
        ) from None
    except OSError as err:  # refused, no such host, timed out
        reason = err.reason if isinstance(err, urllib.error.URLError) else err
        raise ConfigError(f"cannot reach {endpoint.url}: {reason}; is the server running?") from None
    except (ValueError, KeyError, IndexError, TypeError) as err:
        problem = f"{type(err).__name__}: {err}"
        raise ConfigError(f"{endpoint.url}/v1/models did not list a model ({problem})") from None


def completion_body(model: str, prompt_ids: list[int], max_tokens: int, token_ids: bool = False) -> dict:
    """A streamed greedy completion of exactly `max_tokens` tokens: `ignore_eos` is an extension
    minillm, vLLM and llama.cpp's server share; `include_usage` asks for the token count at the end;
    `token_ids` asks for the answer's token ids too."""
    extra = {"return_token_ids": True} if token_ids else {}
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def _heard(endpoint: Endpoint, reading):
    """What `reading` (one read from the server) gives, within SILENCE_S."""
    try:
        return await asyncio.wait_for(reading, SILENCE_S)
    except TimeoutError:
        raise TimeoutError(f"{endpoint.url} sent nothing for {SILENCE_S:g} s mid-request") from None


async def post_stream(endpoint: Endpoint, body: dict) -> tuple:
    """POST body to /v1/completions and read the status line and headers. Returns (reader, writer,
    the moment it was sent, the status, whether the body is chunked)."""
    reader, writer = await _heard(endpoint, asyncio.open_connection(endpoint.host, endpoint.port))
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (endpoint.host.encode(), endpoint.port, len(payload), payload)
    )
    sent = time.perf_counter()
    status = (await _heard(endpoint, reader.readline())).split(b" ")[1]
    chunked = False
    while (line := await _heard(endpoint, reader.readline())) not in (b"\r\n", b""):
        chunked |= line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower()
    return reader, writer, sent, int(status), chunked


async def read_some(reader: asyncio.StreamReader, chunked: bool) -> bytes:
    """The next piece of the body as it arrives (de-chunked); b"" once it has ended."""
    if not chunked:
        return await reader.read(65536)
    size = int((await reader.readline()).strip() or b"0", 16)
    if size == 0:
        return b""
    data = await reader.readexactly(size)
    await reader.readline()
    return data


END_OF_STREAM = "[DONE]"


def parse_event(event: bytes) -> dict | str | None:
    """One server-sent event: its JSON message, END_OF_STREAM, or None for a comment (a keep-alive)
    or a field these servers do not send; an error event raises RuntimeError."""
    field, _, value = event.partition(b":")
    value = value.strip()
    if field == b"error":  # llama.cpp's server reports a failure so
        raise RuntimeError(value.decode(errors="replace")[:300])
    if field != b"data":
        return None
    if value == END_OF_STREAM.encode():
        return END_OF_STREAM
    message = json.loads(value)
    if "error" in message:
        raise RuntimeError(message["error"]["message"])
    return message


def take_message(result: dict, message: dict) -> int:
    """Add one message's choices (and its usage, if any) to `result`; returns how many of its
    choices carried text."""
    if message.get("usage"):
        result["tokens"] = message["usage"]["completion_tokens"]
    with_text = 0
    for choice in message["choices"]:
        # the first chunk: the first token's text, or the end of an answer without text
        if result["ttft_s"] is None:
            result["ttft_s"] = time.perf_counter() - result["sent"]
        result["text"] += choice["text"]
        if "token_ids" in choice:
            result["token_ids"] = (result["token_ids"] or []) + choice["token_ids"]
        result["chunks"] += 1
        with_text += bool(choice["text"])
    return with_text


async def error_of(endpoint: Endpoint, reader: asyncio.StreamReader, chunked: bool, status: int) -> str:
    """An answer other than 200: its status and the start of its body."""
    body = b""
    while data := await _heard(endpoint, read_some(reader, chunked)):
        body += data
    return f"HTTP {status}: {body.decode(errors='replace').strip()[:300]}"


async def stream_completion(endpoint: Endpoint, body: dict, disconnect_after: int | None = None) -> dict:
    """POST body (with "stream": true) to /v1/completions and read the events; with
    `disconnect_after`, hang up after that many text chunks. Returns text, tokens, timings; an
    answer other than 200 comes back as its status and `error` (the start of its body)."""
    reader, writer, sent, status, chunked = await post_stream(endpoint, body)
    result = {
        "status": status,
        "text": "",
        "token_ids": None,  # the answer's ids, if asked for and the server sends them
        "tokens": None,  # from the server's usage; else counted at the end
        "tokens_from": "usage",
        "ttft_s": None,
        "chunks": 0,
        "done": False,
        "sent": sent,
        "error": None,
    }
    text_chunks, buffer = 0, b""
    try:
        if status != 200:  # an error body, not events
            result["error"] = await error_of(endpoint, reader, chunked, status)
            return result
        while not result["done"] and (data := await _heard(endpoint, read_some(reader, chunked))):
            buffer += data
            while b"\n\n" in buffer and not result["done"]:
                event, buffer = buffer.split(b"\n\n", 1)
                message = parse_event(event)
                result["done"] = message == END_OF_STREAM
                if isinstance(message, dict):
                    text_chunks += take_message(result, message)
                if disconnect_after is not None and result["chunks"] >= disconnect_after:
                    return result
    finally:
        result["end"] = time.perf_counter()
        if result["tokens"] is None:
            result["tokens"], result["tokens_from"] = text_chunks, "chunks"
        writer.close()
    return result


def inter_token_s(result: dict) -> float | None:
    """(end of the stream - first chunk) / (tokens - 1): the time between two tokens of one
    request, as its client saw the server decode; None below 2 tokens."""
    if result["ttft_s"] is None or result["tokens"] < 2:
        return None
    return (result["end"] - result["sent"] - result["ttft_s"]) / (result["tokens"] - 1)
