"""The engines behind the router: which are live, and how a dead one comes back.

An engine is taken for dead when a request cannot reach it or it refuses for lack of service (a
connection refused or cut, a timeout, a 502/503/504 before any byte of its answer), or when its
event feed cannot connect. Its part of the index is dropped (a restarted engine has an empty
cache; its feed's first message will say what it holds). A dead engine is probed with GET /health
every PROBE_S seconds and is live again once it answers 200.
"""

from __future__ import annotations

import asyncio

import httpx2

from minillm.route.index import BlockIndex

PROBE_S = 1.0  # between two probes of a dead engine, and each probe's deadline


class EnginePool:
    def __init__(self, urls: list[str], index: BlockIndex, client: httpx2.AsyncClient, headers: dict):
        self.urls, self.index, self.client, self.headers = list(urls), index, client, headers
        self.dead: set[str] = set()
        self.probes: dict[str, asyncio.Task] = {}

    @property
    def live(self) -> list[str]:
        """The live engines, in the order they were given."""
        return [url for url in self.urls if url not in self.dead]

    def is_live(self, url: str) -> bool:
        return url not in self.dead

    def mark_dead(self, url: str) -> None:
        """Stop routing to `url`, forget what it cached, and probe it until it answers again."""
        if url in self.dead:
            return
        self.dead.add(url)
        self.index.drop(url)
        self.probes[url] = asyncio.create_task(self._probe(url), name=f"probe {url}")

    async def stop(self) -> None:
        for task in self.probes.values():
            task.cancel()
        await asyncio.gather(*self.probes.values(), return_exceptions=True)

    async def _probe(self, url: str) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            try:
                response = await self.client.get(f"{url}/health", headers=self.headers, timeout=PROBE_S)
            except httpx2.HTTPError:
                continue
            if response.status_code == 200:
                self.dead.discard(url)
                del self.probes[url]
                return
