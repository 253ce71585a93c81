"""Structured output: a grammar becomes a mask over the vocabulary, at every step.

To make a model answer in JSON that fits a schema, or match a regex, or pick one of a few
strings, nothing about the model changes. Before each token is drawn, every token that cannot
continue the text inside the grammar gets the logit -inf. The model then chooses freely among
the tokens that remain. Once the grammar is complete, only the model's EOS tokens remain.

A token is many bytes, and any of them may cut through a JSON string, a number or a keyword. So
which tokens fit is a question about the grammar and the whole vocabulary at once. That is the
job of a grammar library: llguidance (Microsoft's, in Rust) walks a trie of the vocabulary's
bytes against an Earley parser and a lazy lexer. It answers with a bitmask of one bit per token,
in tens of microseconds. We use it the way vLLM and SGLang use llguidance or xgrammar. Per
sequence, a matcher holds the parser's state (`GrammarState`). Each drawn token moves it on.
Per step, one bitmask holds every constrained row (filled in parallel by the library's
threads). One `masked_fill` applies it to the logits (`mask_logits`). There is no Python loop
over the vocabulary.

Why llguidance and not xgrammar (both measured on SmolLM2's 49,152-token vocabulary, on this
CPU, in docs/structured.md):
- llguidance has no dependencies and imports in 0.02 s. Its numpy helpers fill the mask (its torch
  helpers would `torch.compile` a function at import: 1.5 s on every start).
- xgrammar needs transformers, triton and pydantic, and imports in 2.6 s.
- Both compile a schema in a few milliseconds and fill a mask in 5-60 us per token. The whole
  mask (fill, unpack, apply) costs 2-12 ms per step at batch 16 depending on the CPU, and decode
  under a grammar ran at 0.98x the unconstrained tok/s (`minillm bench structured`,
  docs/structured.md).

What a request may ask for (`StructuredOutput`, vLLM's `structured_outputs` / `guided_*`):
- `json`: a JSON schema.
- `json_object`: any JSON object.
- `regex`.
- `choice`: one of a list of strings.
- `grammar`: a Lark grammar, in llguidance's dialect.

JSON is written compactly (no whitespace between items): a whitespace-flexible grammar lets a
weak model pad forever, and the schema says nothing about layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import llguidance
import llguidance.numpy
import torch

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_CHOICES = 256  # strings one `choice` may list


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: exactly one of the fields below."""

    json: str | None = None  # a JSON schema, as JSON text (`of_schema` takes a dict)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is one of these strings
    grammar: str | None = None  # a Lark grammar (llguidance's dialect)

    def __post_init__(self):
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    @classmethod
    def of_schema(cls, schema: dict | str) -> "StructuredOutput":
        return cls(json=schema if isinstance(schema, str) else json.dumps(schema))

    def problem(self) -> str | None:
        chosen = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(chosen) != 1:
            names = ", ".join(f.name for f in fields(self))
            return f"structured output takes exactly one of {names}; got {', '.join(chosen) or 'none'}"
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                return f"structured output's {name} must be a non-empty string, got {type(value).__name__}"
        if self.json_object is not False and self.json_object is not True:
            return f"structured output's json_object must be true or false, got {self.json_object!r}"
        if self.choice is not None and not (
            isinstance(self.choice, tuple)
            and 0 < len(self.choice) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in self.choice)
        ):
            return f"structured output's choice must be 1 to {MAX_CHOICES} non-empty strings"
        return None

    def llguidance_grammar(self) -> str:
        """The grammar as llguidance takes it (its own JSON form, or Lark)."""
        compile_json = llguidance.LLMatcher.grammar_from_json_schema
        if self.json is not None:
            return compile_json(self.json, defaults=JSON_LAYOUT)
        if self.json_object:
            return compile_json({"type": "object"}, defaults=JSON_LAYOUT)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:  # Lark string literals take JSON's escapes
            alternatives = " | ".join(map(json.dumps, self.choice))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)


class GrammarState:
    """One sequence's place in its grammar: which tokens may come next, and the move each
    drawn token makes. A parallel sample gets its own copy (`fork`)."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def fork(self) -> "GrammarState":
        return GrammarState(self._matcher.deep_copy())

    def advance(self, token_id: int) -> None:
        """The drawn token moves the parser on. A token the mask allowed always fits, so a refusal
        means the draw ignored the mask (a custom sampler)."""
        if not self._matcher.consume_token(token_id):
            error = one_line(self._matcher.get_error())
            raise ValueError(f"token {token_id} does not fit the structured output: {error}")

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The library's matcher, for `Grammars.mask_logits` to fill masks from."""
        return self._matcher


class Grammars:
    """Compiles requests' grammars for one vocabulary, and masks a batch of logits by them.
    Built on the first constrained request (the vocabulary index takes ~0.2 s)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        """`eos_token_ids`: the tokens that end a sequence, which a complete grammar allows (every one)."""
        if not eos_token_ids:
            raise ValueError("Structured output ends at EOS, and this checkpoint names no EOS token.")
        self.vocab_size = vocab_size  # the model's logits width (a vocabulary may be padded past the tokens)
        self._tokenizer = llguidance.LLTokenizer.from_tiktoken(
            encoder=tokenizer.ranks,
            special_tokens=tokenizer.special_tokens,
            pattern=tokenizer.pattern,
            eos_token=sorted(eos_token_ids),
            n_vocab=self.vocab_size,
        )
        self._executor = llguidance.LLExecutor()

    def start(self, spec: StructuredOutput) -> GrammarState:
        """A fresh state for a new request; a grammar the library cannot compile (a bad schema, a
        bad regex, one over its size limits) is a ValueError that quotes the library."""
        matcher = llguidance.LLMatcher(self._tokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured output: {one_line(matcher.get_error())}")
        return GrammarState(matcher)

    def mask_logits(self, logits: torch.Tensor, states: list[GrammarState | None]) -> None:
        """logits (rows, vocab_size), in place: row i keeps only the tokens states[i] allows (a
        row whose state is None keeps all; a complete grammar allows EOS alone). One bitmask for
        all rows, filled in parallel, applied by one masked_fill_."""
        constrained = [(state.matcher, row) for row, state in enumerate(states) if state is not None]
        if not constrained:
            return
        rows = len(states)
        bitmask = llguidance.numpy.allocate_token_bitmask(rows, self.vocab_size)  # (rows, words), all set
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, constrained, bitmask)
        logits.masked_fill_(~unpack_bits(torch.from_numpy(bitmask), self.vocab_size), float("-inf"))


def one_line(message: str, most: int = 300) -> str:
    """The library's error (a parser's, drawn over several lines) on one line, cut short."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= most else text[: most - 3] + "..."


BIT_VALUES = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32, bit b of word w for token 32 * w + b -> (rows, vocab_size) bool.
    Read as little-endian bytes, bit b of byte k is token 8 * k + b."""
    as_bytes = bitmask.view(torch.uint8)  # (rows, 4 * words)
    return (as_bytes.unsqueeze(-1) & BIT_VALUES).ne(0).flatten(1)[:, :vocab_size]
