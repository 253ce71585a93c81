"""The OpenAI API as vLLM serves it, the way out: each choice's text as its tokens arrive, and the
response bodies and stream chunks that carry it.

`ChoiceText` follows one choice's tokens as they arrive: text decoded a token at a time (a
character split across tokens waits for its last byte), stop strings found and cut off (text that
may be the start of one is held back), and the choice's finish reason. The `*_body` and `chunk`
functions build the JSON shapes of vLLM's OpenAI server, so a client written against minillm
moves to vLLM unchanged.
"""

from __future__ import annotations

import json

from minillm.sampling import TokenLogprob
from minillm.serve.protocol import Job
from minillm.tokenizer import Tokenizer

FINISH_REASONS = {"eos": "stop", "length": "length", "abort": "abort", "error": "error"}


class ChoiceText:
    """One choice (one sample of one prompt) as its tokens arrive: its text, the part of it the
    client has been sent, and why it ended. Text that could be the start of a stop string is held
    back until it is not; a stop string found ends the choice, cut before it (vLLM's default).
    Each update searches only the new text and the held-back tail, so its cost on the event loop is
    bounded by the number and length of the stop strings (`ServeLimits` caps both)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        eos_token_ids: frozenset[int],
        max_new_tokens: int,
        ignore_eos: bool,
        stop_token_ids: tuple[int, ...] = (),
    ):
        self.tokenizer, self.decoder = tokenizer, tokenizer.stream_decoder()
        self.logprobs: list[TokenLogprob] = []  # of the tokens taken, when the request asked
        self.prompt_ids: list[int] = []  # echo: the prompt, its text and its logprobs first
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.stop, self.max_new, self.ignore_eos = stop, max_new_tokens, ignore_eos
        self.eos_token_ids, self.stop_token_ids = eos_token_ids, stop_token_ids
        self.hidden = {*eos_token_ids, *stop_token_ids}  # never text, as in RequestOutput.text
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent, self.num_tokens = "", 0, 0
        self.token_ids: list[int] = []  # every token taken, EOS and stop tokens included
        self.ids_sent = 0  # ...of which a stream has sent (`return_token_ids`)
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None

    @property
    def prompt_text(self) -> str:
        return self.tokenizer.decode(self.prompt_ids)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def update(self, token_ids: list[int], engine_finish: str | None = None) -> str:
        """Take the choice's tokens so far; return the new text to send (may be ""). `engine_finish`
        is the engine's finish reason once the whole request has finished."""
        if self.done:
            return ""
        searched_from = max(0, len(self.text) - self.hold)
        self.token_ids += token_ids[self.num_tokens :]
        for token in token_ids[self.num_tokens :]:
            if token not in self.hidden:
                self.text += self.decoder.feed(token)
        self.num_tokens = len(token_ids)
        ended_by_engine = self.ended(token_ids)
        if engine_finish is not None and not ended_by_engine:
            ended_by_engine = FINISH_REASONS.get(engine_finish, engine_finish)
        if ended_by_engine:
            self.text += self.decoder.flush()
        found = [(self.text.find(s, searched_from), s) for s in self.stop]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, self.stop_reason = min(found)
            self.text, self.finish_reason = self.text[:at], "stop"
        elif ended_by_engine:
            self.finish_reason = ended_by_engine
        safe = len(self.text) if self.done else len(self.text) - self.hold
        delta = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta

    def ended(self, token_ids: list[int]) -> str | None:
        """Whether this sample has ended by the engine's rules (it may end before its request does,
        when the request has n samples): EOS, or max_tokens (or the context) reached."""
        last = token_ids[-1] if token_ids else None
        if last in self.eos_token_ids and not self.ignore_eos or last in self.stop_token_ids:
            return "stop"
        return "length" if len(token_ids) >= self.max_new else None

    def take_token_ids(self) -> list[int]:
        """The token ids taken since the last call: a stream chunk's (`return_token_ids`)."""
        ids, self.ids_sent = self.token_ids[self.ids_sent :], len(self.token_ids)
        return ids


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; `cached_tokens` (the prompt tokens the prefix cache gave, known with the
    cache on) goes in `prompt_tokens_details`, where OpenAI and vLLM put it."""
    body = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


class LogprobsWriter:
    """One choice's logprobs in the endpoint's shape (OpenAI's), a few tokens at a time: each
    `take` writes the tokens the choice took since the last (the prompt's first, with echo), so a
    stream's chunks together hold what one body holds. For completions, the parallel lists tokens,
    token_logprobs, top_logprobs ({token: logprob}) and text_offset (where each token's text starts
    in the choice's text, counted across takes); for chat, a list of {token, logprob, bytes,
    top_logprobs}. Every token the choice took is there, its EOS and a stop string's too."""

    def __init__(self, job: Job, tokenizer: Tokenizer, eos_token_ids: frozenset[int]):
        self.job, self.tokenizer = job, tokenizer
        self.written = 0  # of the choice's tokens
        self.prompt_written = not job.echo
        self.decoder, self.length = tokenizer.stream_decoder(), 0  # text_offset's running count
        self.hidden = {*eos_token_ids, *job.params.stop_token_ids}  # never text (ChoiceText)

    def take(self, choice: ChoiceText) -> dict:
        ids = [lp.token_id for lp in choice.logprobs[self.written :]]
        entries: list[TokenLogprob | None] = list(choice.logprobs[self.written :])
        self.written = len(choice.logprobs)
        if not self.prompt_written:  # the prompt's tokens first; its first has no log-probability
            ids, entries = choice.prompt_ids + ids, list(choice.prompt_logprobs) + entries
            self.prompt_written = True
        if self.job.kind == "chat":
            return {"content": [self._chat_entry(lp) for lp in entries]}
        return {
            "tokens": [self._text(token_id) for token_id in ids],
            "token_logprobs": [lp.logprob if lp else None for lp in entries],
            "top_logprobs": [{self._text(t): v for t, v in lp.top} if lp else None for lp in entries],
            "text_offset": [self._offset(token_id) for token_id in ids],
        }

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _chat_entry(self, lp: TokenLogprob) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            token_bytes = self.tokenizer.token_bytes(token_id)
            return {"token": self._text(token_id), "logprob": logprob, "bytes": list(token_bytes)}

        return {**item(lp.token_id, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}

    def _offset(self, token_id: int) -> int:
        """Where this token's text starts; the next token's starts after it."""
        offset = self.length
        if token_id not in self.hidden:
            self.length += len(self.decoder.feed(token_id))
        return offset


def prompt_logprobs_body(job: Job, choice: ChoiceText) -> list[dict | None] | None:
    """vLLM's prompt_logprobs: per prompt token (None for the first), {token id: {logprob, rank,
    decoded_token}} for the token and the k most likely."""
    if job.params.prompt_logprobs is None:
        return None
    tokenizer = choice.tokenizer

    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token_id])}

    return [
        None
        if lp is None
        else {
            str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank),
            **{str(t): entry(t, v, rank) for rank, (t, v) in enumerate(lp.top, 1) if t != lp.token_id},
        }
        for lp in choice.prompt_logprobs
    ]


