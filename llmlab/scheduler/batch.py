"""The step contract: what the scheduler hands to execution, and what execution returns.

A :class:`ScheduledBatch` carries everything an executor needs to run one step, so no
executor ever reads the scheduler's or the KV cache manager's state:

* per request: a stable ``row`` (assigned at admission, held until the request finishes,
  is preempted or aborted), the span of tokens to compute and where it starts, the full
  block table, and how many trailing positions of the span to score;
* for the whole step: rows released since the previous batch (their per-row state in an
  executor or backend is dead), and KV block copies (copy-on-write) to apply before the
  forward pass.

Execution answers with a :class:`BatchOutput`: per entry, a *list* of tokens with their
log-probabilities (empty for a prefill chunk that scores nothing), so sampling several
tokens per request (n > 1, beams, accepted speculative drafts) needs no contract change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from llmlab.request import Request


@attrs.frozen
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request: the request, for sampling state only (parameters, output tokens so far,
            its seeded generator); executors never change its lifecycle fields.
        row: stable row of the request, in ``[0, max_num_seqs)``.
        start: positions already in the KV cache (prefix hit or earlier steps); the span
            covers positions ``start .. start + len(token_ids) - 1``.
        token_ids: the tokens to compute this step.
        block_table: KV block ids of the request, in position order (covers the span).
        num_scored: how many trailing positions of the span are scored (their logits go to
            the sampler): 1 when the span reaches the request's last known token, 0 for a
            prefill chunk that stops short of it.
        new_row: first step on this row since it was assigned (per-row state starts here).
        forks: parallel samples (n / best_of) that start at this entry's sample: each is
            drawn from the same logits, independently, with its own parameters and
            generator; the scheduler then gives each the request's KV blocks by reference.
    """

    request: Request
    row: int
    start: int
    token_ids: tuple[int, ...]
    block_table: tuple[int, ...]
    num_scored: int
    new_row: bool = False
    forks: tuple[Request, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        """Alias of ``start`` (vLLM's name for the same count)."""
        return self.start

    @property
    def samples(self) -> bool:
        return self.num_scored > 0


@attrs.frozen
class Admission:
    """A request admitted to running in a step (first time, or resumed after preemption).

    Attributes:
        request_id: the request.
        arrival_time: when it was added (the engine clock), for queueing-time metrics.
        num_prompt_tokens: its prompt length.
        num_queried_tokens: tokens looked up in the prefix cache at admission (0 when no
            lookup ran: prefix caching off, or prompt logprobs asked for).
        num_cached_tokens: how many of them were found there (not computed again).
        resumed: whether it was preempted before (its KV is being recomputed).
    """

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_queried_tokens: int
    num_cached_tokens: int
    resumed: bool = False


@attrs.frozen
class ScheduledBatch:
    """Everything one step executes, in batch order.

    Attributes:
        entries: the scheduled requests.
        preempted: ids of requests preempted while building this batch.
        freed_rows: rows released since the previous batch (finished, preempted, aborted);
            an executor drops their per-row state *before* setting up ``entries``, which
            may reuse them.
        block_copies: ``(src_block, dst_block)`` KV copies to apply before the forward
            (copy-on-write of a shared, partly filled block).
        admitted: requests admitted from the waiting queue in this step (their entries
            are among ``entries``), for observers; executors need not read it.
    """

    entries: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    freed_rows: tuple[int, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    admitted: tuple[Admission, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to release: executors may skip the step."""
        return not (self.entries or self.freed_rows or self.block_copies)

    def __len__(self) -> int:
        return len(self.entries)


@attrs.frozen
class BatchOutput:
    """What execution produced: per entry of the batch (same order), the new tokens.

    Attributes:
        token_ids: tokens to append to each request, in order (empty when it scored
            nothing). The scheduler appends them one by one and stops at the first that
            ends the request.
        logprobs: the log-probability of each of those tokens.
        top_logprobs: per entry, per token, the chosen and top-k logprobs
            (:class:`~llmlab.sampling.logprobs.TokenLogprobs`) for requests that asked for
            ``logprobs``, else None; the whole field is None when no entry asked.
        prompt_logprobs: per entry, the logprobs of the prompt tokens this step computed
            (position ``p`` scores prompt token ``p + 1``), or None; None when none asked.
        prompt_logprobs_start: per entry, the prompt position whose token the first of
            ``prompt_logprobs`` scores.
        forks: per entry, one ``(token_id, logprob, TokenLogprobs | None)`` per request in
            the entry's ``forks``; None when no entry forks.
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    top_logprobs: tuple[tuple[Any, ...], ...] | None = None
    prompt_logprobs: tuple[tuple[Any, ...] | None, ...] | None = None
    prompt_logprobs_start: tuple[int, ...] | None = None
    forks: tuple[tuple[tuple[int, float, Any], ...], ...] | None = None

    @classmethod
    def from_lists(
        cls, token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]
    ) -> BatchOutput:
        return cls(tuple(map(tuple, token_ids)), tuple(map(tuple, logprobs)))

    @classmethod
    def empty(cls, num_entries: int = 0) -> BatchOutput:
        return cls(((),) * num_entries, ((),) * num_entries)
