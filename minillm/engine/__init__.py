"""Serving many requests at once: sequences, the scheduler, the runner, and the engine that steps them.

    from minillm.engine import LLM, SamplingParams
    llm = LLM("weights/SmolLM2-135M-Instruct", block_size=16, kv_cache_bytes=64 << 20)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

sequence.py       a request's tokens, how many have K/V computed, its timings; the changes token
                  choice decides for it (Fork, Finish, Fail)
scheduler.py      token budget, chunked prefill, preemption, forks, finishing (memory it asks of
                  the KV cache manager: blocks, copy-on-write, swaps)
admission.py      who joins the batch next: first come, longest cached prefix, max-length
                  reservation; the window and the bound on waiting; who can never run
memory_aware.py   memory-aware admission: each request priced by its life's KV block-steps
output_length.py  output lengths learned online from finished requests, by their shape
growth.py         a running batch's KV peak over the steps ahead
runner.py         one step's schedule -> one model forward (token ids, positions, slots, block tables)
speculative.py    n-gram guesses, their check, and what a guessed row costs
token_choice.py   TokenChooser: guess checks, prompt scoring, sampling, constraints, forks
beam.py           beam search: a group of beams that advances itself
outputs.py        RequestOutput (per request) and EngineStats (per run)
engine.py         LLMEngine: add_request / step / abort
llm.py            LLM: generate / stream
"""

from minillm.engine.engine import LLMEngine
from minillm.engine.llm import LLM
from minillm.engine.outputs import RequestOutput
from minillm.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
