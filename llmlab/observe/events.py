"""``StepEvent``: the one immutable record each engine step emits.

Metrics, notebook views, traces and tests consume these instead of reading engine state. A
consumer that joins a running engine starts from an :class:`EngineSnapshot`
(:meth:`~llmlab.engine.engine.Engine.observe`) and applies events from there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from llmlab.cache.kv_cache_manager import BlockEvents, CacheSnapshot, KVCacheManager
from llmlab.errors import component_name
from llmlab.models.expert_load import NAME as EXPERT_LOAD
from llmlab.models.expert_load import ExpertLoad
from llmlab.scheduler.batch import Admission, ScheduledBatch

logger = logging.getLogger(__name__)


@attrs.frozen
class Arrival:
    """A request queued by ``add_request`` (the id the caller gave; ``n`` samples of it)."""

    request_id: str
    arrival_time: float
    prompt_len: int
    max_tokens: int | None
    n: int = 1
    priority: int = 0
    user: str | None = None

    @classmethod
    def of(cls, prepared: Any) -> Arrival:
        """The arrival of a ``PreparedRequest`` (a pooling request generates nothing:
        ``max_tokens`` 0)."""
        params = prepared.params
        max_tokens, n = getattr(params, "max_tokens", 0), getattr(params, "n", 1)
        return cls(
            prepared.request_id, prepared.arrival_time, len(prepared.prompt_token_ids),
            max_tokens, n, prepared.priority, prepared.user,
        )


@attrs.frozen
class EngineSnapshot:
    """The engine's state at one instant, the starting point for applying events.

    Attributes:
        step_index: the ``step_index`` the next batch-running step will carry.
        block_size / num_blocks: the KV pool's shape.
        kv: every block's ref count and cached flag, and every request's block table.
        num_computed: tokens in the KV cache per request holding blocks.
        num_waiting / num_running: queue lengths.
        time_s: the engine clock when the snapshot was taken.
        num_swap_blocks / num_swap_blocks_used: the swap space (0 / 0: none).
        num_offload_blocks / offload_cached: the prefix cache's second tier: its size and
            the ids of its blocks holding content (0 / (): none).
        kv_dropped: per request a KV press compacted, the positions its KV cache no
            longer holds (0 when the press kept everything); uncompacted requests are
            absent.
    """

    step_index: int
    block_size: int
    num_blocks: int
    kv: CacheSnapshot
    num_computed: dict[str, int]
    num_waiting: int
    num_running: int
    time_s: float
    num_swap_blocks: int = 0
    num_swap_blocks_used: int = 0
    num_offload_blocks: int = 0
    offload_cached: tuple[int, ...] = ()
    kv_dropped: dict[str, int] = attrs.field(factory=dict)

    @classmethod
    def take(
        cls, step_index: int, kv: KVCacheManager, requests: Mapping[str, Any],
        num_waiting: int, num_running: int, time_s: float,
    ) -> EngineSnapshot:
        """The snapshot of ``kv`` now; ``requests`` by id give each table's computed count."""
        cache = kv.snapshot()
        computed, dropped = {}, {}
        for rid in cache.block_tables:
            request = requests.get(rid)
            computed[rid] = request.num_computed_tokens if request is not None else 0
            if request is not None and request.kv_compressed:
                dropped[rid] = request.kv_dropped
        swap, tier = getattr(kv, "swap", None), getattr(kv, "tier", None)
        host = {}
        if swap is not None:
            host.update(num_swap_blocks=swap.num_blocks,
                        num_swap_blocks_used=swap.num_used_blocks)
        if tier is not None:
            host.update(num_offload_blocks=tier.num_blocks,
                        offload_cached=tuple(sorted(tier.index.block_ids())))
        return cls(
            step_index, kv.block_size, kv.num_blocks, cache, computed, num_waiting,
            num_running, time_s, **host, kv_dropped=dropped,
        )


