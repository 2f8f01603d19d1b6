"""The built-in scheduling policies, registered by name.

=============  ===================================================================  ============
name           admits first                                                         preempts
=============  ===================================================================  ============
``fcfs``       earliest arrival                                                     latest arrival
``priority``   lowest ``priority`` value, then arrival; preempts to admit           lowest priority
``spf``        shortest prompt (optional linear aging)                              longest prompt
``sjf``        shortest predicted output (``max_tokens`` or a predictor)            longest job
``fair``       the user with the least service so far (Virtual Token Counter)       most-served user
``cache_aware`` longest cached prefix (FCFS when the queue is long)                  latest arrival
``mlfq``       highest level of a skip-join multi-level feedback queue              lowest level
=============  ===================================================================  ============

Every decision is O(1) or O(log n) in the number of waiting requests, except
``cache_aware``, which looks at most ``max_queue`` requests per step by design.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from llmlab.registry import register, table
from llmlab.request import RequestView
from llmlab.scheduler.policy import KeyedQueue, Policy, SchedulerView, Served


def _check_non_negative(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _check_positive_int(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@register("scheduling_policy", "fcfs")
@attrs.define(eq=False)
class FCFS(Policy):
    """First come, first served; preempt the latest arrival (vLLM's default policy).

    Admission is strict: if the head of the queue does not fit, nothing behind it is
    admitted that step, so a long prompt is never starved by short ones.
    """

    name: str = "fcfs"


@register("scheduling_policy", "priority")
@attrs.define(eq=False)
class PriorityPolicy(Policy):
    """Lowest ``priority`` value first, ties by arrival; preempts the lowest priority.

    Source: vLLM's ``scheduling_policy="priority"`` (same order and victim).

    As in vLLM, the victim when blocks run out is the running request with the largest
    ``(priority, arrival)``, i.e. the lowest priority and, among equals, the latest arrival.
    Running requests get the step's budget in priority order. With ``preempt=True`` (the
    default) a waiting request that does not fit preempts that victim if its priority is
    strictly lower (its value larger), so urgent work does not wait for a long generation
    to end; equal priorities never preempt each other, which rules out thrashing.
    """

    name: str = "priority"
    preempt: bool = True

    def key(self, request: RequestView) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def running_order(self, running: Sequence[RequestView], now: float) -> list[RequestView]:
        return sorted(running, key=lambda r: (r.priority, r.arrival_time, r.seq))

    def preempt_for(
        self, request: RequestView, running: Sequence[RequestView]
    ) -> RequestView | None:
        if not self.preempt:
            return None
        worst = self.victim(running)
        return worst if worst.priority > request.priority else None


def _aged(length: float, request: RequestView, aging: float) -> float:
    # Linear aging: a request that waited t seconds counts as aging*t tokens shorter. As
    # `length - aging*(now - arrival)` orders like `length + aging*arrival`, the key stays
    # static and the queue stays a heap.
    return length + aging * request.arrival_time if aging else length


@register("scheduling_policy", "spf")
@attrs.define(eq=False)
class ShortestPromptFirst(Policy):
    """Shortest prompt first, with optional linear aging against starvation.

    The cheapest prefill goes first, which minimizes mean time to first token when prompts
    dominate: the shortest-processing-time rule (Smith, "Various optimizers for single-stage
    production", Naval Research Logistics Quarterly, 1956) applied to the prefill phase.

    ``aging`` (tokens per second of waiting, default 0) bounds starvation: a request of
    prompt length L is admitted before any request arriving more than L/aging seconds after
    it. The victim is the running request with the longest (aged) prompt.
    """

    name: str = "spf"
    aging: float = attrs.field(default=0.0, validator=_check_non_negative)

    def key(self, request: RequestView) -> float:
        return _aged(request.num_prompt_tokens, request, self.aging)


@register("scheduling_policy", "sjf")
@attrs.define(eq=False)
class ShortestJobFirst(Policy):
    """Shortest job first, by remaining output length (``max_tokens`` or a predictor).

    Sources: Fu et al., "Efficient LLM Scheduling by Learning to Rank", NeurIPS 2024; Qiu
    et al., "Efficient Interactive LLM Serving with Proxy Model-based Sequence Length
    Prediction", 2024 (SSJF, with a small model as the predictor).

    ``predictor(request) -> float`` is called once per request (its answer is kept); it sees
    a read-only view (prompt tokens, sampling params, user). A request without
    ``max_tokens`` and no predictor counts as ``default_length`` tokens. ``aging`` bounds
    starvation as in ``spf``. Preemption takes the longest remaining job.
    """

    name: str = "sjf"
    predictor: Callable[[RequestView], float] | None = None
    aging: float = attrs.field(default=0.0, validator=_check_non_negative)
    default_length: int = attrs.field(default=4096, validator=_check_positive_int)
    _predicted: dict[RequestView, float] = attrs.field(factory=dict, repr=False)

    def key(self, request: RequestView) -> float:
        length = self._predicted.get(request)
        if length is None:
            if self.predictor is not None:
                length = float(self.predictor(request))
                if math.isnan(length):
                    raise ValueError(f"predictor returned NaN for {request.request_id!r}")
            else:
                length = request.max_tokens or self.default_length
            self._predicted[request] = length
        remaining = max(length - request.num_output_tokens, 0)
        return _aged(remaining, request, self.aging)

    def remove(self, request: RequestView) -> None:
        super().remove(request)
        self._predicted.pop(request, None)


@register("scheduling_policy", "fair")
@attrs.define(eq=False)
class VirtualTokenCounter(Policy):
    """Fair sharing of service between users: the Virtual Token Counter (VTC).

    Source: Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024.

    Each user (``request.user``; None is one more user) has a counter of the service it
    received: ``input_weight`` per prompt token it will compute (prefix-cache hits are not
    service), charged when a request is first popped for admission, plus ``output_weight``
    per generated token, charged as tokens come out (``on_step``). Admission pops the oldest request of the waiting user with the smallest
    counter. When a user starts waiting again after an idle spell its counter is lifted to
    the smallest counter among waiting users (or to the counter of the last user whose
    queue emptied, if none wait), so idling earns no credit. The paper proves the service
    gap between two backlogged users stays within ``2 * max(input_weight * L_input,
    output_weight * M)`` (L_input: longest prompt, M: tokens a batch can hold). The victim
    is a request of the running user with the largest counter. A prompt is charged once,
    also when the request is preempted and recomputed (recompute is the engine's cost).

    Costs: O(log U + log n) per push/pop for U waiting users, O(log U) per served request.
    """

    name: str = "fair"
    input_weight: float = attrs.field(default=1.0, validator=_check_non_negative)
    output_weight: float = attrs.field(default=2.0, validator=_check_non_negative)
    counters: dict[Any, float] = attrs.field(factory=dict)
    _queues: dict[Any, KeyedQueue] = attrs.field(factory=dict, repr=False)
    # Waiting users by counter: (counter, user number, version); stale entries are skipped.
    _heap: list[tuple[float, int, int]] = attrs.field(factory=list, repr=False)
    _user_of: list[Any] = attrs.field(factory=list, repr=False)  # user number -> user
    _number: dict[Any, int] = attrs.field(factory=dict, repr=False)
    _version: dict[Any, int] = attrs.field(factory=dict, repr=False)
    _charged: set[RequestView] = attrs.field(factory=set, repr=False)
    _last_left: float = attrs.field(default=0.0, repr=False)
    _cache: SchedulerView | None = attrs.field(default=None, repr=False)

    def bind(self, view: SchedulerView) -> None:
        self._cache = view

    def push(self, request: RequestView, now: float) -> None:
        user = request.user
        queue = self._queues.get(user)
        if queue is None:
            queue = self._queues[user] = KeyedQueue()
            self._number[user] = len(self._user_of)
            self._user_of.append(user)
            self.counters.setdefault(user, 0.0)
        if not queue:  # starts waiting: lift the counter (no credit for idling)
            floor = self._min_waiting_counter()
            floor = self._last_left if floor is None else floor
            self.counters[user] = max(self.counters[user], floor)
            queue.push(request, request.arrival_time)
            self._reheap(user)
        else:
            queue.push(request, request.arrival_time)

    def pop(self, now: float) -> RequestView | None:
        number = self._min_waiting_user()
        if number is None:
            return None
        user = self._user_of[number]  # may be None: requests without a user share one
        queue = self._queues[user]
        request = queue.pop()
        if request not in self._charged:
            # The prompt tokens it will compute: a prefix-cache hit is not service (the
            # engine's metrics do not count it either).
            self._charged.add(request)
            hit = self._cache.cached_prefix_tokens(request) if self._cache is not None else 0
            computed = max(request.num_prompt_tokens - hit, 0)
            self.counters[user] += self.input_weight * computed
        self._after_change(user)
        return request

    def remove(self, request: RequestView) -> None:
        self._charged.discard(request)
        queue = self._queues.get(request.user)
        if queue is not None and request in queue:
            queue.remove(request)
            self._after_change(request.user)

    def on_step(self, served: Sequence[Served], now: float) -> None:
        touched = set()
        for s in served:
            if s.num_output_tokens:
                user = s.request.user
                self.counters[user] = self.counters.get(user, 0.0) + (
                    self.output_weight * s.num_output_tokens
                )
                touched.add(user)
        for user in touched:
            if self._queues.get(user):
                self._reheap(user)

    def victim(self, candidates: Sequence[RequestView]) -> RequestView:
        return max(
            candidates,
            key=lambda r: (self.counters.get(r.user, 0.0), r.arrival_time, r.seq),
        )

    # -- internals ---------------------------------------------------------------------

    def _after_change(self, user: Any) -> None:
        if self._queues[user]:
            self._reheap(user)
        else:
            self._last_left = self.counters[user]

    def _reheap(self, user: Any) -> None:
        version = self._version.get(user, 0) + 1
        self._version[user] = version
        heapq.heappush(self._heap, (self.counters[user], self._number[user], version))
        if len(self._heap) > 4 * len(self._queues) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if self._is_current(e)]
            heapq.heapify(self._heap)

    def _is_current(self, entry: tuple[float, int, int]) -> bool:
        user = self._user_of[entry[1]]
        return self._version.get(user) == entry[2] and bool(self._queues[user])

    def _min_waiting_user(self) -> int | None:
        """The number of the waiting user with the smallest counter (None: nobody waits)."""
        heap = self._heap
        while heap:
            if self._is_current(heap[0]):
                return heap[0][1]
            heapq.heappop(heap)
        return None

    def _min_waiting_counter(self) -> float | None:
        number = self._min_waiting_user()
        return None if number is None else self.counters[self._user_of[number]]


@register("scheduling_policy", "cache_aware")
@attrs.define(eq=False)
class CacheAware(Policy):
    """Longest cached prefix first (SGLang's LPM), FCFS when the queue is long.

    Source: Zheng et al., "SGLang: Efficient Execution of Structured Language Model
    Programs", NeurIPS 2024 (the longest-prefix-match policy).

    Admitting the request with the most of its prompt already in the prefix cache first
    raises the hit rate: its blocks are reused before eviction can take them. Each step,
    when at most ``max_queue`` requests wait, it ranks them by cached-prefix length (ties:
    arrival); with more waiting it falls back to FCFS, as SGLang does past 128 waiting
    requests, because the lookups would cost O(n) per step. Preempts the latest arrival.
    """

    name: str = "cache_aware"
    max_queue: int = attrs.field(default=128, validator=_check_positive_int)
    _cache: SchedulerView | None = attrs.field(default=None, repr=False)
    _ranked: list[RequestView] | None = attrs.field(default=None, repr=False)
    _ranked_at: float | None = attrs.field(default=None, repr=False)

    def bind(self, view: SchedulerView) -> None:
        self._cache = view

    def push(self, request: RequestView, now: float) -> None:
        super().push(request, now)
        self._ranked = None

    def pop(self, now: float) -> RequestView | None:
        queue = self.waiting
        if self._cache is None or len(queue) > self.max_queue:
            self._ranked = None
            return queue.pop()
        if self._ranked is None or self._ranked_at != now:
            # Ranked once per step: admissions within a step do not change what is cached.
            hits = self._cache.cached_prefix_tokens
            self._ranked = sorted(
                queue, key=lambda r: (-hits(r), r.arrival_time, r.seq), reverse=True
            )
            self._ranked_at = now
        while self._ranked:
            request = self._ranked.pop()
            if request in queue:
                queue.remove(request)
                return request
        return None


@register("scheduling_policy", "mlfq")
@attrs.define(eq=False)
class SkipJoinMLFQ(Policy):
    """Skip-join multi-level feedback queue, after FastServe.

    Source: Wu et al., "Fast Distributed Inference Serving for Large Language Models", 2023.

    Level i has a quantum of ``base_quantum * 2**i`` served tokens. A new request *skips*
    straight to the first level whose quantum covers its prompt (its first iteration), so
    long prompts do not block short ones at the top. A request that used up its level's
    quantum (``on_step``) drops one level. Waiting requests are admitted highest level
    first (FIFO within a level); running ones get the step's budget in the same order, and
    the victim is the lowest-level, latest one. Starvation prevention, as in FastServe: a
    request waiting longer than ``starvation_s`` seconds at a level is promoted to the top.

    Preemption here is recompute, not FastServe's KV swapping, so by default a waiting
    request does not preempt running ones (``preempt=True`` lets a request two or more
    levels higher do it).
    """

    name: str = "mlfq"
    num_levels: int = attrs.field(default=6, validator=_check_positive_int)
    base_quantum: int = attrs.field(default=64, validator=_check_positive_int)
    starvation_s: float = attrs.field(default=30.0, validator=_check_non_negative)
    preempt: bool = False
    _levels: list[KeyedQueue] = attrs.field(init=False, repr=False)
    _level: dict[RequestView, int] = attrs.field(factory=dict, repr=False)
    _used: dict[RequestView, int] = attrs.field(factory=dict, repr=False)
    _since: dict[RequestView, float] = attrs.field(factory=dict, repr=False)
    # Join times of requests popped this step: one handed back keeps its place in line.
    _popped: dict[RequestView, float] = attrs.field(factory=dict, repr=False)
    _popped_at: float | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        self._levels = [KeyedQueue() for _ in range(self.num_levels)]

    def quantum(self, level: int) -> int:
        return self.base_quantum << level

    def level_of(self, request: RequestView) -> int:
        """The request's current level (0 is served first)."""
        level = self._level.get(request)
        if level is None:  # skip-join: the first level whose quantum covers the prompt
            ratio = request.num_prompt_tokens / self.base_quantum
            level = 0 if ratio <= 1 else min(self.num_levels - 1, math.ceil(math.log2(ratio)))
            self._level[request] = level
            self._used[request] = 0
        return level

    def push(self, request: RequestView, now: float) -> None:
        since = self._popped.pop(request, now)
        self._since[request] = since
        self._levels[self.level_of(request)].push(request, since)

    def pop(self, now: float) -> RequestView | None:
        if now != self._popped_at:
            self._popped.clear()
            self._popped_at = now
        self._promote_starved(now)
        for queue in self._levels:
            request = queue.pop()
            if request is not None:
                self._popped[request] = self._since.pop(request)
                return request
        return None

    def remove(self, request: RequestView) -> None:
        level = self._level.pop(request, None)
        if level is not None:
            self._levels[level].remove(request)
        self._used.pop(request, None)
        self._since.pop(request, None)
        self._popped.pop(request, None)

    def on_step(self, served: Sequence[Served], now: float) -> None:
        for s in served:
            request = s.request
            level = self.level_of(request)
            used = self._used[request] + s.num_tokens
            if used >= self.quantum(level) and level + 1 < self.num_levels:
                self._level[request], used = level + 1, 0
            self._used[request] = used

    def running_order(self, running: Sequence[RequestView], now: float) -> list[RequestView]:
        return sorted(running, key=lambda r: (self.level_of(r), r.arrival_time, r.seq))

    def victim(self, candidates: Sequence[RequestView]) -> RequestView:
        return max(candidates, key=lambda r: (self.level_of(r), r.arrival_time, r.seq))

    def preempt_for(
        self, request: RequestView, running: Sequence[RequestView]
    ) -> RequestView | None:
        if not self.preempt:
            return None
        worst = self.victim(running)
        return worst if self.level_of(worst) >= self.level_of(request) + 2 else None

    def _promote_starved(self, now: float) -> None:
        # Each level is FIFO by the time a request joined it, so only heads can be starved:
        # O(levels) per pop, plus O(log n) per promotion.
        for queue in self._levels[1:]:
            while True:
                head = queue.peek()
                if head is None or now - self._since[head] <= self.starvation_s:
                    break
                queue.pop()
                self._level[head], self._used[head] = 0, 0
                self._levels[0].push(head, self._since[head])


SCHEDULING_POLICIES = table("scheduling_policy")
"""Registered scheduling policies by name (live: includes the ones users register)."""
