"""One loaded model with its tokenizer, for single-sequence decoding (`minillm generate`, `info`).

`Runtime(EngineConfig)` loads the checkpoint once; `generate` / `stream_text` run one request
through the decoder each call names: "naive" (the oracle) or "cached". The serving engine (many
requests, paged memory) grows beside it in `minillm.engine`.
"""

from __future__ import annotations

from typing import Iterator

from minillm.config import EngineConfig
from minillm.decoding import Generation, generate, stream
from minillm.matmul import bf16_kernel
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer, end_of_sequence
from minillm.weights import load_model_for


class Runtime:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model = load_model_for(config)
        # bf16 on a CPU decodes through the C++ products: a first run builds them here, so the
        # build is reported as a build (kernels.build says how long), not as a first token's latency
        bf16_kernel(next(self.model.parameters()))
        self.context_len = self.model.config.context_len(config.max_seq_len)
        self.tokenizer = Tokenizer(config.model_dir)
        self.eos_token_ids = end_of_sequence(self.model.config.eos_token_ids, self.tokenizer)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.config.kv_bytes_per_token(self.model.dtype)

    def prompt_ids(self, prompt: str, chat: bool = False, template_vars: dict | None = None) -> list[int]:
        """The prompt as text, or (`chat`) as a user's turn through the chat template, which
        reads `template_vars` as its own variables."""
        if not chat:
            return self.tokenizer.encode_prompt(prompt)
        return self.tokenizer.encode_chat([{"role": "user", "content": prompt}], **(template_vars or {}))

    def generate(self, prompt_ids: list[int], params: SamplingParams, decoder: str = "cached") -> Generation:
        return generate(self.model, prompt_ids, params, decoder, self.eos_token_ids, self.context_len)

    def stream_text(
        self, prompt_ids: list[int], params: SamplingParams, decoder: str = "cached"
    ) -> Iterator[tuple[str, Generation]]:
        """Yield (new text, generation so far) per token; the EOS token itself prints nothing."""
        text = self.tokenizer.stream_decoder()
        gen = None
        for token, gen in stream(
            self.model, prompt_ids, params, decoder, self.eos_token_ids, self.context_len
        ):
            if token not in self.eos_token_ids:
                yield text.feed(token), gen
        if gen is not None:
            yield text.flush(), gen
