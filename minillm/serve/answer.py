"""One request's answer, as the engine's outputs arrive: each choice's text (n per prompt), then
one JSON body at the end, or a stream of server-sent events as it goes.

`app.py` checks a request at the door and submits it to the engine loop; `Answer` turns the
submission's outputs into choices (stop strings, logprobs, echo, usage: `responses.py`) and aborts
in the engine whatever the client no longer waits for: a prompt whose choices have all stopped, or
every prompt once the client has gone (`watch_disconnect`, `EventStream`).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minillm.engine.memory_aware import LATE_REFUSAL
from minillm.serve.commands import ShuttingDown
from minillm.serve.engine_loop import Submission
from minillm.serve.errors import error_body
from minillm.serve.protocol import Job
from minillm.serve.responses import (
    DONE,
    ChoiceText,
    LogprobsWriter,
    chunk,
    delta_choice,
    response_body,
    sse,
    usage,
)


class EventStream(StreamingResponse):
    """Server-sent events; however the response ends (finished, client gone before the first
    chunk, cancelled), what still runs of its request is aborted."""

    def __init__(self, events, submission: Submission):
        super().__init__(events, media_type="text/event-stream")
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()


class Answer:
    """One request's choices (n per prompt, in prompt order) filled in as outputs arrive."""

    def __init__(self, job: Job, submission: Submission, engine):
        self.job, self.submission = job, submission
        n = job.params.n
        self.choices = [
            ChoiceText(
                engine.tokenizer,
                job.stop,
                engine.eos_token_ids,
                engine.max_len(len(prompt), job.params.max_tokens) - len(prompt),  # new tokens at most
                job.params.ignore_eos,
                job.params.stop_token_ids,
            )
            for prompt in job.prompts
            for _ in range(n)
        ]
        self.cached_tokens: dict[int, int] = {}  # prompt index -> tokens its prefix-cache lookup gave
        scored = job.params.logprobs is not None
        self.writers = [
            LogprobsWriter(job, engine.tokenizer, engine.eos_token_ids) if scored else None
            for _ in self.choices
        ]

    def update(self, index: int, out) -> list[tuple[int, str, bool]]:
        """Feed prompt `index`'s output to its choices; (choice, new text, just finished) for each
        that has something to send. Once all its choices have stopped, the engine request is aborted."""
        n, changed = self.job.params.n, []
        if out.finish_reason == "error":
            raise RuntimeError(out.error)
        if out.prefix_miss is not None:  # the prefix cache is on and the prompt was looked up
            self.cached_tokens[index] = out.prefix_miss.cached_tokens
        for j in range(n):
            choice = self.choices[index * n + j]
            if choice.done:
                continue
            tokens = out.samples[j] if j < len(out.samples) else []
            text = choice.update(tokens, out.finish_reason if out.finished else None)
            if out.logprobs is not None and j < len(out.logprobs):
                choice.logprobs = out.logprobs[j][: choice.num_tokens]
            choice.prompt_ids, choice.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs or []
            if text or choice.done:
                changed.append((index * n + j, text, choice.done))
        if not out.finished and all(c.done for c in self.choices[index * n : (index + 1) * n]):
            self.submission.abort(index, "stop")
        return changed

    def logprobs(self, index: int) -> dict | None:
        """Choice `index`'s logprobs since they were last taken, when the request asked."""
        writer = self.writers[index]
        return writer.take(self.choices[index]) if writer is not None else None

    def usage(self) -> dict:
        """Tokens in and out; the cached prompt tokens once every prompt's lookup is known."""
        cached = (
            sum(self.cached_tokens.values()) if len(self.cached_tokens) == len(self.job.prompts) else None
        )
        return usage(sum(map(len, self.job.prompts)), sum(c.num_tokens for c in self.choices), cached)

    async def whole(self, request: Request):
        """Run to the end, then answer in one body; a client that leaves first aborts the request."""
        watcher = asyncio.create_task(watch_disconnect(request, self.submission))
        try:
            async for index, out in self.submission.outputs():
                self.update(index, out)
        except RuntimeError as err:
            status = error_status(err)
            retry = {"Retry-After": "1"} if str(err).startswith(LATE_REFUSAL) else None
            return JSONResponse(error_body(status, str(err)), status_code=status, headers=retry)
        finally:
            watcher.cancel()
            self.submission.close("stop")
        if any(not c.done for c in self.choices):  # the client left; nobody reads this
            return Response(status_code=499)
        logprobs = [self.logprobs(i) for i in range(len(self.choices))]
        return JSONResponse(response_body(self.job, self.choices, logprobs, self.usage()))

    async def events(self, request: Request):
        """The stream: one chunk per choice that changed, [DONE] last; with echo, a choice's first
        chunk starts with its prompt. An engine failure after the stream has begun arrives as an
        error event (vLLM's way), then [DONE]."""
        job, watcher = self.job, asyncio.create_task(watch_disconnect(request, self.submission))
        echoed = set()  # choices whose prompt has been sent
        try:
            if job.kind == "chat":
                for i in range(len(self.choices)):
                    yield chunk(job, [delta_choice(job, i, "", first=True)])
            async for index, out in self.submission.outputs():
                for i, text, finished in self.update(index, out):
                    choice = self.choices[i]
                    if job.echo and i not in echoed:
                        text = choice.prompt_text + text
                        echoed.add(i)
                    ids = choice.take_token_ids() if job.return_token_ids else None
                    ending = choice if finished else None
                    yield chunk(job, [delta_choice(job, i, text, self.logprobs(i), ending, token_ids=ids)])
            if job.include_usage:
                yield chunk(job, [], self.usage())
            yield DONE
        except RuntimeError as err:
            yield sse(error_body(error_status(err), str(err)))
            yield DONE
        finally:
            watcher.cancel()
            self.submission.close()


def error_status(err: RuntimeError) -> int:
    """503 for a request the server could not serve now (overloaded: --refuse-late; stopping),
    500 for an engine failure."""
    return 503 if isinstance(err, ShuttingDown) or str(err).startswith(LATE_REFUSAL) else 500


async def watch_disconnect(request: Request, submission: Submission) -> None:
    """Wait for the client to go away, then abort whatever of its request still runs."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            submission.close()
            return
