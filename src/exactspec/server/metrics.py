"""Prometheus metrics of one app, in the app's own registry (two apps in a process never share counts)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import GenerationResult

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """Counters, histograms and a gauge for the speculative decoder and the HTTP endpoints.
    prometheus_client metrics are thread-safe: the worker thread and the event loop both update them."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.drafts = Counter("exactspec_drafts", "Target calls that verified at least one draft token", registry=r)
        self.draft_tokens = Counter("exactspec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("exactspec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.accepted_by_position = Counter(
            "exactspec_accepted_tokens_by_position", "Draft tokens accepted, by position in the draft",
            ["position"], registry=r)
        self.drafts_by = Counter("exactspec_drafts_by_drafter", "Target calls that verified drafts, by the drafter "
                                 "that made them (with --draft auto: the one it chose)", ["drafter"], registry=r)
        self.forced_tokens = Counter("exactspec_forced_tokens",
                                     "Grammar-forced draft tokens proposed (structured output)", registry=r)
        self.forced_accepted_tokens = Counter("exactspec_forced_accepted_tokens",
                                              "Grammar-forced draft tokens accepted", registry=r)
        self.emitted_tokens = Counter("exactspec_emitted_tokens", "Completion tokens generated", registry=r)
        self.cancelled = Counter("exactspec_cancelled_generations",
                                 "Generations stopped early because their client went away", registry=r)
        self.requests = Counter("exactspec_requests", "Completion requests by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("exactspec_request_latency_seconds",
                                 "Completion request latency, accepted to last byte", ["endpoint"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("exactspec_time_per_output_token_seconds",
                                               "Decode time per generated token, per sample",
                                               buckets=_TPOT_BUCKETS, registry=r)
        self.running = Gauge("exactspec_running_requests", "Completion requests queued or generating", registry=r)
        self.prefix_lookups = Counter("exactspec_prefix_cache_lookups", "Requests whose prompt was looked up in "
                                      "the prefix cache", registry=r)
        self.prefix_hits = Counter("exactspec_prefix_cache_hits", "Requests that reused a cached prompt prefix",
                                   registry=r)
        self.prompt_tokens = Counter("exactspec_prompt_tokens", "Prompt tokens by how their KV was obtained "
                                     "(reused from the prefix cache, or prefilled)", ["source"], registry=r)
        self.prefix_cache_bytes = Gauge("exactspec_prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.prefix_cache_entries = Gauge("exactspec_prefix_cache_entries", "Sequences held by the prefix cache",
                                          registry=r)

    def watch_prefix_cache(self, engine) -> None:
        """Read the engine's prefix cache size at every scrape."""
        self.prefix_cache_bytes.set_function(lambda: engine.prefix_cache.used if engine.prefix_cache else 0)
        self.prefix_cache_entries.set_function(lambda: len(engine.prefix_cache) if engine.prefix_cache else 0)

    def observe_prefill(self, result: GenerationResult, cache_on: bool) -> None:
        """Count one request's prefill (its samples share it): reused vs prefilled prompt tokens."""
        stats = result.stats
        if cache_on:
            self.prefix_lookups.inc()
            if stats.cached_tokens:
                self.prefix_hits.inc()
        self.prompt_tokens.labels(source="cached").inc(stats.cached_tokens)
        self.prompt_tokens.labels(source="prefilled").inc(stats.prefill_tokens)

    def observe_generation(self, result: GenerationResult, cancelled: bool) -> None:
        """Count one finished (or cancelled) sample."""
        stats, tokens = result.stats, len(result.token_ids)
        self.drafts.inc(stats.draft_calls)
        self.draft_tokens.inc(stats.proposed)
        self.accepted_tokens.inc(stats.accepted)
        self.forced_tokens.inc(stats.forced)
        self.forced_accepted_tokens.inc(stats.forced_accepted)
        for position, count in enumerate(stats.accepted_per_position):
            self.accepted_by_position.labels(position=str(position)).inc(count)
        self.emitted_tokens.inc(tokens)
        for drafter, count in stats.drafts_by.items():
            self.drafts_by.labels(drafter=drafter).inc(count)
        if tokens:
            self.time_per_output_token.observe(stats.decode_s / tokens)
        if cancelled:
            self.cancelled.inc()

    def observe_request(self, endpoint: str, status: int, seconds: float | None = None) -> None:
        """Count one completion request; `seconds` (if known) goes into the latency histogram."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()
        if seconds is not None:
            self.latency.labels(endpoint=endpoint).observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
