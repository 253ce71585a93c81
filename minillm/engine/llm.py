"""`LLM`: the engine behind a vLLM-shaped API, for a whole batch of prompts at once.

    llm = LLM("weights/SmolLM2-135M-Instruct", block_size=16, prefix_caching=True)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

It adds every prompt to an `LLMEngine` and steps it until all have finished; `stream` yields one
request's output token by token. The keyword switches are `EngineConfig` fields, as `config.SWITCHES`
declares them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator
from typing import Sequence as Seq

from minillm.config import DEFAULT_MODEL_DIR, SWITCHES, ConfigError, EngineConfig
from minillm.engine.engine import LLMEngine
from minillm.engine.outputs import RequestOutput
from minillm.model import Transformer
from minillm.progress import progress_bar
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer

_KEYWORDS = tuple(name for name in SWITCHES if name != "model_dir")  # model_dir is the first argument


class LLM:
    """`LLM(model_dir, **switches)`; switches are `EngineConfig` fields (block_size, scheduling, ...)."""

    def __init__(
        self,
        model_dir: str | Path = DEFAULT_MODEL_DIR,
        *,
        model: Transformer | None = None,
        tokenizer: Tokenizer | None = None,
        **switches,
    ):
        unknown = [name for name in switches if name not in _KEYWORDS]
        if unknown:
            raise ConfigError(f"LLM has no switch {unknown[0]!r}; the switches are {', '.join(_KEYWORDS)}.")
        self.engine = LLMEngine(EngineConfig(model_dir=Path(model_dir), **switches), model, tokenizer)

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(params_list)} SamplingParams; give one for each "
                "prompt, or a single one for all."
            )
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        with progress_bar("requests", len(ids), enabled=progress) as advance:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        advance()
        return [final[i] for i in ids]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's output each time it gains a token (the last one is finished). A
        caller that stops reading early (closes the generator) aborts the request: its blocks go
        back to the pool."""
        request_id = self.engine.add_request(prompt, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            if self.engine.has_request(request_id):
                self.engine.abort(request_id)