def choice_text(job: Job, choice: ChoiceText) -> str:
    """The choice's text, after the prompt's with echo."""
    return (choice.prompt_text if job.echo else "") + choice.text


def choice_body(job: Job, index: int, choice: ChoiceText, logprobs: dict | None) -> dict:
    if job.kind == "chat":
        body = {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
    else:
        body = {
            "index": index,
            "text": choice_text(job, choice),
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "prompt_logprobs": prompt_logprobs_body(job, choice),
        }
    if job.return_token_ids:
        body["token_ids"] = choice.token_ids
    return body


def response_body(job: Job, choices: list[ChoiceText], logprobs: list[dict | None], usage_: dict) -> dict:
    """The whole answer of a request that did not stream; `logprobs` holds each choice's. A chat's
    prompt_logprobs are the response's (vLLM's place: one conversation), a completion's each
    choice's (each prompt of a batch its own)."""
    body = {
        "id": job.id,
        "object": "chat.completion" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": [choice_body(job, i, c, lp) for i, (c, lp) in enumerate(zip(choices, logprobs))],
        "usage": usage_,
    }
    if job.kind == "chat":
        body["prompt_logprobs"] = prompt_logprobs_body(job, choices[0])
    return body


def chunk(job: Job, choices: list[dict], usage_: dict | None = None) -> str:
    """One server-sent event of a stream."""
    body = {
        "id": job.id,
        "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return sse(body)


def delta_choice(
    job: Job,
    index: int,
    text: str,
    logprobs: dict | None = None,
    choice: ChoiceText | None = None,
    first: bool = False,
    token_ids: list[int] | None = None,
) -> dict:
    """A stream chunk's choice: new text, the logprobs (and with `return_token_ids` the ids) of the
    tokens taken since the choice's last chunk, and the finish reason on the choice's last chunk."""
    finish = choice.finish_reason if choice is not None else None
    stop_reason = choice.stop_reason if choice is not None else None
    if job.kind == "chat":
        delta = (
            {"role": "assistant", "content": text}
            if first
            else ({"content": text} if text or not finish else {})
        )
        body = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
    else:
        body = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }
    if token_ids is not None:
        body["token_ids"] = token_ids
    return body


def sse(body: dict | str) -> str:
    data = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


DONE = sse("[DONE]")
