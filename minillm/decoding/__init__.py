"""Decoding one sequence: the naive oracle, the cached decoder, and the loop they share.

naive.py   no cache: every step recomputes the whole sequence (the oracle)
cached.py  one contiguous KV cache, grown a token at a time

Both decoders answer two questions — `prefill(prompt_ids)` and `step(token_id)` — with the
logits for the next token. `generate` turns those logits into tokens until an end-of-sequence
token (any of `eos_token_ids`: a model may have several), the token limit, or the end of the context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

from minillm.config import ConfigError, prompt_problem
from minillm.decoding.cached import CachedDecoder
from minillm.decoding.naive import NaiveDecoder
from minillm.model import Transformer
from minillm.sampling import Sampler, SamplingParams

DECODERS = {"naive": NaiveDecoder, "cached": CachedDecoder}


class PromptError(ValueError):
    """A prompt these decoders cannot run: empty, not token ids of this vocabulary, or too long."""


def check_prompt(prompt_ids: list[int], context_len: int, vocab_size: int) -> None:
    problem = prompt_problem(prompt_ids, context_len, vocab_size)
    if problem:
        raise PromptError(problem)


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "eos" or "length"
    prefill_s: float = 0.0  # time to first token
    decode_s: float = 0.0  # time for the remaining tokens
    kv_bytes: int = 0

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first per second; None (JSON null) with a single token, whose
        decode time is zero: a rate that was not measured, not NaN."""
        return (len(self.token_ids) - 1) / self.decode_s if self.decode_s > 0 else None


def stream(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    decoder: str = "cached",
    eos_token_ids: frozenset[int] = frozenset(),
    context_len: int | None = None,
) -> Iterator[tuple[int, Generation]]:
    """Yield (token_id, generation so far) for every new token; the generation carries timings."""
    if decoder not in DECODERS:
        raise ConfigError(f"decoder must be 'naive' or 'cached', not {decoder!r}.")
    context_len = model.config.context_len(context_len)
    check_prompt(prompt_ids, context_len, model.config.vocab_size)
    max_new = context_len - len(prompt_ids)  # max_tokens=None: the rest of the context
    if params.max_tokens is not None:
        max_new = min(params.max_tokens, max_new)
    decoder_impl = DECODERS[decoder](model, len(prompt_ids) + max_new)
    sampler = Sampler(params)
    gen = Generation(prompt_ids=list(prompt_ids), kv_bytes=decoder_impl.kv_bytes)

    start = time.perf_counter()
    logits = decoder_impl.prefill(prompt_ids)
    for i in range(max_new):
        token = sampler(logits)
        gen.token_ids.append(token)
        now = time.perf_counter()
        if i == 0:
            gen.prefill_s, start = now - start, now
        else:
            gen.decode_s = now - start
        yield token, gen
        if token in eos_token_ids and not params.ignore_eos:
            gen.finish_reason = "eos"
            return
        if i + 1 < max_new:
            logits = decoder_impl.step(token)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    params: SamplingParams,
    decoder: str = "cached",
    eos_token_ids: frozenset[int] = frozenset(),
    context_len: int | None = None,
) -> Generation:
    gen = None
    for _, gen in stream(model, prompt_ids, params, decoder, eos_token_ids, context_len):
        pass
    return gen
