"""`/compare`: the last prompt answered twice, on fresh engines, as now and with one switch changed.

A lossless switch (block size, prefix caching, pool size, attention backend) must give the very
tokens it gave before; a lossy one (KV quantization, eviction, bf16, sampling) may not. The table
puts both answers side by side, their time and KV held, and the line under it names the first
token where they part.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.table import Table


@dataclass
class Answer:
    """One prompt answered on a fresh engine, for /compare."""

    token_ids: list[int]
    text: str
    seconds: float  # prefill and decode, by the wall clock
    ttft: float
    kv_bytes: int  # the most KV the request held at once (whole blocks, scales included)
    bytes_per_token: int


def answer(llm, prompt_ids: list[int], params) -> Answer:
    start = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    seconds = time.perf_counter() - start
    if out.error:
        raise ValueError(out.error)
    per_token = llm.engine.snapshot().bytes_per_token
    peak = max(stats.reserved_slots for stats in llm.engine.stats.memory)
    return Answer(out.token_ids, out.text, seconds, out.ttft, peak * per_token, per_token)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (or where the shorter one ends); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def comparison_table(title: str, name_a: str, name_b: str, a: Answer, b: Answer) -> Table:
    table = Table(title=title)
    table.add_column("")
    table.add_column(name_a, overflow="fold")
    table.add_column(name_b, overflow="fold")
    rows = [
        ("text", a.text, b.text),
        ("tokens", f"{len(a.token_ids):,}", f"{len(b.token_ids):,}"),
        ("time", f"{a.seconds:.2f} s", f"{b.seconds:.2f} s"),
        ("first token", f"{a.ttft * 1000:,.0f} ms", f"{b.ttft * 1000:,.0f} ms"),
        ("KV held", f"{a.kv_bytes / 2**20:,.2f} MiB", f"{b.kv_bytes / 2**20:,.2f} MiB"),
        ("KV B/token", f"{a.bytes_per_token:,}", f"{b.bytes_per_token:,}"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def difference_line(a: Answer, b: Answer, decode) -> str:
    """Where the two answers part, in words; `decode` turns token ids into text."""
    index = first_difference(a.token_ids, b.token_ids)
    if index is None:
        return f"identical: all {len(a.token_ids):,} tokens are the same"

    def token(ids: list[int]) -> str:
        return repr(decode(ids[index : index + 1])) if index < len(ids) else "(ended)"

    return f"first differs at token {index}: {token(a.token_ids)} vs {token(b.token_ids)}"
