"""Prometheus metrics fed from the engine's step events (names mirror vLLM's, under ``llmlab:``).

:class:`EngineMetrics` is an ordinary step observer: subscribe it to an engine and every
:class:`~llmlab.observe.events.StepEvent` updates the gauges, counters and histograms; it
never reads engine state. Latencies come from the event's clock readings and each request's
arrival time (carried by the event that admits it), so they are in the engine's clock (the
real one when serving).

:class:`DataParallelMetrics` does the same for a data-parallel engine's replicas, with an
``engine`` label per replica and ``engine="all"`` for the totals.

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

from llmlab.observe.events import StepEvent
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


class _Families:
    """Every metric family, in one registry, with the label names ``labels`` (the first
    is ``model_name``)."""

    def __init__(self, registry, labels: list[str]) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        reg = registry

        def gauge(name, doc):
            return Gauge(f"llmlab:{name}", doc, labels, registry=reg)

        def counter(name, doc, extra=()):
            return Counter(f"llmlab:{name}", doc, [*labels, *extra], registry=reg)

        def histogram(name, doc, buckets):
            return Histogram(f"llmlab:{name}", doc, labels, buckets=buckets, registry=reg)

        self.num_requests_running = gauge("num_requests_running", "Requests running (admitted).")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (1 = full)."
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Tokens looked up in the prefix cache at admission."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Tokens found in the device prefix cache at admission."
        )
        # vLLM's names for a KV connector's (here: the offload tier's) prefix cache.
        self.external_prefix_cache_queries = counter(
            "external_prefix_cache_queries",
            "Tokens looked up in the KV offload tier (past the device prefix-cache hit).",
        )
        self.external_prefix_cache_hits = counter(
            "external_prefix_cache_hits", "Tokens found in the KV offload tier and loaded back."
        )
        self.num_preemptions = counter(
            "num_preemptions", "Preemptions (KV dropped and recomputed, or swapped out)."
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter(
            "request_success", "Requests finished, by finish reason.", ["finished_reason"]
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
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position in the draft (0-based).", ["position"],
        )
        self.drafted_per_pos = counter(
            "spec_decode_num_draft_tokens_per_pos",
            "Drafted tokens by position in the draft (0-based).", ["position"],
        )


class _Series:
    """The metrics of one engine (or of all replicas together): the families' children
    for one set of label values, and the requests being followed for latencies."""

    _SIMPLE = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
               "prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
               "external_prefix_cache_queries", "external_prefix_cache_hits",
               "prompt_tokens", "generation_tokens", "time_to_first_token",
               "inter_token_latency", "e2e_request_latency", "request_queue_time",
               "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
               "spec_decode_num_accepted_tokens")

    def __init__(self, families: _Families, values: tuple[str, ...]) -> None:
        self._families = families
        self._values = values
        for name in self._SIMPLE:
            setattr(self, name, getattr(families, name).labels(*values))
        self._tracked: dict[str, _Tracked] = {}

    def request_success(self, finished_reason: str):
        return self._families.request_success.labels(*self._values, finished_reason)

    def observe(self, event: StepEvent, *, gauges: bool = True) -> None:
        """Count one step event (``gauges=False``: leave the gauges to the caller)."""
        now = event.end_time_s
        if gauges:
            self.num_requests_running.set(event.num_running)
            self.num_requests_waiting.set(event.num_waiting)
            self.kv_cache_usage_perc.set(event.kv_usage)
        if event.preempted:
            self.num_preemptions.inc(len(event.preempted))
        for admission in event.admitted:
            device_hits = admission.num_cached_tokens - admission.num_offloaded_tokens
            self.prefix_cache_queries.inc(admission.num_queried_tokens)
            self.prefix_cache_hits.inc(device_hits)
            if event.num_offload_blocks:
                self.external_prefix_cache_queries.inc(
                    max(0, admission.num_queried_tokens - device_hits)
                )
                self.external_prefix_cache_hits.inc(admission.num_offloaded_tokens)
            if not admission.resumed and admission.request_id not in self._tracked:
                self._tracked[admission.request_id] = _Tracked(
                    admission.arrival_time, admission.num_prompt_tokens
                )
                queued = event.start_time_s - admission.arrival_time
                self.request_queue_time.observe(max(0.0, queued))
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
        families, values = self._families, self._values
        for pos, (num_drafted, num_accepted) in enumerate(zip(drafted, accepted)):
            families.drafted_per_pos.labels(*values, str(pos)).inc(num_drafted)
            families.accepted_per_pos.labels(*values, str(pos)).inc(num_accepted)


def _registry(registry):
    from prometheus_client import CollectorRegistry, disable_created_metrics

    disable_created_metrics()  # no ``*_created`` series, as vLLM: they only add noise
    return CollectorRegistry(auto_describe=True) if registry is None else registry


class EngineMetrics:
    """Prometheus metrics of one engine, in a registry of their own.

    ``EngineMetrics(model_name)`` then ``engine.subscribe(metrics)``; :meth:`render` gives
    the text exposition format for ``GET /metrics``. Every metric has a ``model_name``
    label; ``request_success`` also has ``finished_reason`` (``stop``, ``length``,
    ``abort``). The series' children are attributes (``metrics.num_requests_running``,
    ...).
    """

    def __init__(self, model_name: str, registry=None) -> None:
        self.registry = _registry(registry)
        self.model_name = model_name
        self._series = _Series(_Families(self.registry, ["model_name"]), (model_name,))
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_series":
            raise AttributeError(name)
        return getattr(self._series, name)

    def __call__(self, event: StepEvent) -> None:
        with self._lock:
            self._series.observe(event)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class DataParallelMetrics:
    """Prometheus metrics of a data-parallel engine's replicas: every metric of
    :class:`EngineMetrics` with one more label, ``engine`` (vLLM's label for data-parallel
    ranks): ``engine="0"``, ``engine="1"``, ... per replica, and ``engine="all"`` for
    all of them together (select ``engine="all"`` for totals: summing every ``engine``
    value would count each twice). Gauges of ``"all"`` are sums (running, waiting) or the
    fraction of all replicas' KV blocks in use; a dead replica's gauges read 0.

    Two more gauges: ``llmlab:dp_replicas`` (replicas started) and
    ``llmlab:dp_replicas_alive``, plus ``llmlab:dp_replica_alive`` per ``engine`` (1 or
    0), read from ``health`` (a callable returning objects with ``index`` and ``status``)
    when rendered.

    Subscribe it with ``engine.subscribe(metrics, replica=True)``: it is called as
    ``metrics(replica_index, event)``.
    """

    def __init__(self, model_name: str, num_replicas: int, health=None, registry=None) -> None:
        from prometheus_client import Gauge

        self.registry = _registry(registry)
        self.model_name = model_name
        self.num_replicas = num_replicas
        self._health = health
        families = _Families(self.registry, ["model_name", "engine"])
        self.replicas = [_Series(families, (model_name, str(i))) for i in range(num_replicas)]
        self.all = _Series(families, (model_name, "all"))
        # per replica: (running, waiting, blocks in use, blocks in all) after its last step
        self._last = [(0, 0, 0.0, 0)] * num_replicas
        self._dead: set[int] = set()
        self.dp_replicas = Gauge(
            "llmlab:dp_replicas", "Data-parallel replicas started.", ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self.dp_replicas_alive = Gauge(
            "llmlab:dp_replicas_alive", "Data-parallel replicas alive.", ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self._replica_alive = Gauge(
            "llmlab:dp_replica_alive", "1 while the replica is alive, else 0.",
            ["model_name", "engine"], registry=self.registry,
        )
        self.dp_replicas.set(num_replicas)
        self.dp_replicas_alive.set(num_replicas)
        for i in range(num_replicas):
            self._replica_alive.labels(model_name, str(i)).set(1)
        self._lock = threading.Lock()

    def __call__(self, replica: int, event: StepEvent) -> None:
        with self._lock:
            self.replicas[replica].observe(event)
            self.all.observe(event, gauges=False)
            used = event.kv_usage * event.num_total_blocks
            self._last[replica] = (event.num_running, event.num_waiting, used,
                                   event.num_total_blocks)
            self._set_totals()

    def _set_totals(self) -> None:
        live = [last for i, last in enumerate(self._last) if i not in self._dead]
        self.all.num_requests_running.set(sum(r for r, _, _, _ in live))
        self.all.num_requests_waiting.set(sum(w for _, w, _, _ in live))
        total = sum(t for _, _, _, t in live)
        self.all.kv_cache_usage_perc.set(sum(u for _, _, u, _ in live) / total if total else 0.0)

    def _refresh_health(self) -> None:
        if self._health is None:
            return
        statuses = self._health()
        alive = 0
        for status in statuses:
            ok = status.status == "ok"
            alive += ok
            self._replica_alive.labels(self.model_name, str(status.index)).set(int(ok))
            if ok:  # an unresponsive replica that answers again counts again
                self._dead.discard(status.index)
            elif status.index not in self._dead:
                self._dead.add(status.index)
                series = self.replicas[status.index]
                series.num_requests_running.set(0)
                series.num_requests_waiting.set(0)
                series.kv_cache_usage_perc.set(0)
        self.dp_replicas_alive.set(alive)
        self._set_totals()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (replica health read now)."""
        from prometheus_client import generate_latest

        with self._lock:
            self._refresh_health()
        return generate_latest(self.registry)
