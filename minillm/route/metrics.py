"""GET /metrics on the router: what it decided and how well it predicted, in Prometheus' text.

    minillm_router:requests_routed_total{engine}     requests sent to each engine (retries included)
    minillm_router:fallbacks_total                   kv-policy requests routed round-robin, a feed lagging
    minillm_router:retries_total                     requests sent again elsewhere (an engine failed first)
    minillm_router:failed_total                      requests no engine answered, or cut mid-stream
    minillm_router:engine_up{engine}                 1 while the engine is live
    minillm_router:feed_lagging{engine}              1 while the engine's KV-event feed lags
    minillm_router:predicted_hit_blocks_total{engine}  leading blocks the index said the engine held
    minillm_router:actual_hit_blocks_total{engine}     blocks the engine reported cached (usage's
                                                     cached_tokens / block size), for the same requests

The last two count only requests the kv policy placed and whose engine reported cached_tokens, so
their ratio is how often the index was right. `serve.metrics.parse_metrics` reads the text back.
"""

from __future__ import annotations

from collections import Counter

HELP = {
    "requests_routed_total": ("counter", "Requests sent to each engine (retries included)."),
    "fallbacks_total": ("counter", "Requests the kv policy routed round-robin because a feed lagged."),
    "retries_total": ("counter", "Requests sent again to another engine after one failed before answering."),
    "failed_total": ("counter", "Requests no engine answered, or whose stream broke midway."),
    "engine_up": ("gauge", "1 while the engine is live, 0 while it is probed."),
    "feed_lagging": ("gauge", "1 while the engine's KV-event feed is disconnected or behind."),
    "predicted_hit_blocks_total": ("counter", "Prompt blocks the index predicted the engine held."),
    "actual_hit_blocks_total": ("counter", "Prompt blocks the engine reported from its prefix cache."),
}


class RouterMetrics:
    def __init__(self):
        self.routed: Counter[str] = Counter()
        self.predicted: Counter[str] = Counter()
        self.actual: Counter[str] = Counter()
        self.fallbacks = self.retries = self.failed = 0

    def sent(self, engine: str) -> None:
        self.routed[engine] += 1

    def fell_back(self) -> None:
        self.fallbacks += 1

    def retried(self) -> None:
        self.retries += 1

    def failed_one(self) -> None:
        self.failed += 1

    def hit(self, engine: str, predicted_blocks: int, actual_blocks: int) -> None:
        """A request the index predicted for, and what its engine reported."""
        self.predicted[engine] += predicted_blocks
        self.actual[engine] += actual_blocks

    def text(self, engines: list[str], live: set[str], lagging: set[str]) -> str:
        values = {
            "requests_routed_total": {e: self.routed[e] for e in engines},
            "fallbacks_total": self.fallbacks,
            "retries_total": self.retries,
            "failed_total": self.failed,
            "engine_up": {e: int(e in live) for e in engines},
            "feed_lagging": {e: int(e in lagging) for e in engines},
            "predicted_hit_blocks_total": {e: self.predicted[e] for e in engines},
            "actual_hit_blocks_total": {e: self.actual[e] for e in engines},
        }
        lines = []
        for name, value in values.items():
            kind, help_text = HELP[name]
            lines += [f"# HELP minillm_router:{name} {help_text}", f"# TYPE minillm_router:{name} {kind}"]
            if isinstance(value, dict):
                lines += [f'minillm_router:{name}{{engine="{e}"}} {number}' for e, number in value.items()]
            else:
                lines.append(f"minillm_router:{name} {value}")
        return "\n".join(lines) + "\n"
