"""minillm: a readable reference engine for LLM inference, from a KV cache to a memory system.

The packages, in the order a request meets them (docs/layout.md is the full map):
    config.py, switches.py   EngineConfig and every switch, declared once
    model_config.py, weights.py, model.py, matmul.py, quantized_weights.py
                             the checkpoint: its config, its tensors, the one transformer (Llama,
                             Qwen2, Qwen3) and its matrix products
    gguf_file.py, gguf_tokenizer.py
                             a llama.cpp GGUF file as the model: opened in place, nothing written
    gguf_check.py, safetensors_check.py
                             a file from outside checked against its own size before it is read
    tokenizer_json.py, tokenizer.py, chat_template.py, template_sandbox.py
                             Hugging Face's tokenizer.json read into tiktoken; the checkpoint's
                             chat template rendered in a sandbox
    sampling.py, structured.py
                             from logits to a token: SamplingParams, and structured output
    decoding/                one sequence: the naive oracle and the cached decoder
    memory/                  the KV memory system: blocks, prefix cache, quantization, eviction, tiers
    attention/               attention over the paged pool: the reference and the kernels
    engine/                  the serving engine: scheduler, admission, speculation, LLM
    serve/                   the OpenAI-compatible HTTP server on the engine
    route/                   the KV-aware router in front of several servers
    chat/                    the terminal chat with its memory view
    cli/                     the `minillm` command line
    benchmarks/              `minillm bench ...`: what each technique costs and saves, measured
    evaluation.py, lm_eval_task.py
                             perplexity through the KV cache; an lm-evaluation-harness task
    trace/, tracing.py       --trace FILE: the engine's KV events written, read back and drawn
    fetch/                   weights_fetch.py's jobs: downloads, GGUF, the texts; --shape's
                             random-weight checkpoints
    runtime.py               a loaded model for single-sequence decoding (generate, info)
    report.py, progress.py   the one table printer and --json; the one progress bar
    stop_signals.py          SIGINT and SIGTERM handled whatever the process inherited
"""
