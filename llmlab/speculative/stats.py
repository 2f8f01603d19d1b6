"""``SpecDecodeStats``: how often drafts are accepted, counted from step events.

Every acceptance number llmlab reports (``LLM.get_metrics()``, the server's ``/metrics``)
uses the counts and the definitions in :class:`SpecDecodeStats`'s docstring, which
``docs/speculative.md`` repeats.

This module sits below the engine, so it reads events by duck typing: any object with
``step_index``, ``end_time_s`` and ``speculated`` (``(request_id, num_drafted,
num_accepted)`` per request that speculated) will do, a
:class:`~llmlab.observe.events.StepEvent` included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import attrs


class _SpeculatedStep(Protocol):
    """What this module reads of a :class:`~llmlab.observe.events.StepEvent`."""

    step_index: int
    end_time_s: float
    speculated: Sequence[tuple[str, int, int]]


def _ratio(numerator: int, denominator: int) -> float:
    """``numerator / denominator``, NaN when there is nothing to divide by (undefined,
    not zero: no drafts is not a draft that failed)."""
    return numerator / denominator if denominator else float("nan")


def count_positions(
    drafted_per_pos: list[int], accepted_per_pos: list[int], num_drafted: int, num_accepted: int
) -> None:
    """Add one draft to per-position counts (index ``j - 1`` is position ``j``), growing
    the lists to ``num_drafted``."""
    grow = num_drafted - len(drafted_per_pos)
    if grow > 0:
        drafted_per_pos.extend([0] * grow)
        accepted_per_pos.extend([0] * (num_drafted - len(accepted_per_pos)))
    for i in range(num_drafted):
        drafted_per_pos[i] += 1
    for i in range(num_accepted):
        accepted_per_pos[i] += 1


@attrs.frozen
class SpecTotals:
    """Drafts and tokens over a span of steps (one request's life, one step).

    Attributes:
        num_drafts: request-steps with a draft (at least one drafted token).
        num_draft_tokens: tokens drafted.
        num_accepted_tokens: drafted tokens the target accepted.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (see :class:`SpecDecodeStats`)."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification, the bonus token included (see :class:`SpecDecodeStats`)."""
        return 1.0 + _ratio(self.num_accepted_tokens, self.num_drafts)

    def plus(self, num_drafted: int, num_accepted: int) -> SpecTotals:
        """These totals with one more draft."""
        return SpecTotals(
            self.num_drafts + 1,
            self.num_draft_tokens + num_drafted,
            self.num_accepted_tokens + num_accepted,
        )


@attrs.frozen
class SpecStep:
    """One step that speculated, for plotting acceptance over time.

    Attributes:
        step_index: the event's ``step_index``.
        end_time_s: the engine clock when the step's outputs were ready.
        totals: the step's drafts, summed over its requests.
    """

    step_index: int
    end_time_s: float
    totals: SpecTotals


@attrs.define(eq=False)  # an observer: identity, so unsubscribe removes this one
class SpecDecodeStats:
    """Acceptance counters of speculative decoding; a step observer
    (``engine.subscribe(stats)``).

    A *draft* is one request's drafted tokens in one step (``num_drafted >= 1``): positions
    ``1..num_drafted`` were drafted, ``1..num_accepted`` accepted, and the step also emitted
    one token of the target's own (the correction, or the bonus when all were accepted).
    The definitions, the one set every number llmlab reports uses:

    * **acceptance rate** = ``num_accepted_tokens / num_draft_tokens``.
    * **per-position (unconditional) rate** at position ``j`` =
      ``accepted_per_pos[j-1] / drafted_per_pos[j-1]``: of the drafts that had a ``j``-th
      token, the fraction whose ``j``-th token was accepted. (Drafts differ in length, so
      the denominator is the drafts that reached ``j``, not every draft.)
    * **per-position conditional rate** at ``j`` = ``accepted_per_pos[j-1] /
      reached_per_pos[j-1]``: of the drafts whose ``j``-th token was verified (drafted,
      with tokens ``1..j-1`` accepted), the fraction whose ``j``-th token was accepted.
      At ``j = 1`` it equals the unconditional rate.
    * **mean acceptance length** = ``1 + num_accepted_tokens / num_drafts``: tokens emitted
      per verification, the bonus token included (vLLM's definition).

    A rate with nothing to divide by is NaN. Lists are indexed by ``j - 1`` and grow to
    the longest draft seen. Per-request totals and the per-step ``series`` grow with the
    requests and steps seen; :meth:`reset` clears everything.

    Attributes:
        num_drafts / num_draft_tokens / num_accepted_tokens: totals (:class:`SpecTotals`).
        drafted_per_pos: drafts with ``num_drafted >= j``.
        accepted_per_pos: drafts with ``num_accepted >= j``.
        reached_per_pos: drafts with ``num_drafted >= j`` and ``num_accepted >= j - 1``.
        series: one :class:`SpecStep` per step that had a draft, oldest first.
        num_decode_steps / num_steps_without_drafts: steps that decoded (read from a
            ``StepEvent``'s ``scheduled`` and ``num_prefill_tokens``; 0 for an event
            without them), and those of them where no request drafted: where the adaptive
            speculation length kept speculation off, or no proposer had a draft. A high
            share means the run measured little speculation: evaluate a proposer with
            ``speculation_length="fixed"``.
    """

    num_drafts: int = attrs.field(default=0, init=False)
    num_draft_tokens: int = attrs.field(default=0, init=False)
    num_accepted_tokens: int = attrs.field(default=0, init=False)
    drafted_per_pos: list[int] = attrs.field(factory=list, init=False)
    accepted_per_pos: list[int] = attrs.field(factory=list, init=False)
    reached_per_pos: list[int] = attrs.field(factory=list, init=False)
    series: list[SpecStep] = attrs.field(factory=list, init=False, repr=False)
    num_decode_steps: int = attrs.field(default=0, init=False)
    num_steps_without_drafts: int = attrs.field(default=0, init=False)
    _requests: dict[str, SpecTotals] = attrs.field(factory=dict, init=False, repr=False)

    def __call__(self, event: _SpeculatedStep) -> None:
        drafts = [entry for entry in event.speculated if entry[1] > 0]
        for entry in drafts:  # all checked first: a bad event changes nothing
            _, num_drafted, num_accepted = entry
            if not 0 <= num_accepted <= num_drafted:
                raise ValueError(
                    f"speculated entry {entry!r} of step {event.step_index}: num_accepted "
                    f"must be in [0, num_drafted={num_drafted}], got {num_accepted}"
                )
        scheduled = getattr(event, "scheduled", ())
        if sum(n for _, n in scheduled) > getattr(event, "num_prefill_tokens", 0):
            self.num_decode_steps += 1
            self.num_steps_without_drafts += not drafts
        if not drafts:
            return
        step = SpecTotals()
        for request_id, num_drafted, num_accepted in drafts:
            step = step.plus(num_drafted, num_accepted)
            totals = self._requests.get(request_id, SpecTotals())
            self._requests[request_id] = totals.plus(num_drafted, num_accepted)
            self._count_positions(num_drafted, num_accepted)
        self.num_drafts += step.num_drafts
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_tokens += step.num_accepted_tokens
        self.series.append(SpecStep(event.step_index, event.end_time_s, step))

    def _count_positions(self, num_drafted: int, num_accepted: int) -> None:
        count_positions(self.drafted_per_pos, self.accepted_per_pos, num_drafted, num_accepted)
        reached = self.reached_per_pos
        reached.extend([0] * (num_drafted - len(reached)))
        # Verification stops at the first rejection: positions past it were never tested.
        for i in range(min(num_drafted, num_accepted + 1)):
            reached[i] += 1

    @property
    def totals(self) -> SpecTotals:
        """The three totals as one :class:`SpecTotals`."""
        return SpecTotals(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.totals.acceptance_rate

    @property
    def mean_acceptance_length(self) -> float:
        """``1 + num_accepted_tokens / num_drafts``: tokens per verification, bonus included."""
        return self.totals.mean_acceptance_length

    @property
    def per_position_acceptance_rate(self) -> list[float]:
        """Unconditional rate per position (index ``j - 1``), see the class docstring."""
        return [_ratio(a, d) for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def per_position_conditional_rate(self) -> list[float]:
        """Conditional rate per position (index ``j - 1``), see the class docstring."""
        return [_ratio(a, r) for a, r in zip(self.accepted_per_pos, self.reached_per_pos)]

    def per_request(self, request_id: str) -> SpecTotals:
        """One request's totals (all zero for a request that never drafted)."""
        return self._requests.get(request_id, SpecTotals())

    def summary(self) -> dict[str, Any]:
        """Every total and rate, as plain numbers and lists (a copy)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "drafted_per_pos": list(self.drafted_per_pos),
            "accepted_per_pos": list(self.accepted_per_pos),
            "reached_per_pos": list(self.reached_per_pos),
            "per_position_acceptance_rate": self.per_position_acceptance_rate,
            "per_position_conditional_rate": self.per_position_conditional_rate,
            "num_requests": len(self._requests),
            "num_decode_steps": self.num_decode_steps,
            "num_steps_without_drafts": self.num_steps_without_drafts,
        }

    def reset(self) -> None:
        """Back to no drafts seen."""
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_decode_steps = self.num_steps_without_drafts = 0
        self.drafted_per_pos.clear()
        self.accepted_per_pos.clear()
        self.reached_per_pos.clear()
        self.series.clear()
        self._requests.clear()
