"""Serving many requests at once: sequences, the scheduler, the runner, and the engine that steps them.

    from minillm.engine import LLM, SamplingParams
    llm = LLM("weights/SmolLM2-135M-Instruct", block_size=16, kv_cache_bytes=64 << 20)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

sequence.py   a request's tokens, how many have K/V computed, its timings
scheduler.py  admission, token budget, chunked prefill, preemption, forks, finishing (memory it asks
              of the KV cache manager: block tables, copy-on-write)
runner.py     one step's schedule -> one model forward (token ids, positions, slots, block tables)
beam.py       beam search: a group of beams that advances itself
outputs.py    RequestOutput (per request) and EngineStats (per run)
engine.py     LLMEngine: add_request / step / abort
token_choice.py  TokenChooser: guess checks, prompt scoring, sampling, constraints, forks
llm.py        LLM: generate / stream
"""

from minillm.engine.engine import LLMEngine
from minillm.engine.llm import LLM
from minillm.engine.outputs import RequestOutput
from minillm.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
