"""`/metrics`: Prometheus metrics under vLLM's names with an `atom:` prefix, label `engine`.

Gauges and engine totals come from the core with every step (`EngineStats`); the
per-request histograms are measured here, in the API process, as deltas arrive.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from atom_core.serve.protocol import Delta, EngineStats

# The `finished_reason` values of `request_success`: OpenAI's two, and a request the client left.
FINISHED_REASONS = ("stop", "length", "abort")
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["engine"]
        self._per_engine: list[Gauge | Counter | Histogram] = []  # every metric labelled by engine alone

        def gauge(name: str, doc: str) -> Gauge:
            metric = Gauge(name, doc, labels, registry=r)
            self._per_engine.append(metric)
            return metric

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(name, doc, [*labels, *extra], registry=r)
            if not extra:
                self._per_engine.append(metric)
            return metric

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, labels, buckets=buckets, registry=r)
            self._per_engine.append(metric)
            return metric

        self.running = gauge("atom:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("atom:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("atom:kv_cache_usage_perc", "Share of the KV pool's blocks in use (0 to 1).")
        self.prompt_tokens = counter("atom:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("atom:generation_tokens", "Generated tokens.")
        self.preemptions = counter("atom:num_preemptions", "Requests preempted.")
        self.cache_queries = counter("atom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("atom:prefix_cache_hits", "Prompt tokens the prefix cache served.")
        self.success = counter("atom:request_success", "Requests finished, by reason.", ("finished_reason",))
        self.draft_tokens = counter("atom:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = counter("atom:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.ttft = histogram("atom:time_to_first_token_seconds", "Time to the first token.", LATENCY_BUCKETS)
        self.itl = histogram("atom:inter_token_latency_seconds", "Time between two tokens.", LATENCY_BUCKETS)
        self.e2e = histogram("atom:e2e_request_latency_seconds", "Time from arrival to the end.", LATENCY_BUCKETS)
        self.queue = histogram(
            "atom:request_queue_time_seconds", "Time from arrival to the request's first step.", LATENCY_BUCKETS
        )
        self.prompt_len = histogram("atom:request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_len = histogram("atom:request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self._totals: dict[int, EngineStats] = {}

    def start(self, num_engines: int) -> None:
        """Every engine's series at zero from the start, as vLLM exports them (a series would
        otherwise appear only with its first value)."""
        for rank in range(num_engines):
            e = str(rank)
            for metric in self._per_engine:
                metric.labels(e)
            for reason in FINISHED_REASONS:
                self.success.labels(e, reason)

    def engine_stats(self, stats: EngineStats, rank: int = 0) -> None:
        e = str(rank)
        self.running.labels(e).set(stats.num_running)
        self.waiting.labels(e).set(stats.num_waiting)
        self.kv_usage.labels(e).set(stats.kv_cache_usage)
        last = self._totals.get(rank, EngineStats())
        self.preemptions.labels(e).inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.draft_tokens.labels(e).inc(max(0, stats.spec_draft_tokens - last.spec_draft_tokens))
        self.accepted_tokens.labels(e).inc(max(0, stats.spec_accepted_tokens - last.spec_accepted_tokens))
        self._totals[rank] = stats


class RequestTimer:
    """One request's timings, fed its deltas."""

    def __init__(self, metrics: Metrics, num_prompt_tokens: int, rank: int = 0):
        self.metrics, self.num_prompt_tokens, self.engine = metrics, num_prompt_tokens, str(rank)
        self.arrival = self.last = time.perf_counter()
        self.num_tokens = 0

    def add(self, delta: Delta, openai_reason: str | None) -> None:
        m, e, now = self.metrics, self.engine, time.perf_counter()
        if delta.queue_time is not None:
            m.queue.labels(e).observe(delta.queue_time)
        if delta.token_ids:
            if self.num_tokens == 0:
                m.ttft.labels(e).observe(now - self.arrival)
            else:
                m.itl.labels(e).observe((now - self.last) / len(delta.token_ids))
            self.num_tokens += len(delta.token_ids)
            m.generation_tokens.labels(e).inc(len(delta.token_ids))
            self.last = now
        if delta.finished:
            m.e2e.labels(e).observe(now - self.arrival)
            m.prompt_len.labels(e).observe(self.num_prompt_tokens)
            m.gen_len.labels(e).observe(self.num_tokens)
            m.prompt_tokens.labels(e).inc(self.num_prompt_tokens)
            m.cache_queries.labels(e).inc(self.num_prompt_tokens)
            m.cache_hits.labels(e).inc(delta.num_cached_tokens)
            m.success.labels(e, openai_reason or delta.finish_reason or "unknown").inc()

    def abort(self) -> None:
        """The client left before the end (counted under `finished_reason="abort"`, as vLLM does)."""
        m, e = self.metrics, self.engine
        m.e2e.labels(e).observe(time.perf_counter() - self.arrival)
        m.prompt_tokens.labels(e).inc(self.num_prompt_tokens)
        m.success.labels(e, "abort").inc()