@attrs.frozen
class StepEvent:
    """What one ``Engine.step`` did.

    Attributes:
        step_index: 0-based count of steps that ran a batch.
        scheduled: ``(request_id, num_new_tokens)`` for each request in the batch.
        scheduled_users / scheduled_priorities: the ``user`` and ``priority`` of each entry
            of ``scheduled`` (same order), for per-user service and priority views.
        num_batched_tokens: total new tokens in the batch.
        preempted: requests preempted (their KV dropped, to be recomputed).
        finished: requests that finished this step, with ``(request_id, finish_reason)``.
        aborted: requests aborted since the previous step.
        blocks_allocated / blocks_freed / blocks_prefix_hit / blocks_evicted: block ids.
        blocks_forked: blocks shared with a parallel sample (n / best_of) as it started,
            once per sample: shared by reference, not copied.
        num_free_blocks / num_total_blocks: pool state after the step.
        kv_usage: fraction of blocks held by requests after the step.
        num_waiting / num_running: queue lengths after the step.
        wall_time_s: wall-clock duration of the whole step.
        model_time_s: part of it spent in the model runner (forward + sampling).
        start_time_s / end_time_s: the engine clock when the step began and when its
            outputs were ready (``time.monotonic`` for a real engine, virtual time in
            simulation): latency metrics are differences of these and arrival times.
        admitted: requests admitted this step (:class:`~llmlab.scheduler.batch.Admission`:
            arrival time, prompt length, prefix-cache tokens queried and hit, resumed).
        sampled: ``(request_id, num_tokens)`` for each request that received new output
            tokens this step (a parallel sample's first token included).
        arrived: requests queued since the previous event.
        num_prefill_tokens: tokens of the batch that are not decodes (a decode is a
            one-token span past the prompt); the rest of ``num_batched_tokens`` are decodes.
        num_computed: tokens of each scheduled request computed after the step (same
            order as ``scheduled``); the KV cache holds ``kv_dropped`` fewer of them for a
            request a KV press compacted.
        blocks_cached: blocks that entered the prefix index this step and are still in it.
        block_tables: every request whose block table changed this step, with the table
            after it (``()``: it holds no blocks now). With ``blocks_evicted`` and
            ``blocks_cached`` this is enough to follow every block's owners and state from
            an :class:`EngineSnapshot`, as the notebook views do.
        speculated: ``(request_id, num_drafted, num_accepted)`` for each request that
            speculated this step (its proposer drafted ``num_drafted`` tokens, of which the
            target accepted the first ``num_accepted``; the step also produced one more
            token of the target's own). Per position: position ``j`` (1-based) was drafted
            when ``j <= num_drafted`` and accepted when ``j <= num_accepted``; the
            definitions built on these are in ``docs/speculative.md``
            (:class:`~llmlab.speculative.stats.SpecDecodeStats`).
        swapped_out: ``(request_id, num_blocks)`` for each request preempted by swapping
            (``preemption_mode="swap"``): its computed blocks were copied to the swap space
            (it is also in ``preempted``; one there and not here was preempted by
            recompute).
        swapped_in: ``(request_id, num_blocks)`` for each swapped request resumed this
            step (its blocks copied back; it continues without recomputing).
        blocks_spilled: ``(device_block, offload_block)`` for each cached block the device
            pool dropped that was copied into the prefix cache's second tier
            (``kv_offloading_size``); a block already there is not copied again.
        blocks_loaded: ``(offload_block, device_block)`` for each second-tier prefix hit
            copied back into the device pool before its request ran (second-tier hits;
            the admissions' ``num_offloaded_tokens`` count them in tokens).
        offload_blocks_evicted: second-tier blocks whose content the tier's own eviction
            policy dropped to make room.
        num_swap_blocks_used / num_swap_blocks: the swap space after the step (0 / 0:
            none).
        num_offload_blocks_cached / num_offload_blocks: the second tier after the step
            (0 / 0: none).
        kv_compacted: each KV press compaction this step
            (:class:`~llmlab.kvpress.schedule.Compaction`: the request, its context, the
            tokens per layer before and kept, ``tokens_dropped``; or the press's failure).
        kv_dropped: for each scheduled request (same order as ``scheduled``), the
            positions its KV cache no longer holds after the step (a KV press dropped
            them; 0 for every request without one).
        expert_load: with ``record_expert_load`` on (a mixture-of-experts model), how many
            of the step's tokens each expert received in each sparse layer
            (:class:`~llmlab.models.expert_load.ExpertLoad`: the layer indices, a
            ``[layers, experts]`` count matrix whose rows sum to ``top_k`` times the tokens
            the forward ran); None when it is off or the step ran no batch.
    """

    step_index: int
    scheduled: tuple[tuple[str, int], ...]
    scheduled_users: tuple[str | None, ...]
    scheduled_priorities: tuple[int, ...]
    num_batched_tokens: int
    preempted: tuple[str, ...]
    finished: tuple[tuple[str, str], ...]
    aborted: tuple[str, ...]
    blocks_allocated: tuple[int, ...]
    blocks_freed: tuple[int, ...]
    blocks_prefix_hit: tuple[int, ...]
    blocks_evicted: tuple[int, ...]
    blocks_forked: tuple[int, ...]
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    num_waiting: int
    num_running: int
    wall_time_s: float
    model_time_s: float
    start_time_s: float = 0.0
    end_time_s: float = 0.0
    admitted: tuple[Admission, ...] = ()
    sampled: tuple[tuple[str, int], ...] = ()
    arrived: tuple[Arrival, ...] = ()
    num_prefill_tokens: int = 0
    num_computed: tuple[int, ...] = ()
    blocks_cached: tuple[int, ...] = ()
    block_tables: tuple[tuple[str, tuple[int, ...]], ...] = ()
    speculated: tuple[tuple[str, int, int], ...] = ()
    swapped_out: tuple[tuple[str, int], ...] = ()
    swapped_in: tuple[tuple[str, int], ...] = ()
    blocks_spilled: tuple[tuple[int, int], ...] = ()
    blocks_loaded: tuple[tuple[int, int], ...] = ()
    offload_blocks_evicted: tuple[int, ...] = ()
    num_swap_blocks_used: int = 0
    num_swap_blocks: int = 0
    num_offload_blocks_cached: int = 0
    num_offload_blocks: int = 0
    kv_compacted: tuple[Any, ...] = ()
    kv_dropped: tuple[int, ...] = ()
    expert_load: ExpertLoad | None = None


