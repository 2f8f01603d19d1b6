"""``LLM.get_metrics()``: vLLM's offline metrics reader, fed from step events.

vLLM's ``LLM.get_metrics()`` (``vllm.v1.metrics.reader``) reads its Prometheus registry
back as :class:`Counter`, :class:`Gauge` and :class:`Vector` records. llmlab keeps no
global registry: :class:`EngineCounters` (a step observer) and a
:class:`~llmlab.speculative.stats.SpecDecodeStats` total the engine's step events, and
:func:`collect` turns them into the same records. Names are vLLM's with ``llmlab:`` in
place of ``vllm:`` (as on the server's ``/metrics``); a counter is named as vLLM's reader
names it, without Prometheus' ``_total`` suffix. Every record has a ``model_name`` label.
"""

from __future__ import annotations

import attrs

from llmlab.observe.events import StepEvent
from llmlab.speculative.stats import SpecDecodeStats

# Reasons vLLM always reports (at zero until seen), so a reader can look them up.
_FINISHED_REASONS = ("stop", "length", "abort")


def _no_finished() -> dict[str, int]:
    return dict.fromkeys(_FINISHED_REASONS, 0)


@attrs.frozen
class Metric:
    """A named, labelled reading (vLLM's ``Metric``)."""

    name: str
    labels: dict[str, str]


@attrs.frozen
class Counter(Metric):
    """A total that only grows."""

    value: int


@attrs.frozen
class Gauge(Metric):
    """A value that goes up and down (read from the latest step)."""

    value: float


@attrs.frozen
class Vector(Metric):
    """Counters by position (vLLM's type for ``spec_decode_num_accepted_tokens_per_pos``:
    ``values[i]`` is draft position ``i``, 0-based)."""

    values: list[int]


@attrs.define
class EngineCounters:
    """Token and request totals, and the latest queue and KV readings; a step observer.

    Prompt tokens count once per request, when it is first admitted (not again after a
    preemption); generation tokens are every token a step sampled; a finished request
    counts under its finish reason, an aborted one under ``abort``. Prefix-cache tokens
    are counted per tier: queries and hits on the device at every admission, and, with a
    KV offload tier, the tokens looked up there past the device hit and found (vLLM's
    ``external_prefix_cache_*``, its KV connector's); a tier's hit rate is hits / queries.
    """

    num_prompt_tokens: int = attrs.field(default=0, init=False)
    num_generation_tokens: int = attrs.field(default=0, init=False)
    finished: dict[str, int] = attrs.field(init=False, factory=_no_finished)
    num_requests_running: int = attrs.field(default=0, init=False)
    num_requests_waiting: int = attrs.field(default=0, init=False)
    kv_cache_usage: float = attrs.field(default=0.0, init=False)
    prefix_cache_queries: int = attrs.field(default=0, init=False)
    prefix_cache_hits: int = attrs.field(default=0, init=False)
    external_prefix_cache_queries: int = attrs.field(default=0, init=False)
    external_prefix_cache_hits: int = attrs.field(default=0, init=False)
    num_preemptions: int = attrs.field(default=0, init=False)

    def __call__(self, event: StepEvent) -> None:
        self.num_prompt_tokens += sum(
            a.num_prompt_tokens for a in event.admitted if not a.resumed
        )
        self.num_generation_tokens += sum(n for _, n in event.sampled)
        for _, reason in event.finished:
            reason = reason or "abort"
            self.finished[reason] = self.finished.get(reason, 0) + 1
        self.finished["abort"] += len(event.aborted)
        self.num_requests_running = event.num_running
        self.num_requests_waiting = event.num_waiting
        self.kv_cache_usage = event.kv_usage
        self.num_preemptions += len(event.preempted)
        for admission in event.admitted:
            device_hits = admission.num_cached_tokens - admission.num_offloaded_tokens
            self.prefix_cache_queries += admission.num_queried_tokens
            self.prefix_cache_hits += device_hits
            if event.num_offload_blocks:
                self.external_prefix_cache_queries += max(
                    0, admission.num_queried_tokens - device_hits
                )
                self.external_prefix_cache_hits += admission.num_offloaded_tokens


def collect(
    counters: EngineCounters,
    spec: SpecDecodeStats,
    *,
    model_name: str,
    num_speculative_tokens: int = 0,
) -> list[Metric]:
    """The records ``LLM.get_metrics()`` returns. The per-position vectors have
    ``num_speculative_tokens`` entries (as vLLM's), or more if longer drafts were seen."""

    def labels(**extra: str) -> dict[str, str]:
        return {"model_name": model_name, **extra}  # a dict per record: they are mutable

    def per_pos(counts: list[int]) -> list[int]:
        return counts + [0] * (num_speculative_tokens - len(counts))

    return [
        Gauge("llmlab:num_requests_running", labels(), counters.num_requests_running),
        Gauge("llmlab:num_requests_waiting", labels(), counters.num_requests_waiting),
        Gauge("llmlab:kv_cache_usage_perc", labels(), counters.kv_cache_usage),
        Counter("llmlab:prompt_tokens", labels(), counters.num_prompt_tokens),
        Counter("llmlab:generation_tokens", labels(), counters.num_generation_tokens),
        Counter("llmlab:num_preemptions", labels(), counters.num_preemptions),
        Counter("llmlab:prefix_cache_queries", labels(), counters.prefix_cache_queries),
        Counter("llmlab:prefix_cache_hits", labels(), counters.prefix_cache_hits),
        Counter("llmlab:external_prefix_cache_queries", labels(),
                counters.external_prefix_cache_queries),
        Counter("llmlab:external_prefix_cache_hits", labels(),
                counters.external_prefix_cache_hits),
        *(
            Counter("llmlab:request_success", labels(finished_reason=reason), count)
            for reason, count in counters.finished.items()
        ),
        Counter("llmlab:spec_decode_num_drafts", labels(), spec.num_drafts),
        Counter("llmlab:spec_decode_num_draft_tokens", labels(), spec.num_draft_tokens),
        Counter("llmlab:spec_decode_num_accepted_tokens", labels(), spec.num_accepted_tokens),
        Vector("llmlab:spec_decode_num_accepted_tokens_per_pos", labels(),
               per_pos(list(spec.accepted_per_pos))),
        Vector("llmlab:spec_decode_num_draft_tokens_per_pos", labels(),
               per_pos(list(spec.drafted_per_pos))),
    ]
