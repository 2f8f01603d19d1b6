"""The scheduling-policy interface (version 2); its base class and the adapter for v1 are
in :mod:`llmlab.scheduler.policy_kit` (imported here too).

The scheduler owns the mechanism (budgets, KV blocks, rows, preemption by recompute); a
policy makes four decisions and sees requests only through read-only
:class:`~llmlab.request.RequestView`\\ s:

=====================================  ==========================================================
``push(request, now)``                 a request starts waiting: it arrived, was preempted, or was
                                       popped this step and not admitted (handed back at the end
                                       of admission, in the order popped)
``pop(now) -> request | None``         the waiting request to try to admit next (removed)
``remove(request)``                    a request left for good: aborted while waiting, or
                                       finished, aborted or failed while running (so per-request
                                       state can go; a no-op for requests not queued)
``victim(candidates) -> request``      the running request to preempt when KV blocks run out
``running_order(running, now)``        optional: the order running requests get the step's budget
                                       (default: admission order)
``admit(request, budget) -> bool``     optional: False skips a popped request this step
``preempt_for(request, running)``      optional: a running request to preempt so that ``request``
                                       (popped, but out of blocks or rows) can be admitted, or None
``on_step(served, now)``               optional: what each request was served this step
``bind(view)``                         optional: called once with a :class:`SchedulerView`
                                       (prefix lookups, pool and queue sizes; ``attach``: old name)
``preemption_mode(victim)``            optional: ``"swap"``, ``"recompute"`` or None (the
                                       engine's ``preemption_mode``) for a victim about to be
                                       preempted; swap falls back to recompute when the swap
                                       space is full (e.g. swap long contexts, recompute short)
=====================================  ==========================================================

The waiting queue is the policy's own, kept incrementally, so a step costs O(log n) in the
queue length instead of a sort. You rarely write those three methods yourself:

* subclass :class:`Policy` and define a static sort key, and you get the O(log n) queue and a
  matching victim (the largest key) for free::

      class ShortestPromptFirst(Policy):
          name = "my_spf"

          def key(self, request):
              return request.num_prompt_tokens

* or write today's two-method form, ``order(waiting, now)`` + ``victim(candidates)``: it keeps
  working unchanged (the scheduler wraps it in :class:`OrderPolicy`, which calls ``order``
  once per step: fine for notebook-sized queues, O(n log n) per step for large ones).

Admission pops requests until one does not fit (it is handed back and admission stops, so a
long prompt is never starved by shorter ones behind it), the step's token budget or rows
run out, or the queue is empty. A policy that raises, or answers with something that is not
one of the requests it was offered, stops scheduling for the step; the engine raises a
:class:`~llmlab.errors.ComponentError` naming the policy and the method after the step, and
no request is lost (one whose ``push`` failed is pushed again on the next step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from llmlab import registry
from llmlab.request import RequestView
from llmlab.scheduler.policy_kit import KeyedQueue, OrderPolicy, Policy

__all__ = ["KeyedQueue", "OrderPolicy", "Policy", "SchedulerView", "SchedulingPolicy", "Served",
           "as_policy", "request_of", "views"]

if TYPE_CHECKING:
    from llmlab.cache.kv_cache_manager import KVCacheManager
    from llmlab.request import Request

REQUIRED_METHODS = ("push", "pop", "remove", "victim")

# What the scheduler's policy call returns when the policy raised (None may be a
# legitimate answer).
FAILED = object()
LEGACY_METHODS = ("order", "victim")


@attrs.frozen(slots=True)
class Served:
    """What one request got in one step (``on_step``'s ``served`` items).

    Attributes:
        request: the request (a view; it may have finished this step).
        num_tokens: tokens computed for it (prompt, or recomputed context, or 1 decode).
        num_prompt_tokens: those of ``num_tokens`` that were prompt tokens computed for the
            first time (not recompute after a preemption, not cache hits).
        num_output_tokens: tokens it generated this step (0 for a prefill chunk).
    """

    request: RequestView
    num_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int


@runtime_checkable
class SchedulingPolicy(Protocol):
    """The decisions the scheduler delegates (see the module docstring for the table).

    Only ``push``, ``pop``, ``remove`` and ``victim`` are required; subclass :class:`Policy`
    to get all of them from a ``key``. A complete policy written from scratch, last come
    first served (a stack), O(1) per call with lazy removal::

        @register("scheduling_policy", "lcfs")
        class LastComeFirstServed:
            name = "lcfs"

            def __init__(self):
                self.stack, self.queued = [], set()

            def push(self, request, now):
                self.queued.add(request)
                self.stack.append(request)

            def pop(self, now):
                while self.stack:  # entries of removed requests are skipped here
                    request = self.stack.pop()
                    if request in self.queued:
                        self.queued.remove(request)
                        return request
                return None

            def remove(self, request):  # also told about running requests: harmless
                self.queued.discard(request)

            def victim(self, candidates):
                return min(candidates, key=lambda r: r.arrival_time)
    """

    name: str

    def push(self, request: RequestView, now: float) -> None: ...

    def pop(self, now: float) -> RequestView | None: ...

    def remove(self, request: RequestView) -> None: ...

    def victim(self, candidates: Sequence[RequestView]) -> RequestView: ...


@attrs.define(eq=False)
class SchedulerView:
    """Read-only facts a policy may consult (given once, through ``bind``)."""

    _kv: KVCacheManager = attrs.field(repr=False)
    max_num_seqs: int
    max_num_batched_tokens: int
    _num_waiting: Any = attrs.field(repr=False)  # () -> int
    _running: Any = attrs.field(repr=False)  # () -> Sequence[RequestView]

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def num_blocks(self) -> int:
        return self._kv.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached free blocks count as free)."""
        return self._kv.num_free_blocks

    @property
    def num_waiting(self) -> int:
        return self._num_waiting()

    @property
    def running(self) -> Sequence[RequestView]:
        """Running requests, in admission order."""
        return self._running()

    def cached_prefix_tokens(self, request: RequestView) -> int:
        """Tokens of ``request`` (prompt + output so far) a prefix-cache hit would cover now
        (device blocks, then their continuation in the offload tier, if there is one).

        O(length of the hit in blocks); reads the cache without touching eviction order.
        """
        kv, live = self._kv, request._request
        device = kv.lookup_prefix(live)
        return (len(device) + len(kv.lookup_offloaded(live, len(device)))) * kv.block_size


def as_policy(policy: Any) -> Any:
    """The object the scheduler drives: ``policy`` itself (v2) or an :class:`OrderPolicy`.

    Raises ``TypeError`` naming the first missing method, or a method that cannot take the
    scheduler's call with the signature expected (``registry.CONTRACTS``), so a bad policy
    fails when the engine is built rather than at its first step.
    """
    if isinstance(policy, type):
        raise TypeError(
            f"scheduling policy must be an instance, got the class {policy.__name__}; "
            f"pass {policy.__name__}()"
        )
    if all(callable(getattr(policy, m, None)) for m in REQUIRED_METHODS):
        registry.check("scheduling_policy", policy)
        return policy
    if callable(getattr(policy, "order", None)):
        missing = [m for m in LEGACY_METHODS if not callable(getattr(policy, m, None))]
        if not missing:
            registry.check("scheduling_policy", policy, registry.LEGACY_SCHEDULING)
            return OrderPolicy(policy)
    else:
        missing = [m for m in REQUIRED_METHODS if not callable(getattr(policy, m, None))]
    raise TypeError(
        f"scheduling policy {type(policy).__name__} is missing method {missing[0]!r}: a policy "
        "defines push/pop/remove/victim (subclass llmlab.scheduler.Policy to get them from "
        "a key), or order/victim"
    )


def request_of(view: Any) -> Request | None:
    """The request behind a view a policy handed back, or None if it is not a view."""
    return view._request if isinstance(view, RequestView) else None


def views(requests: Iterable[Request]) -> list[RequestView]:
    return [r.view for r in requests]
