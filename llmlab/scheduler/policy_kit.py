"""Helpers for writing scheduling policies: :class:`Policy` (a policy from a static sort
key, on :class:`KeyedQueue`, an O(log n) waiting queue) and :class:`OrderPolicy` (runs a v1
``order`` + ``victim`` policy on the v2 contract of :mod:`llmlab.scheduler.policy`)."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from typing import Any

import attrs

from llmlab.request import RequestView


# -- the waiting queue behind ``Policy`` ------------------------------------------------------


@attrs.define(eq=False)
class KeyedQueue:
    """A min-heap of requests by ``(key, seq)`` with O(log n) push/pop and O(1) remove.

    Removal is lazy (the entry is skipped when it reaches the top); the heap is rebuilt when
    dead entries outnumber live ones, so memory stays O(live).
    """

    _heap: list[tuple[Any, int, RequestView]] = attrs.field(factory=list)
    _live: dict[RequestView, int] = attrs.field(factory=dict)  # view -> seq of its entry
    _next: int = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: RequestView) -> bool:
        return request in self._live

    def push(self, request: RequestView, key: Any) -> None:
        # The request's own arrival order breaks ties, so handing a popped request back
        # restores its place exactly; a private counter orders equal seqs (tests).
        tiebreak = (request.seq, self._next)
        self._next += 1
        self._live[request] = tiebreak
        heapq.heappush(self._heap, (key, tiebreak, request))

    def peek(self) -> RequestView | None:
        heap, live = self._heap, self._live
        while heap:
            _, tiebreak, request = heap[0]
            if live.get(request) == tiebreak:
                return request
            heapq.heappop(heap)
        return None

    def pop(self) -> RequestView | None:
        request = self.peek()
        if request is not None:
            heapq.heappop(self._heap)
            del self._live[request]
        return request

    def remove(self, request: RequestView) -> None:
        if self._live.pop(request, None) is not None and len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def __iter__(self):
        """Live requests in no particular order (O(n): for small queues and views)."""
        return iter(list(self._live))


class Policy:
    """Base class: a policy defined by a static sort key (smallest first).

    ``key(request)`` is read once when the request is queued (arrival, preemption, or hand
    back), so it must not depend on the time; ties go by arrival order. Everything else has
    a default: ``victim`` preempts the candidate with the largest key (the one the policy
    would serve last), running requests keep admission order, and the optional hooks do
    nothing. Override any of them. The default key is the arrival time (FCFS).

    Example::

        class ShortestJobFirst(Policy):
            name = "my_sjf"

            def key(self, request):
                return request.max_tokens
    """

    name: str = "policy"

    def key(self, request: RequestView) -> Any:
        return request.arrival_time

    @property
    def waiting(self) -> KeyedQueue:
        """This policy's queue (created on first use, so subclasses need no ``__init__``)."""
        queue = self.__dict__.get("_waiting_queue")
        if queue is None:
            queue = self.__dict__["_waiting_queue"] = KeyedQueue()
        return queue

    def push(self, request: RequestView, now: float) -> None:
        self.waiting.push(request, self.key(request))

    def pop(self, now: float) -> RequestView | None:
        return self.waiting.pop()

    def remove(self, request: RequestView) -> None:
        self.waiting.remove(request)

    def victim(self, candidates: Sequence[RequestView]) -> RequestView:
        return max(candidates, key=lambda r: (self.key(r), r.seq))


# -- the v1 two-method form -----------------------------------------------------------------


@attrs.define(eq=False)
class OrderPolicy:
    """Adapter that runs a v1 policy (``order(waiting, now)`` + ``victim``) on the v2 contract.

    ``order`` sees the waiting requests in arrival order (a list of views it may sort or
    return as is) and is called at most once per step; popping walks its answer. Its
    optional ``admit``, ``running_order``, ``preempt_for``, ``on_step`` and ``bind`` are
    passed through by the scheduler.
    """

    inner: Any
    _waiting: list[RequestView] = attrs.field(factory=list)  # arrival order
    _order: list[RequestView] | None = None
    _order_now: float | None = None
    _next: int = 0

    @property
    def name(self) -> str:
        return getattr(self.inner, "name", type(self.inner).__name__)

    def push(self, request: RequestView, now: float) -> None:
        bisect.insort_right(self._waiting, request, key=_arrival_key)
        self._order = None

    def pop(self, now: float) -> RequestView | None:
        if self._order is None or self._order_now != now:
            self._order = list(self.inner.order(list(self._waiting), now))
            self._order_now, self._next = now, 0
        while self._next < len(self._order):
            request = self._order[self._next]
            self._next += 1
            if self._discard(request):
                return request
        return None

    def remove(self, request: RequestView) -> None:
        self._discard(request)

    def victim(self, candidates: Sequence[RequestView]) -> RequestView:
        return self.inner.victim(candidates)

    def _discard(self, request: Any) -> bool:
        if not isinstance(request, RequestView):
            return False
        i = bisect.bisect_left(self._waiting, _arrival_key(request), key=_arrival_key)
        while i < len(self._waiting) and _arrival_key(self._waiting[i]) == _arrival_key(request):
            if self._waiting[i] is request:
                del self._waiting[i]
                return True
            i += 1
        return False


def _arrival_key(request: RequestView) -> tuple[float, int]:
    return (request.arrival_time, request.seq)
