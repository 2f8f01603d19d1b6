"""Scheduling policies: which waiting request is admitted next, which running one yields.

The scheduler (mechanism) asks a policy two questions and never decides either itself:

* ``order(waiting, now)``: the admission order of the waiting requests this step
  (``waiting`` arrives in arrival order, so FCFS returns it as it is: no sort per step);
* ``victim(candidates)``: which running request to preempt when KV blocks run out.

A policy may also define ``admit(request, budget) -> bool``; when it returns False the
request is skipped this step (it stays waiting) and admission goes on with the next one.
A new policy is a small class with these methods (see ``FCFS``).

A policy that raises (or names a victim that is not a candidate) stops scheduling for the
step; the engine reports it as a :class:`~llmlab.errors.ComponentError` naming the policy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from llmlab.request import Request


@runtime_checkable
class SchedulingPolicy(Protocol):
    name: str

    def order(self, waiting: Sequence[Request], now: float) -> Iterable[Request]:
        """Waiting requests (given in arrival order) in the order they should be admitted.

        Admission stops at the first request that does not fit, so only a prefix of the
        result is usually consumed; returning ``waiting`` itself is fine (don't mutate it).
        """

    def victim(self, candidates: Sequence[Request]) -> Request:
        """The running request to preempt; ``candidates`` is never empty."""


@attrs.define
class FCFS:
    """First come, first served; preempt the latest arrival (vLLM's default).

    Admission is strict: if the head of the queue does not fit, nothing behind it is
    admitted that step, so a long prompt is never starved by short ones.
    """

    name: str = "fcfs"

    def order(self, waiting: Sequence[Request], now: float) -> Sequence[Request]:
        return waiting  # already in arrival order

    def victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: r.arrival_time)


SCHEDULING_POLICIES: dict[str, type] = {"fcfs": FCFS}
