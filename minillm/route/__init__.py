"""`minillm route`: a KV-aware router in front of several `minillm serve` engines.

Each engine caches prompt blocks in its own prefix cache; a prompt sent where its leading blocks
are already cached skips their prefill. The router follows every engine's KV events into one
index of which engine holds which blocks, and sends each request where Dynamo's cost (new
prefill blocks + blocks running there) is lowest. Engines never talk to each other: the events
are the only shared state. It imports serve's helpers and the tokenizer, never the engine, and
loads no model weights.

index.py     BlockIndex: a radix tree over block chains, keyed by token content (engines' hashes
             differ per process); apply an engine's events, overlap(token_ids), drop an engine
feeds.py     Feed: one engine's GET /v1/kv_events followed in an asyncio task, reconnecting with
             backoff; whether it lags behind the engine
policy.py    KvPolicy (Dynamo's cost, round-robin ties, round-robin while a feed lags), RoundRobin,
             ActiveBlocks (the load the router itself sent)
engines.py   EnginePool: which engines are live; a dead one probed on /health until it answers
prompts.py   a request's first prompt as token ids, rendered as the engine renders it
forward.py   one request sent to one engine: retryable until its answer begins, then relayed;
             a stream broken midway ends with an error event and [DONE]
metrics.py   RouterMetrics: routed, fallbacks, retries, failures, engines up, predicted vs actual hits
app.py       Router (the pieces together, the retry loop) and the FastAPI app: /v1/completions,
             /v1/chat/completions, /v1/models, /health, /metrics

FastAPI, uvicorn and httpx2 are needed: pip install -e ".[serve]".
"""