StepObserver = Callable[[StepEvent], None]


def notify(observers: Sequence[StepObserver], event: StepEvent) -> None:
    """Call each observer with ``event``; one that raises is logged (by name) and skipped."""
    for observer in list(observers):
        try:
            observer(event)
        except Exception:
            logger.exception(
                "step observer %s raised on step %d; it is skipped for this event",
                _observer_name(observer),
                event.step_index,
            )


def _observer_name(observer: object) -> str:
    name = getattr(observer, "__qualname__", None) or getattr(observer, "__name__", None)
    return repr(name) if name else component_name(observer)


def step_event(
    step_index: int,
    batch: ScheduledBatch,
    requests: Mapping[str, Any],
    *,
    finished: Sequence[Any],
    aborted: Sequence[str],
    arrived: Sequence[Arrival],
    sampled: tuple[tuple[str, int], ...],
    blocks: BlockEvents,
    kv: KVCacheManager,
    num_waiting: int,
    num_running: int,
    start: float,
    end: float,
    model_time: float,
    speculated: tuple[tuple[str, int, int], ...] = (),
    reports: dict[str, Any] | None = None,
) -> StepEvent:
    """The event of one step, after its commit. ``requests``: the batch's requests by id
    (read for users, priorities and computed tokens); ``finished``: the requests that ended;
    ``reports``: what each plugged-in feature reported, by name (a KV press's compactions
    under ``kv_press``, the expert load under ``expert_load``)."""
    compacted = None if reports is None else reports.get("kv_press")
    if compacted is not None:
        compacted = tuple(compacted)
    # Comprehensions over the entries (this runs every step, for every request).
    entries = batch.entries
    scheduled_requests = [requests[e.request_id] for e in entries]
    num_decode = sum(1 for e in entries if e.is_decode)
    return StepEvent(
        step_index=step_index,
        scheduled=tuple([(e.request_id, len(e.token_ids)) for e in entries]),
        scheduled_users=tuple([r.user for r in scheduled_requests]),
        scheduled_priorities=tuple([r.priority for r in scheduled_requests]),
        num_batched_tokens=batch.num_batched_tokens,
        preempted=batch.preempted,
        finished=tuple((r.request_id, r.finish_reason) for r in finished),
        aborted=tuple(aborted),
        blocks_allocated=blocks.allocated,
        blocks_freed=blocks.freed,
        blocks_prefix_hit=blocks.prefix_hits,
        blocks_evicted=blocks.evicted,
        blocks_forked=blocks.forked,
        num_free_blocks=kv.num_free_blocks,
        num_total_blocks=kv.num_blocks,
        kv_usage=kv.usage,
        num_waiting=num_waiting,
        num_running=num_running,
        wall_time_s=end - start,
        model_time_s=model_time,
        start_time_s=start,
        end_time_s=end,
        admitted=batch.admitted,
        sampled=sampled,
        arrived=tuple(arrived),
        num_prefill_tokens=batch.num_batched_tokens - num_decode,
        num_computed=tuple([r.num_computed_tokens for r in scheduled_requests]),
        blocks_cached=blocks.cached,
        block_tables=blocks.tables,
        speculated=speculated,
        **_host_tiers(blocks, kv),
        **_press(compacted, scheduled_requests),
        expert_load=None if reports is None else reports.get(EXPERT_LOAD),
    )


def _press(compacted: tuple[Any, ...] | None, requests: list[Any]) -> dict[str, Any]:
    """The step event's KV press fields (none without a press, or without compacted
    requests). ``compacted``: None when the engine has no press."""
    if compacted is None or (not compacted and not any(r.kv_dropped for r in requests)):
        return {}
    return {
        "kv_compacted": compacted,
        "kv_dropped": tuple([r.kv_dropped for r in requests]),
    }


def _host_tiers(blocks: BlockEvents, kv: KVCacheManager) -> dict[str, Any]:
    """The step event's swap and offload-tier fields (none without host pools)."""
    swap, tier = getattr(kv, "swap", None), getattr(kv, "tier", None)
    if swap is None and tier is None:
        return {}
    return {
        "swapped_out": blocks.swapped_out,
        "swapped_in": blocks.swapped_in,
        "blocks_spilled": blocks.spilled,
        "blocks_loaded": blocks.loaded,
        "offload_blocks_evicted": blocks.offload_evicted,
        "num_swap_blocks_used": 0 if swap is None else swap.num_used_blocks,
        "num_swap_blocks": 0 if swap is None else swap.num_blocks,
        "num_offload_blocks_cached": 0 if tier is None else tier.num_cached_blocks,
        "num_offload_blocks": 0 if tier is None else tier.num_blocks,
    }
