"""From logits to the next token: greedy, temperature, top-k, top-p, with a seed.

`logprobs=k` also reports each chosen token's log-probability under the model's own distribution
(the raw logits' log-softmax, before temperature and cuts, as vLLM reports by default) and the k
most likely tokens' (`token_logprob`).

Before any of that, the logits controls users expect from the OpenAI API and vLLM, each with
vLLM's meaning (`process_logits`): `min_tokens` (no EOS token nor stop token can be drawn before
it), `logit_bias` (added to a token's logit), `repetition_penalty` (a token already in the prompt
or the output has its logit divided by it if positive, multiplied if negative),
`frequency_penalty` (minus the penalty times the token's count in the output) and
`presence_penalty` (minus the penalty once if it is in the output). `stop_token_ids` end a
sequence like EOS. `structured` (a `StructuredOutput`: a JSON schema, a regex, a choice) masks
every token that would leave its grammar, before all of these (`structured.py`).

`temperature=0` is greedy decoding (argmax), the mode every exactness test uses. Otherwise the
logits are divided by the temperature, cut to the k most likely tokens and then to the smallest
set whose probability reaches p ("nucleus"), and one token is drawn. Each request owns a seeded
`torch.Generator`, so the same seed gives the same sample whatever else runs beside it.

No parameter a request may pass can make the probabilities NaN or inf: a temperature below
GREEDY_BELOW is greedy (its limit), and the logits are scaled in float64, where no finite fp32
logit over a temperature of at least GREEDY_BELOW overflows; a huge temperature only flattens
the distribution towards uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minillm.structured import StructuredOutput

# Temperatures below this are greedy, as in vLLM (its _SAMPLING_EPS): the distribution is then
# argmax's to within float precision anyway, and logits / 1e-300 would overflow to inf and NaN.
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # most likely tokens reported per position at most (vLLM's max_logprobs default)


def is_real(value) -> bool:
    """A finite int or float (not a bool, a string, NaN, or an int too large to be a float)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        return False


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 (or below GREEDY_BELOW) means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut
    max_tokens: int | None = 64  # None: up to the context, as far as the KV pool holds (vLLM's chat default)
    seed: int | None = None  # sample i of n uses seed + i
    n: int = 1  # parallel samples of one prompt; they share the prompt's KV blocks
    beam_width: int = 1  # > 1: beam search (greedy over total log-probability) instead of sampling
    ignore_eos: bool = False  # benchmarks decode a fixed number of tokens
    logprobs: int | None = None  # report each new token's log-probability and the k most likely (0..20)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (vLLM's)
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; 1 is off: a seen token's logit / it (> 0) or * it (< 0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to logits
    min_tokens: int = 0  # EOS and stop_token_ids are not drawn before this many new tokens
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the sequence as EOS does
    structured: StructuredOutput | None = None  # the output must match this grammar (structured.py)

    def __post_init__(self):
        problems = [
            problem
            for problem in (
                self.number_problem(),
                self.count_problem(),
                self.seed_problem(),
                self.logprobs_problem(),
                self.logits_problem(),
            )
            if problem
        ]
        if not problems and self.beam_width > 1 and (not self.greedy or self.n != 1):
            problems.append("beam search is deterministic: use it with temperature=0 and n=1")
        if not problems and self.beam_width > 1 and self.processes_logits:
            problems.append("penalties, logit_bias and min_tokens apply to samples, not beams")
        if not problems and self.beam_width > 1 and (self.logprobs, self.prompt_logprobs) != (None, None):
            problems.append("logprobs are reported for samples, not beams (a beam's score is its sum)")
        if not problems and self.structured is not None:
            problems += self.structured_problem()
        if problems:
            raise ValueError("; ".join(problems) + ".")

    def number_problem(self) -> str | None:
        if not (is_real(self.temperature) and self.temperature >= 0):
            return f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}"
        if not (is_real(self.top_p) and 0 < self.top_p <= 1):
            return f"top_p must be a number in (0, 1], got {self.top_p!r}"
        return None

    def count_problem(self) -> str | None:
        for name, minimum, meaning in (
            ("top_k", 0, " (0 turns it off)"),
            ("n", 1, ""),
            ("beam_width", 1, ""),
            ("max_tokens", 1, " (or None for the rest of the context)"),
        ):
            value = getattr(self, name)
            if name == "max_tokens" and value is None:
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
                return f"{name} must be an integer >= {minimum}{meaning}, got {value!r}"
        return None

    def logprobs_problem(self) -> str | None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None or (
                isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_LOGPROBS
            ):
                continue
            return f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}"
        return None

    def logits_problem(self) -> str | None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (is_real(value) and -2 <= value <= 2):
                return f"{name} must be a number in [-2, 2] (0 is off), got {value!r}"
        if not (is_real(self.repetition_penalty) and self.repetition_penalty > 0):
            return f"repetition_penalty must be a number > 0 (1 is off), got {self.repetition_penalty!r}"
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and _is_id(pair[0])
            and is_real(pair[1])
            and -100 <= pair[1] <= 100
            for pair in bias
        ):
            return f"logit_bias must be (token id, bias in [-100, 100]) pairs, got {shown_short(bias)}"
        if not (
            isinstance(self.min_tokens, int)
            and not isinstance(self.min_tokens, bool)
            and self.min_tokens >= 0
        ):
            return f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        if isinstance(self.max_tokens, int) and self.min_tokens > self.max_tokens:
            return f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
        if not isinstance(self.stop_token_ids, tuple) or not all(map(_is_id, self.stop_token_ids)):
            return f"stop_token_ids must be token ids (integers >= 0), got {shown_short(self.stop_token_ids)}"
        return None

    def structured_problem(self) -> list[str]:
        if not isinstance(self.structured, StructuredOutput):
            return [f"structured must be a StructuredOutput, got {type(self.structured).__name__}"]
        if self.beam_width > 1:
            return ["structured output constrains samples, not beams"]
        if self.ignore_eos:
            return ["structured output ends at EOS when its grammar is complete: leave out ignore_eos"]
        return []

    @property
    def processes_logits(self) -> bool:
        """Does any control change the logits before sampling (`process_logits`)?"""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.min_tokens
        )

    def seed_problem(self) -> str | None:
        """Sample i of n is seeded with seed + i, and a torch seed has 64 bits."""
        if self.seed is None:
            return None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            return f"seed must be an integer in [0, 2**64), got {self.seed!r}"
        if isinstance(self.n, int) and self.seed + self.n > 2**64:
            return (
                f"seed + n must stay below 2**64 (sample i uses seed + i), "
                f"got seed {self.seed} with n={self.n}"
            )
        return None

    @property
    def num_outputs(self) -> int:
        """Token sequences a request returns: its beams or its samples."""
        return self.beam_width if self.beam_width > 1 else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def shown_short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    output_ids: list[int],
    eos_token_ids: frozenset[int],
) -> torch.Tensor:
    """logits (vocab,) -> the logits after the request's controls (module docstring), in vLLM's
    order: min_tokens, logit_bias, then the repetition, frequency and presence penalties."""
    logits = logits.float().clone()
    vocab = logits.numel()
    if len(output_ids) < params.min_tokens:
        banned = [t for t in (*eos_token_ids, *params.stop_token_ids) if t < vocab]
        logits[banned] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias])
        logits.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype))
    if params.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            values = logits[seen]
            penalty = params.repetition_penalty
            logits[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty or params.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids), minlength=vocab)[:vocab].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability, its rank in the vocabulary (1: the most likely), and the
    most likely tokens' (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int


def token_logprob(logits: torch.Tensor, token_id: int, top: int) -> TokenLogprob:
    """logits: (vocab_size,) the raw logits the token was drawn from."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (vocab_size,)
    best = torch.topk(logprobs, min(top, logprobs.numel())) if top else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    chosen = logprobs[token_id]
    return TokenLogprob(token_id, float(chosen), pairs, int((logprobs > chosen).sum()) + 1)


class Sampler:
    def __init__(self, params: SamplingParams, sample_index: int = 0):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed + sample_index)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (vocab_size,) fp32 -> the chosen token id."""
        if self.params.greedy:
            return int(logits.argmax())
        probs = self.filtered_probs(logits.cpu())
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def filtered_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (vocab_size,) -> the float64 probabilities the token is drawn from."""
        logits = logits.double() / self.params.temperature  # float64: cannot overflow (module docstring)
        if self.params.top_k:
            kth_largest = torch.topk(logits, min(self.params.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.params.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # keep a token if the mass *before* it is still below p: the top token always stays
            mass_before = sorted_probs.cumsum(-1) - sorted_probs
            sorted_probs[mass_before >= self.params.top_p] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return probs / probs.sum()
