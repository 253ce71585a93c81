"""Serving many requests at once: sequences, the scheduler, and the engine that runs them.

    from minillm.engine import LLM, SamplingParams
    llm = LLM("weights/SmolLM2-135M-Instruct", block_size=16, kv_cache_bytes=64 << 20)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
"""

from minillm.engine.engine import LLM, LLMEngine, RequestOutput
from minillm.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
