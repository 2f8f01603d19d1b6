"""Prometheus metrics fed from the engine's step events (names mirror vLLM's, under ``llmlab:``).

:class:`EngineMetrics` is an ordinary step observer: subscribe it to an engine and every
:class:`~llmlab.engine.events.StepEvent` updates the gauges, counters and histograms; it
never reads engine state. Latencies come from the event's clock readings and each request's
arrival time (carried by the event that admits it), so they are in the engine's clock (the
real one when serving).

Per-request latencies (TTFT, inter-token, end-to-end, queueing) are observed for requests
seen being admitted; a parallel sample (``n > 1``) counts its tokens and its finish but
shares its request's latencies.

Speculative decoding's counters are vLLM's (``spec_decode_num_drafts``,
``_num_draft_tokens``, ``_num_accepted_tokens``, ``_num_accepted_tokens_per_pos`` with a
0-based ``position`` label), plus ``_num_draft_tokens_per_pos``, the denominator of
llmlab's per-position acceptance rate (``docs/speculative.md``, "Definitions"). They stay
at zero without speculation.
"""

from __future__ import annotations

import threading

import attrs

from llmlab.engine.events import StepEvent
from llmlab.speculative.stats import count_positions

# Bucket bounds (seconds) as vLLM chose them, so dashboards built for vLLM read these too.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@attrs.define
class _Tracked:
    arrival: float
    num_prompt_tokens: int
    last_token_time: float | None = None


class EngineMetrics:
    """Prometheus metrics of one engine, in a registry of their own.

    ``EngineMetrics(model_name)`` then ``engine.subscribe(metrics)``; :meth:`render` gives
    the text exposition format for ``GET /metrics``. Every metric has a ``model_name``
    label; ``request_success`` also has ``finished_reason`` (``stop``, ``length``,
    ``abort``).
    """

    def __init__(self, model_name: str, registry=None) -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            disable_created_metrics,
        )

        disable_created_metrics()  # no ``*_created`` series, as vLLM: they only add noise

        self.registry = CollectorRegistry(auto_describe=True) if registry is None else registry
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry

        def gauge(name, doc):
            return Gauge(f"llmlab:{name}", doc, labels, registry=reg).labels(model_name)

        def counter(name, doc):
            return Counter(f"llmlab:{name}", doc, labels, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(
                f"llmlab:{name}", doc, labels, buckets=buckets, registry=reg
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests running (admitted).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache at admission."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Tokens found in the prefix cache at admission."
        )
        self.num_preemptions = counter("num_preemptions", "Preemptions (KV dropped, recomputed).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter(
            "llmlab:request_success", "Requests finished, by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token.", _TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between a request's output steps.", _ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first admission.", _REQUEST_BUCKETS
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Drafts verified (one per request per step with a draft)."
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Tokens drafted."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Drafted tokens the target accepted."
        )
        self._accepted_per_pos = Counter(
            "llmlab:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0-based).",
            ["model_name", "position"], registry=reg,
        )
        self._drafted_per_pos = Counter(
            "llmlab:spec_decode_num_draft_tokens_per_pos",
            "Drafted tokens by position in the draft (0-based).",
            ["model_name", "position"], registry=reg,
        )
        self._tracked: dict[str, _Tracked] = {}
        self._lock = threading.Lock()

    def request_success(self, finished_reason: str):
        return self._success.labels(self.model_name, finished_reason)

    def __call__(self, event: StepEvent) -> None:
        with self._lock:
            self._observe(event)

    def _observe(self, event: StepEvent) -> None:
        now = event.end_time_s
        self.num_requests_running.set(event.num_running)
        self.num_requests_waiting.set(event.num_waiting)
        self.kv_cache_usage_perc.set(event.kv_usage)
        if event.preempted:
            self.num_preemptions.inc(len(event.preempted))
        for admission in event.admitted:
            self.prefix_cache_queries.inc(admission.num_queried_tokens)
            self.prefix_cache_hits.inc(admission.num_cached_tokens)
            if not admission.resumed and admission.request_id not in self._tracked:
                self._tracked[admission.request_id] = _Tracked(
                    admission.arrival_time, admission.num_prompt_tokens
                )
                self.request_queue_time.observe(max(0.0, event.start_time_s - admission.arrival_time))
        total = 0
        for request_id, num_tokens in event.sampled:
            total += num_tokens
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            if tracked.last_token_time is None:
                self.time_to_first_token.observe(max(0.0, now - tracked.arrival))
                self.prompt_tokens.inc(tracked.num_prompt_tokens)
            else:
                self.inter_token_latency.observe(max(0.0, now - tracked.last_token_time))
            tracked.last_token_time = now
        if total:
            self.generation_tokens.inc(total)
        for request_id, reason in event.finished:
            self.request_success(reason or "abort").inc()
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                self.e2e_request_latency.observe(max(0.0, now - tracked.arrival))
        for request_id in event.aborted:
            self.request_success("abort").inc()
            self._tracked.pop(request_id, None)
        if event.speculated:
            self._observe_drafts(event.speculated)

    def _observe_drafts(self, speculated: tuple[tuple[str, int, int], ...]) -> None:
        # Summed per position first: one increment per labelled child, not per token.
        drafted: list[int] = []
        accepted: list[int] = []
        num_drafts = 0
        for _, num_drafted, num_accepted in speculated:
            if num_drafted > 0:
                num_drafts += 1
                count_positions(drafted, accepted, num_drafted, num_accepted)
        self.spec_decode_num_drafts.inc(num_drafts)
        self.spec_decode_num_draft_tokens.inc(sum(drafted))
        self.spec_decode_num_accepted_tokens.inc(sum(accepted))
        for pos, (num_drafted, num_accepted) in enumerate(zip(drafted, accepted)):
            self._drafted_per_pos.labels(self.model_name, str(pos)).inc(num_drafted)
            self._accepted_per_pos.labels(self.model_name, str(pos)).inc(num_accepted)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
