"""Prometheus metrics of one server (its own registry, so several apps can live in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .records import Usage

PREFIX = "mlx_speculate"


class Metrics:
    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by endpoint and outcome: a finish reason, cancelled, or an HTTP status",
            ["endpoint", "outcome"],
            registry=registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations", registry=registry
        )
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Prompt tokens whose KV cache carried over from an earlier request",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            f"{PREFIX}_prefix_cache_hits",
            "Generations that reused a cached prompt prefix",
            registry=registry,
        )
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens", "Tokens generated", ["method"], registry=registry
        )
        self.drafted_tokens = Counter(
            f"{PREFIX}_drafted_tokens", "Draft tokens proposed", ["method"], registry=registry
        )
        self.accepted_tokens = Counter(
            f"{PREFIX}_accepted_tokens", "Draft tokens accepted", ["method"], registry=registry
        )
        self.target_forwards = Counter(
            f"{PREFIX}_target_forwards",
            "Verify forwards of the target model",
            ["method"],
            registry=registry,
        )
        self.tokens_per_forward = Histogram(
            f"{PREFIX}_tokens_per_target_forward",
            "Tokens per target forward, one observation per generation",
            ["method"],
            buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0),
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From queueing a request to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )
        self.batch_size = Gauge(
            f"{PREFIX}_batch_size", "Requests decoding together in the batch", registry=registry
        )
        self.rows_per_forward = Histogram(
            f"{PREFIX}_rows_per_forward",
            "Rows (requests times verified tokens each, padding included) per batch forward",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=registry,
        )
        self.acceptance_rate = Histogram(
            f"{PREFIX}_acceptance_rate",
            "Accepted over drafted tokens, one observation per generation that drafted",
            ["method"],
            buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=registry,
        )
        self.queue_depth = Gauge(
            f"{PREFIX}_queue_depth",
            "Requests accepted and not decoding yet (queued, or prefilling)",
            registry=registry,
        )
        self.cache_rows = Gauge(
            f"{PREFIX}_batch_cache_rows",
            "Rows of the batch's KV cache (a power of two holding the requests decoding)",
            registry=registry,
        )
        self.sessions = Gauge(
            f"{PREFIX}_sessions",
            "Sessions (a KV cache each) kept: idle ones up to --prompt-cache-size, and busy ones",
            registry=registry,
        )

    def generation_done(self, usage: Usage) -> None:
        method = usage.method
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_prompt_tokens.inc(usage.cached_tokens)
        if usage.cached_tokens:
            self.prefix_cache_hits.inc()
        self.generated_tokens.labels(method).inc(usage.completion_tokens)
        stats = usage.stats
        if stats is not None:
            self.drafted_tokens.labels(method).inc(stats.drafted)
            self.accepted_tokens.labels(method).inc(stats.accepted)
            self.target_forwards.labels(method).inc(stats.target_forwards)
            if stats.target_forwards:
                self.tokens_per_forward.labels(method).observe(stats.tokens_per_forward)
            if stats.drafted:
                self.acceptance_rate.labels(method).observe(stats.acceptance_rate)
