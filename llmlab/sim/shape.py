"""``BatchShape``: the numbers a cost model prices one engine step by.

The same shape is read two ways, and the two agree exactly (a test holds them to it):

* :meth:`BatchShape.of_batch`, from the :class:`~llmlab.scheduler.batch.ScheduledBatch` a
  simulated executor receives (plus what it decides itself: drafts verified, requests
  finishing), to *predict* the step's time;
* :meth:`BatchShape.of_event`, from the :class:`~llmlab.observe.events.StepEvent` a real
  engine emitted for the same step, to *fit* a cost model on measured times
  (:class:`~llmlab.sim.profiled.ProfiledCostModel`).

Only counts, never ids: a shape says what work the step implies, not whose.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from llmlab.observe.events import StepEvent
from llmlab.scheduler.batch import ScheduledBatch

FEATURES = (
    "num_requests",
    "num_prefill_tokens",
    "num_prefill_requests",
    "num_decode_requests",
    "num_draft_tokens",
    "num_sampled",
    "context_tokens",
    "attention_positions",
    "num_admitted",
    "num_preempted",
    "num_finished",
    "num_forks",
    "after_idle",
)
"""The fields of :class:`BatchShape`, in order (the columns a profiled model fits on)."""


@attrs.frozen(slots=True)
class BatchShape:
    """The work one engine step implies.

    Attributes:
        num_requests: entries in the batch (requests computing something this step).
        num_prefill_tokens: tokens of the entries that are not decodes: prompt chunks, and
            recomputation after preemption.
        num_prefill_requests: how many entries those are.
        num_decode_requests: one-token decode entries (one token each).
        num_draft_tokens: speculative draft tokens verified (extra positions through the
            model, beyond the scheduled tokens).
        num_sampled: positions whose logits go through the LM head and the sampler: one per
            entry that samples, plus its draft positions.
        context_tokens: KV entries the step's attention reads: per entry, its context after
            the step's forward (tokens before it, its new tokens and its drafts).
        attention_positions: over every token through the model, the positions it attends
            over (causal: the token at position ``i`` sees ``i + 1``); quadratic in a
            prefill chunk, one context per decode.
        num_admitted: requests admitted from the waiting queue this step (first time or
            resumed).
        num_preempted: requests preempted while the batch was built.
        num_finished: requests that finished this step.
        num_forks: parallel samples (n / best_of) that started this step.
        after_idle: 1 for the first step after the engine sat idle (nothing waiting or
            running; and a run's first step), else 0. Its measured cycle starts at the
            arrival that woke the engine, so it holds the wake-up: the driver's sleep
            overshooting, adding the arrivals, cold caches (a GPU's clocks ramping up).
            :meth:`of_event` cannot tell (one event does not say what came before):
            :func:`~llmlab.sim.cost_model.as_shapes` sets it from the run's events.
    """

    num_requests: int = 0
    num_prefill_tokens: int = 0
    num_prefill_requests: int = 0
    num_decode_requests: int = 0
    num_draft_tokens: int = 0
    num_sampled: int = 0
    context_tokens: int = 0
    attention_positions: int = 0
    num_admitted: int = 0
    num_preempted: int = 0
    num_finished: int = 0
    num_forks: int = 0
    after_idle: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens through the model's layers: prefill, decodes and draft positions."""
        return self.num_prefill_tokens + self.num_decode_requests + self.num_draft_tokens

    @property
    def is_decode(self) -> bool:
        """Every entry is a one-token decode (a pure decode step)."""
        return self.num_prefill_requests == 0 and self.num_decode_requests > 0

    def as_tuple(self) -> tuple[int, ...]:
        """The fields in :data:`FEATURES` order."""
        return attrs.astuple(self)

    @classmethod
    def of_batch(
        cls,
        batch: ScheduledBatch,
        num_drafted: Sequence[int] | None = None,
        num_finished: int = 0,
        after_idle: bool = False,
    ) -> BatchShape:
        """The shape of ``batch`` as an executor sees it. ``num_drafted``: per entry, the
        draft tokens it verifies (None: none); ``num_finished``: requests the step ends
        (an executor that knows the output lengths counts them); ``after_idle``: the
        engine sat idle before it."""
        entries = batch.entries
        drafts, sampled, context, positions = _work(
            (e.start, len(e.token_ids), 0 if num_drafted is None else num_drafted[i],
             e.num_scored > 0)
            for i, e in enumerate(entries)
        )
        decodes = sum(1 for e in entries if e.is_decode)
        return cls(
            num_requests=len(entries),
            num_prefill_tokens=batch.num_batched_tokens - decodes,
            num_prefill_requests=len(entries) - decodes,
            num_decode_requests=decodes,
            num_draft_tokens=drafts,
            num_sampled=sampled,
            context_tokens=context,
            attention_positions=positions,
            num_admitted=len(batch.admitted),
            num_preempted=len(batch.preempted),
            num_finished=num_finished,
            num_forks=sum(len(e.forks) for e in entries),
            after_idle=int(after_idle),
        )

    @classmethod
    def of_event(cls, event: StepEvent) -> BatchShape:
        """The shape of the step ``event`` reports (a real engine's, to fit on).

        Where each span started comes from ``event.num_computed`` (the context after the
        step) less the span and the accepted drafts; which spans were decodes, from
        ``event.num_prefill_tokens`` (the rest of the batch's tokens are one-token decodes).
        """
        spec = {rid: (drafted, accepted) for rid, drafted, accepted in event.speculated}
        sampled_ids = {rid for rid, _ in event.sampled}
        computed = event.num_computed or (0,) * len(event.scheduled)

        def spans():
            for (rid, n), after in zip(event.scheduled, computed, strict=True):
                drafted, accepted = spec.get(rid, (0, 0))
                yield after - n - accepted, n, drafted, rid in sampled_ids or drafted > 0

        drafts, sampled, context, positions = _work(spans())
        decodes = event.num_batched_tokens - event.num_prefill_tokens
        scheduled = {rid for rid, _ in event.scheduled}
        return cls(
            num_requests=len(event.scheduled),
            num_prefill_tokens=event.num_prefill_tokens,
            num_prefill_requests=len(event.scheduled) - decodes,
            num_decode_requests=decodes,
            num_draft_tokens=drafts,
            num_sampled=sampled,
            context_tokens=context,
            attention_positions=positions,
            num_admitted=len(event.admitted),
            num_preempted=len(event.preempted),
            num_finished=len(event.finished),
            # A parallel sample that started this step got its first token with no entry
            # of its own.
            num_forks=sum(1 for rid, _ in event.sampled if rid not in scheduled),
        )


def _work(spans: Iterable[tuple[int, int, int, bool]]) -> tuple[int, int, int, int]:
    """Draft tokens, sampled positions, KV context read and attention positions of a
    step's spans, each ``(start, new tokens, drafted, samples)``: the drafts run through
    the model after the span, and a sampling span scores its last token and every draft."""
    drafts = sampled = context = positions = 0
    for start, n, drafted, samples in spans:
        if samples:
            sampled += 1 + drafted
        drafts += drafted
        n += drafted
        context += start + n
        positions += n * start + n * (n + 1) // 2
    return drafts, sampled, context, positions
