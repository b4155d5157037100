"""Prometheus metrics of one server app, in a CollectorRegistry of its own (two apps in one process never mix).

Counters: HTTP requests by route and status code, prompt and generated tokens; from the engine's snapshot, engine
requests ended by finish reason (stop, length, abort, error) and preemptions. Histograms: time to first token and
time per output token. Gauges (set from the engine thread's latest snapshot when scraped): running and waiting
requests, KV blocks in use and in total. Routes outside the API are counted as "other", so a scan of random paths
cannot grow the label set. Speculative decoding, per finished choice: tokens proposed and accepted (counters) and
the mean accepted per verifying step (a histogram).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nextoken.engine.async_engine import EngineStats

ROUTES = frozenset({"/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
                    "/metrics"})
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_ACCEPTED_BUCKETS = (0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("nextoken_http_requests", "HTTP requests by route and status code",
                                ["route", "code"], registry=r)
        self.prompt_tokens = Counter("nextoken_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("nextoken_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("nextoken_time_to_first_token_seconds",
                              "From receiving a request to its first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("nextoken_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per finished choice",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.running = Gauge("nextoken_requests_running", "Engine requests running", registry=r)
        self.waiting = Gauge("nextoken_requests_waiting", "Engine requests waiting to be scheduled", registry=r)
        self.kv_blocks_used = Gauge("nextoken_kv_blocks_used", "KV cache blocks referenced by requests", registry=r)
        self.kv_blocks_total = Gauge("nextoken_kv_blocks_total", "KV cache blocks in the pool", registry=r)
        self.finished = Counter("nextoken_requests_finished", "Engine requests ended, by finish reason", ["reason"],
                                registry=r)
        self.preemptions = Counter("nextoken_preemptions", "Running requests preempted (to be recomputed) for KV room",
                                   registry=r)
        self.spec_proposed = Counter("nextoken_spec_proposed_tokens", "Tokens proposed by speculative decoding",
                                     registry=r)
        self.spec_accepted = Counter("nextoken_spec_accepted_tokens",
                                     "Proposed tokens accepted by verification", registry=r)
        self.spec_mean_accepted = Histogram("nextoken_spec_mean_accepted_length",
                                            "Per finished choice that speculated, tokens accepted per verifying step",
                                            buckets=_ACCEPTED_BUCKETS, registry=r)
        self._seen = EngineStats()  # the snapshot the engine counters were last brought up to

    def count_speculation(self, num_proposed: int, num_accepted: int, num_steps: int) -> None:
        """A finished choice's speculative decoding (Request.timings), where it verified proposals."""
        if num_steps:
            self.spec_proposed.inc(num_proposed)
            self.spec_accepted.inc(num_accepted)
            self.spec_mean_accepted.observe(num_accepted / num_steps)

    def count_request(self, path: str, status: int) -> None:
        self.requests.labels(path if path in ROUTES else "other", str(status)).inc()

    def render(self, stats: EngineStats) -> bytes:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.num_kv_blocks_used)
        self.kv_blocks_total.set(stats.num_kv_blocks_total)
        # The engine keeps running totals; the counters take what was added since the last scrape.
        before = dict(self._seen.num_finished)
        for reason, count in stats.num_finished:
            if count > before.get(reason, 0):
                self.finished.labels(reason).inc(count - before.get(reason, 0))
        if stats.num_preemptions > self._seen.num_preemptions:
            self.preemptions.inc(stats.num_preemptions - self._seen.num_preemptions)
        self._seen = stats
        return generate_latest(self.registry)
