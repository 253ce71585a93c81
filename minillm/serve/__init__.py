"""`minillm serve`: the engine behind an OpenAI-compatible HTTP server (vLLM's routes and shapes).

errors.py       OpenAI's error body (APIError), and JSON no client can make the server fail with
fields.py       the fields both endpoints share, each read and checked (typed, parse_common, ...)
protocol.py     which fields a request takes, and the Job it becomes (prompt ids, SamplingParams,
                stop strings); no web framework in these three
endpoints.py    each endpoint's own body: a completion's prompt, a chat's messages
responses.py    each choice's text as tokens arrive, response and stream-chunk bodies
engine_loop.py  the engine on one thread, fed by a command queue; Submission, one HTTP
                request's side (outputs as they come, abort on close)
commands.py     what crosses between the threads: Add, Abort, Call, Drain, Stop, and each request's Reply
app.py          the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics;
                the checks at the door (API key, the waiting room)
origins.py      the Host and Origin a request may carry (DNS rebinding, other sites' pages)
body.py         a request's body within the limits: JSON only, its size, its time
answer.py       one request's answer as outputs arrive: a JSON body at the end, or server-sent
                events; what the client no longer waits for is aborted
limits.py       ServeLimits: what one client may ask for, each bound a `minillm serve` flag
connections.py  uvicorn as the server runs it: a cap on connections (503 JSON), a deadline for a
                request's head
metrics.py      /metrics: the snapshot and the loop's counters in Prometheus' text format
kv_events.py    /v1/kv_events: the KV events streamed as server-sent events; VllmEvents, vLLM's shape
memory_page.py  /memory: the page that draws the memory system live (`minillm/view/`), and the app
                that replays a trace in it (`minillm trace serve`)
tokenize.py     /tokenize, /detokenize, /tokenizer_info: the server's tokenizer, as vLLM serves it

FastAPI and uvicorn are an optional extra: pip install -e ".[serve]".
"""

INSTALL_HINT = 'minillm serve needs FastAPI and uvicorn: pip install -e ".[serve]"'


def missing_server_packages() -> str | None:
    """None if FastAPI and uvicorn import, else the line that says how to install them."""
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        return f"{INSTALL_HINT} ({err})."
    return None
