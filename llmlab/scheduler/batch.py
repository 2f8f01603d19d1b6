"""The step contract: what the scheduler hands to execution, and what execution returns.

Everything here is plain, immutable, picklable data: a :class:`ScheduledBatch` is exactly
what an executor in another process (a tensor-parallel worker, a simulator) receives. It
names requests by id and never carries the live ``Request``, so an executor cannot change
lifecycle state; the scheduler does that with the returned :class:`BatchOutput`.

Per request an entry carries its stable ``row``, the span to compute, its block table's
change and the positions to score (and, on a row's first entry, a :class:`RowSetup`); per
step, the rows released, KV transfers and block copies to apply before the forward pass.
Execution answers with a :class:`BatchOutput`: per entry, a *list* of tokens with their
log-probabilities, so several tokens per request (n > 1, beams, accepted speculative
drafts) need no contract change.

A feature plugged in through :mod:`llmlab.plugin` (LoRA, pooling, a KV press, ...) adds
no field here: its per-request data travels in the batch's ``sides[name]`` (request id ->
plain data), and what its runner side returns in the output's ``sides[name]`` (one item per
entry), as vLLM's ``SchedulerOutput`` carries each KV connector's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import attrs

from llmlab.cache.transfers import KVTransfer
from llmlab.pooling_params import PoolingParams
from llmlab.sampling.params import SamplingParams
from llmlab.scheduler.records import Admission
from llmlab.validation import FrozenDict

__all__ = ["PLACEHOLDER", "Admission", "BatchOutput", "Fork", "RowSetup", "ScheduledBatch",
           "ScheduledRequest"]

NO_SIDES: FrozenDict = FrozenDict()
# A token the batch in flight samples (overlapped scheduling): the row's last sampled one.
PLACEHOLDER = -1


@attrs.frozen
class RowSetup:
    """What an executor needs to start a row's per-row state (sent once per row).

    Attributes:
        params: the request's sampling parameters, as they were at admission; for a
            pooling request its (resolved) pooling parameters.
        prompt_token_ids: its prompt (penalties, prompt logprobs, custom processors).
        output_token_ids: tokens it generated before this row (a request resumed after
            preemption, or re-sent after a failed step); the row's state starts from them
            (penalty counts, grammar position, the seeded stream's draw index).
        eos_token_ids: the ids that end it unless ``params.ignore_eos``.
    """

    params: SamplingParams | PoolingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...] = ()
    eos_token_ids: frozenset[int] = frozenset()


@attrs.frozen
class Fork:
    """A parallel sample (n / best_of) starting at its leader's sample this step: drawn
    from the same logits with its own parameters; it then takes the leader's KV blocks by
    reference, and its own entries follow from the next step."""

    request_id: str
    row: int
    params: SamplingParams


class ScheduledRequest(NamedTuple):
    """One request's share of a step (immutable data: a named tuple, the cheapest record to
    build for every running request every step, and the smallest to pickle).

    Attributes:
        request_id: the request.
        row: stable row of the request, in ``[0, max_num_seqs)``.
        start: positions already in the KV cache (prefix hit or earlier steps); the span
            covers positions ``start .. start + len(token_ids) - 1``.
        token_ids: the tokens to compute this step (:data:`PLACEHOLDER` for one the
            previous batch, still in flight, samples).
        blocks_from, blocks: ``table[blocks_from:] = blocks`` for the row's block table
            (a row's first entry sends the whole table; later ones usually nothing, or
            one new block).
        num_scored: how many trailing positions of the span are scored (their logits go to
            the sampler): 1 when the span reaches the request's last known token, 0 for a
            prefill chunk that stops short of it.
        setup: set on the first entry of a row (admission, resumption, or re-sent after a
            failed step): the per-row state starts here.
        forks: parallel samples that start at this entry's sample.
        prompt_logprobs_from: for a request asking for prompt logprobs, the first position
            whose next prompt token still needs scoring; -1 when none is asked for.
        num_prompt_tokens: the request's prompt length (what is prefill, what decode).
        num_lookahead: the most extra tokens (speculative drafts) the executor may compute
            after ``token_ids``, budgeted and with KV blocks reserved; it returns the
            accepted ones and one of its own (0: none).
    """

    request_id: str
    row: int
    start: int
    token_ids: tuple[int, ...]
    blocks_from: int
    blocks: tuple[int, ...]
    num_scored: int
    setup: RowSetup | None = None
    forks: tuple[Fork, ...] = ()
    prompt_logprobs_from: int = -1
    num_prompt_tokens: int = 0
    num_lookahead: int = 0

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

    @property
    def new_row(self) -> bool:
        """First entry on this row: per-row state starts here (``setup`` is set)."""
        return self.setup is not None

    @property
    def is_decode(self) -> bool:
        """A one-token span past the prompt (the one place this is decided); everything
        else is prefill: prompt chunks, and recomputation after preemption."""
        return len(self.token_ids) == 1 and self.start >= self.num_prompt_tokens


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
            (copy-on-write of a shared, partly filled block), after ``kv_transfers``.
        admitted: requests admitted from the waiting queue in this step (their entries
            are among ``entries``), for observers; executors need not read it.
        kv_transfers: KV block moves between pools (:class:`KVTransfer`: swap out / in,
            spill to / load from the offload tier, and copy-on-write copies recorded
            before one of them), to apply in order before ``block_copies`` and the
            forward: a move out of a device block always precedes anything this step
            writes into it, and a move in precedes the forward that reads it. Every
            tensor-parallel rank applies them to its own shard. Empty unless swap
            preemption or the offload tier is on.
        sides: per plugged-in feature (its ``name``), its data for this step's entries:
            request id -> plain data (:mod:`llmlab.plugin`); read-only.
        columns: the entries as arrays (:class:`~llmlab.scheduler.columns.BatchColumns`),
            built by the scheduler; None: an executor builds them (``columns_of``).
    """

    entries: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...] = ()
    freed_rows: tuple[int, ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    admitted: tuple[Admission, ...] = ()
    kv_transfers: tuple[KVTransfer, ...] = ()
    sides: FrozenDict = NO_SIDES
    columns: Any = attrs.field(default=None, eq=False, repr=False)

    def side(self, name: str) -> Any:
        """The feature ``name``'s side map (request id -> data), or None."""
        return self.sides.get(name)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens scheduled (speculative lookahead not included: see ``num_lookahead``)."""
        return sum(len(e.token_ids) for e in self.entries)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and nothing to release: executors may skip the step."""
        return not (self.entries or self.freed_rows or self.block_copies or self.kv_transfers)

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
        failed: per entry, why execution failed for that request alone (its own logits
            processor raised, say), or None; None when every entry went through. The
            scheduler ends a failed request (aborted, with the reason) and the rest of
            the batch goes on.
        num_drafted: per entry, how many draft tokens were proposed and verified (at most
            its ``num_lookahead``); its tokens are then the accepted draft tokens and one
            more, so ``len(token_ids[i]) - 1`` were accepted, and their KV is computed.
            None when nothing was drafted. (An entry that drafted nothing may still return
            several tokens; their KV is computed in later steps.)
        sides: per plugged-in feature (its ``name``), what its runner side returned: one
            item per entry (None where it has nothing), checked by the feature's scheduler
            side (:meth:`~llmlab.plugin.SchedulerPlugin.check`).
    """

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]
    top_logprobs: tuple[tuple[Any, ...], ...] | None = None
    prompt_logprobs: tuple[tuple[Any, ...] | None, ...] | None = None
    prompt_logprobs_start: tuple[int, ...] | None = None
    forks: tuple[tuple[tuple[int, float, Any], ...], ...] | None = None
    failed: tuple[str | None, ...] | None = None
    num_drafted: tuple[int, ...] | None = None
    sides: FrozenDict = NO_SIDES

    @classmethod
    def from_lists(
        cls, token_ids: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]]
    ) -> BatchOutput:
        return cls(tuple(map(tuple, token_ids)), tuple(map(tuple, logprobs)))

    @classmethod
    def empty(cls, num_entries: int = 0) -> BatchOutput:
        return cls(((),) * num_entries, ((),) * num_entries)

    def check(self, batch: ScheduledBatch) -> None:
        """Raise ``ValueError`` unless this answers ``batch``: one token list per entry, one
        sample per fork, one item per entry in each side (checked before anything moves;
        each feature checks its own side's items)."""
        n = len(batch.entries)
        if len(self.token_ids) != n or len(self.logprobs) != n:
            raise ValueError(
                f"executor returned {len(self.token_ids)} token lists and "
                f"{len(self.logprobs)} logprob lists for {n} entries"
            )
        if self.failed is not None and len(self.failed) != n:
            raise ValueError(f"executor returned {len(self.failed)} failure slots for {n} entries")
        if self.num_drafted is not None and len(self.num_drafted) != n:
            raise ValueError(
                f"executor returned {len(self.num_drafted)} draft counts for {n} entries"
            )
        for name, items in self.sides.items():
            if len(items) != n:
                raise ValueError(f"executor returned {len(items)} {name!r} items for {n} entries")
        for i, entry in enumerate(batch.entries):
            if self.failed is not None and self.failed[i] is not None:
                continue  # a failed entry carries no tokens
            drafted = 0 if self.num_drafted is None else self.num_drafted[i]
            if not 0 <= drafted <= entry.num_lookahead or (
                drafted and len(self.token_ids[i]) > 1 + drafted
            ):
                raise ValueError(
                    f"entry {entry.request_id!r} may verify {entry.num_lookahead} draft "
                    f"tokens, but the executor reports {drafted} drafted and returned "
                    f"{len(self.token_ids[i])} tokens (at most one more than drafted)"
                )
            if entry.forks and (self.forks is None or len(self.forks[i]) != len(entry.forks)):
                got = None if self.forks is None else len(self.forks[i])
                raise ValueError(
                    f"entry {entry.request_id!r} forks into {len(entry.forks)} parallel "
                    f"samples but the executor returned {got} samples for them"
                )

    def side(self, name: str) -> tuple[Any, ...] | None:
        """What the feature ``name``'s runner side returned, one item per entry, or None."""
        return self.sides.get(name)

    def with_side(self, name: str, items: Sequence[Any]) -> BatchOutput:
        """This output with the feature ``name``'s items (one per entry) added."""
        return attrs.evolve(self, sides=FrozenDict({**self.sides, name: tuple(items)}))
