"""Which Host and Origin the server answers: DNS rebinding and other sites' pages kept out.

A page on evil.example can have the browser resolve evil.example to 127.0.0.1 a moment after it
loaded (DNS rebinding): its requests then reach a local server as same-origin ones, JSON bodies
and all, with `Host: evil.example`. And any page may send a local server a request that needs no
CORS preflight. So the server answers only a request whose Host names it and, when a browser sent
it, whose Origin it allows; every other gets a 403 in OpenAI's error body before any route runs.
Ollama checks the same two headers for the same reason.

By default (`allowed_for`): Host localhost, 127.0.0.1 or [::1] (any port), and the address the
server listens on; Origin (absent for a client that is not a browser) http or https on one of
those names. `--allowed-hosts` and `--allowed-origins` add names (or "*": any). A server that
listens on every address (0.0.0.0, ::) is meant to be reached by names it cannot know, so its Host
is not checked unless --allowed-hosts names them; its Origin still is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from urllib.parse import urlsplit

from minillm.serve.errors import error_body

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})
EVERY_ADDRESS = ("0.0.0.0", "::", "")


def _web(names) -> frozenset[str]:
    """The origins of pages served from `names`: http and https, any port."""
    return frozenset(f"{scheme}://{name}" for scheme in ("http", "https") for name in names)


@dataclass(frozen=True)
class Allowed:
    """The Host names and the Origins the server answers; None: any."""

    hosts: frozenset[str] | None = LOOPBACK
    origins: frozenset[str] | None = _web(LOOPBACK)

    def refusal(self, host: str | None, origin: str | None) -> str | None:
        """Why a request with these headers is refused, or None."""
        if self.hosts is not None and _hostname(f"//{host or ''}") not in self.hosts:
            return (
                f"Host {host!r} is not one this server answers (a page whose name re-resolves to this "
                "machine, DNS rebinding, looks like this); start it with --allowed-hosts NAME to allow it."
            )
        if origin is not None and self.origins is not None and _origin(origin) not in self.origins:
            return (
                f"Origin {origin!r} may not use this server (a page of another site sent it); start it "
                "with --allowed-origins ORIGIN to allow it."
            )
        return None


def _hostname(url: str) -> str | None:
    try:
        return urlsplit(url).hostname  # lower case, without port or brackets
    except ValueError:  # "[::1" and the like
        return None


def _origin(origin: str) -> str:
    """'HTTP://LocalHost:3000' -> 'http://localhost' (ports do not matter); "null" stays "null"."""
    return f"{origin.partition('://')[0].lower()}://{_hostname(origin)}" if "://" in origin else origin


def _listed(text: str | None, normal) -> frozenset[str] | None:
    """A flag's comma-separated values, each made `normal`; "*" -> None (any)."""
    values = [value.strip() for value in (text or "").split(",") if value.strip()]
    return None if "*" in values else frozenset(normal(value) for value in values)


def allowed_for(listen_host: str, hosts: str | None = None, origins: str | None = None) -> Allowed:
    """What a server listening on `listen_host` answers, widened by --allowed-hosts and
    --allowed-origins (`hosts`, `origins`: comma-separated, or "*")."""
    listen = listen_host.strip("[]").lower()
    everywhere = listen in EVERY_ADDRESS
    local = LOOPBACK if everywhere else LOOPBACK | {listen}
    more_hosts = _listed(hosts, lambda name: name.lower().strip("[]"))
    more_origins = _listed(origins, _origin)
    unchecked_hosts = more_hosts is None or (everywhere and not more_hosts)
    return Allowed(
        None if unchecked_hosts else local | more_hosts,
        None if more_origins is None else _web(local) | more_origins,
    )


class HostOriginCheck:
    """ASGI middleware: a request `allowed` refuses gets its 403 here, before any route."""

    def __init__(self, app, allowed: Allowed):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
            refusal = self.allowed.refusal(headers.get("host"), headers.get("origin"))
            if refusal is not None:
                body = json.dumps(error_body(403, refusal)).encode()
                start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 403, "headers": start})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
