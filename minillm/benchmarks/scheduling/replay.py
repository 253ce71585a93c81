"""A trace replayed through an engine on the wall clock, as a server would see it.

Arrivals come at their times; a chat turn comes THINK_S after its conversation's previous answer,
with the whole conversation as its prompt. Idle time is skipped (when nothing runs, the clock
jumps to the next arrival), so a run lasts as long as its work. Each request's time to first
token counts from its arrival, its wait in the queue included.

With `step_s` the trace's clock is the engine's steps times `step_s` instead of the wall's: each
arrival lands on the same step on any machine, so what the memory system does is the same run to
run (what `bench tiers` counts); times to first token then count from submission.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

from minillm.benchmarks.workload import Request, next_turn_prompt, submit_scripted
from minillm.progress import progress_bar


@dataclass
class Served:
    """What one request of the trace got."""

    kind: str
    prompt_len: int
    token_ids: list[int]
    ttft: float | None
    tpot: float | None
    error: str | None


def replay(
    engine,
    tokenizer,
    trace: list[Request],
    label: str = "",
    progress: bool = False,
    step_s: float | None = None,
) -> tuple:
    """Step the engine through the trace, on the wall's clock or (`step_s`) the steps'. Returns (what
    each request got, in trace order; the busy seconds; the engine steps)."""
    followers = {r.follows: index for index, r in enumerate(trace) if r.follows is not None}
    due = [(r.arrival_s, index) for index, r in enumerate(trace) if r.follows is None]  # (trace time, index)
    heapq.heapify(due)
    prompts: dict[int, list[int]] = {}
    served: dict[int, Served] = {}
    skipped = 0.0  # idle seconds the trace's clock has jumped over: it runs this far ahead of the wall's
    start = time.perf_counter()

    def now() -> float:  # trace time
        if step_s is not None:
            return engine.stats.steps * step_s + skipped
        return time.perf_counter() - start + skipped

    with progress_bar(f"{label}: requests", len(trace), enabled=progress) as advance:
        while due or engine.has_unfinished_requests():
            clock = now()
            if not engine.has_unfinished_requests() and due[0][0] > clock:
                skipped, clock = skipped + due[0][0] - clock, due[0][0]  # idle: jump to the next arrival
            while due and due[0][0] <= clock:
                arrival, index = heapq.heappop(due)
                wall_arrival = None if step_s is not None else arrival + start - skipped  # perf_counter()
                prompt = prompts.setdefault(index, trace[index].prompt_ids)
                submit_scripted(engine, index, trace[index], wall_arrival, prompt)
            for out in engine.step():
                if not out.finished:
                    continue
                index = int(out.request_id)
                served[index] = Served(
                    trace[index].kind, len(prompts[index]), out.token_ids, out.ttft, out.tpot, out.error
                )
                advance()
                if index in followers:
                    follower = followers[index]
                    prompts[follower] = next_turn_prompt(
                        tokenizer, prompts[index], out.token_ids, trace[follower].prompt_ids
                    )
                    heapq.heappush(due, (now() + trace[follower].arrival_s, follower))
    busy = time.perf_counter() - start  # the wall's time: the idle time was jumped over, never waited
    return [served[index] for index in range(len(trace))], busy, engine.stats.steps
