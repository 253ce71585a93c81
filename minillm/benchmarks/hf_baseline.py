"""HF transformers serving a trace: `generate` on left-padded static batches, the baseline that
`bench serve` and `bench staircase` hold minillm against.

A batch runs until its longest request is done (static batching: nobody joins a running batch);
each request counts only its own tokens. Its time to first token and time per output token come
from a streamer (`_TokenClock`) that notes when each of the batch's tokens appears.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from minillm.config import is_gguf


def hf_model(model_path: str | Path, dtype: torch.dtype):
    """transformers' model of the checkpoint, in eval mode: a folder, or a GGUF file read by
    transformers' own GGUF loader (which dequantizes it, and drops Llama 3's rope_freqs and Qwen3's
    key_length: those two families' baselines run a plain-RoPE, hidden/heads-head_dim model)."""
    from transformers import AutoModelForCausalLM  # test-only dependency: pip install -e '.[test]'

    path = Path(model_path)
    if is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


class _TokenClock:
    """A `generate` streamer that notes when each new token (of the whole batch) appears."""

    def __init__(self):
        self.times: list[float] = []
        self.saw_prompt = False

    def put(self, value):
        if self.saw_prompt:
            self.times.append(time.perf_counter())
        self.saw_prompt = True

    def end(self):
        pass


def hf_static(hf_model, trace, batch_size: int) -> tuple[list[dict], float]:
    """HF transformers' `generate` on left-padded batches of `batch_size`, in trace order, greedy:
    each request's tokens, TTFT and TPOT (None for a single token), and the elapsed seconds. A batch
    runs until its longest request is done; request i is done when its own n-th token appears, and
    only those n tokens are its output."""
    start = time.perf_counter()
    requests = []
    for first in range(0, len(trace), batch_size):
        batch = trace[first : first + batch_size]
        prompts = [r.prompt_ids for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf_model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf_model.device)
        longest = max(r.output_len for r in batch)
        clock = _TokenClock()
        with torch.inference_mode():
            generated = hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
                streamer=clock,
            )  # (batch, width + longest)
        for row, n in enumerate(r.output_len for r in batch):
            requests.append(
                {
                    "token_ids": generated[row, width : width + n].tolist(),
                    "ttft": clock.times[0] - start,
                    "tpot": (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None,
                }
            )
    return requests, time.perf_counter() - start
