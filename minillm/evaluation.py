"""Perplexity through the KV cache: what a lossy cache (quantized, evicted) costs the model.

Perplexity is exp(mean negative log-likelihood of each token given the ones before it); lower is
better, and the change from the full-precision cache is the price of a compression switch.

The trap: a single forward pass over a window of text computes every position's logits from the
fresh keys and values of that same pass. The cache is written but never read, so quantization or
eviction would look free. Here every scored token is predicted by a *decode step*: a one-token
query whose attention reads all earlier tokens from the cache, stored however the switches say.
There is no other path in this module.

The text is cut into segments of `segment_len` tokens. Each segment is one engine request whose
prompt is the segment's first token and whose sampler is a `TeacherForcing` (given to
`add_request` as its `sampler`): it records log p(the text's next token) and then "samples" that
token, so the sequence follows the text.
All segments decode side by side, one token per step each.

The default text is Lewis Carroll's "Alice's Adventures in Wonderland" (public domain, Project
Gutenberg), the `alice29.txt` of the Canterbury corpus that the `brotli` source package on PyPI
ships as test data; `python weights_fetch.py` fetches it, and a text of another kind from the
same corpus: `lcet10.txt`, the proceedings of a 1992 workshop on electronic texts (numbered
lists, dates, names). A lossy policy tuned on one kind of text can fail on the other, so
`perplexities` scores several texts in one run and lesson 08 compares the eviction policies on
both.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from minillm.config import FETCH_HINT, ConfigError
from minillm.progress import progress_bar

DEFAULT_TEXT = Path("weights") / "texts" / "alice29.txt"  # prose
TECHNICAL_TEXT = Path("weights") / "texts" / "lcet10.txt"  # a workshop's proceedings


def read_text(path: Path = DEFAULT_TEXT) -> str:
    if not path.is_file():
        raise ConfigError(f"The evaluation text {path} is missing — {FETCH_HINT}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); give a UTF-8 text file."
        ) from None


class TeacherForcing:
    """A sampler that records log p(next text token) and returns that token."""

    def __init__(self, continuation: list[int]):
        self.continuation = continuation
        self.logprobs: list[float] = []

    def __call__(self, logits: torch.Tensor) -> int:
        token = self.continuation[len(self.logprobs)]
        self.logprobs.append(torch.log_softmax(logits.float(), dim=-1)[token].item())
        return token


@dataclass
class PerplexityResult:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, in nats
    tokens_scored: int
    segments: int
    segment_len: int
    seconds: float
    kv_bytes_per_token: int  # scales included
    tokens_evicted: int  # KV entries eviction dropped along the way

    def as_dict(self) -> dict:
        return asdict(self)


def segments_of(token_ids: list[int], segment_len: int, num_segments: int) -> list[list[int]]:
    available = len(token_ids) // segment_len
    if segment_len < 2 or available < num_segments:
        raise ConfigError(
            f"The text has {len(token_ids)} tokens: not enough for {num_segments} segments of "
            f"{segment_len} (each needs at least 2); ask for fewer or shorter segments."
        )
    return [token_ids[i * segment_len : (i + 1) * segment_len] for i in range(num_segments)]


def perplexity(
    llm, token_ids: list[int], segment_len: int = 512, num_segments: int = 4, progress: bool = False
) -> PerplexityResult:
    """Score `num_segments` segments of `segment_len` tokens through `llm`'s cache (see above)."""
    return perplexities(llm, {"text": token_ids}, segment_len, num_segments, progress)["text"]


def eval_ppl(
    model_dir: Path,
    text: Path = DEFAULT_TEXT,
    segment_len: int = 512,
    num_segments: int = 4,
    dtype: str = "float32",
    device: str = "cpu",
    progress: bool = False,
    **switches,
) -> dict:
    """`minillm eval ppl`: `text`'s perplexity through an engine whose cache the `switches` set
    (kv_dtype, kv_key_scales, eviction, kv_budget, attention_backend), as one report."""
    from minillm.engine import LLM

    content = read_text(text)  # a missing text fails before the model loads
    llm = LLM(model_dir, dtype=dtype, device=device, **switches)
    result = perplexity(llm, llm.engine.tokenizer.encode(content), segment_len, num_segments, progress)
    return {"text": str(text), **switches, **result.as_dict()}


def perplexities(
    llm, texts: dict[str, list[int]], segment_len: int = 512, num_segments: int = 4, progress: bool = False
) -> dict[str, PerplexityResult]:
    """Each text's perplexity, all texts' segments scored side by side in one run (a decode step
    costs about the same for a few sequences as for one). `seconds` is the whole run's."""
    from minillm.sampling import SamplingParams

    engine = llm.engine
    if segment_len > engine.context_len:
        raise ConfigError(
            f"segment_len={segment_len} is longer than the context ({engine.context_len}); lower it."
        )
    scorers: dict[str, list[TeacherForcing]] = {name: [] for name in texts}
    params = SamplingParams(max_tokens=segment_len - 1, ignore_eos=True)
    for name, token_ids in texts.items():
        for segment in segments_of(token_ids, segment_len, num_segments):
            scorer = TeacherForcing(segment[1:])
            engine.add_request(segment[:1], params, sampler=scorer)
            scorers[name].append(scorer)
    start = time.perf_counter()
    with progress_bar("scoring through the cache", segment_len - 1, enabled=progress) as advance:
        while engine.has_unfinished_requests():  # each step scores one more token of every segment
            for out in engine.step():
                if out.error:
                    raise ConfigError(out.error)
            advance()
    seconds = time.perf_counter() - start
    bytes_per_token = engine.snapshot().bytes_per_token
    results = {}
    for name, text_scorers in scorers.items():
        logprobs = [lp for scorer in text_scorers for lp in scorer.logprobs]
        nll = -sum(logprobs) / len(logprobs)
        results[name] = PerplexityResult(
            math.exp(nll),
            nll,
            len(logprobs),
            num_segments,
            segment_len,
            seconds,
            bytes_per_token,
            engine.stats.tokens_evicted,
        )
    return results
