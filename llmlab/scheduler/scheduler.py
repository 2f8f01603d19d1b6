"""The scheduler: continuous batching, chunked prefill, and preemption by recompute.

Each step spends a budget of ``max_num_batched_tokens`` new tokens across at most
``max_num_seqs`` running requests. Running requests go first, in admission order: a decode
takes one token, an unfinished prefill takes as much of its prompt as the budget allows
(chunked prefill, so long prompts share steps with decodes). Whatever budget is left admits
waiting requests in the policy's order, each starting after its longest cached prefix.

When the KV cache cannot hold a running request's next tokens, the policy picks a victim
among the running requests not yet scheduled this step; the victim's blocks are freed and
it rejoins the waiting queue to be recomputed later (its generated tokens are kept).

Lifecycles are explicit: admission assigns a request the lowest free *row* in
``[0, max_num_seqs)``; finishing, preemption and abort release it, and the next batch lists
the released rows, so executors and attention backends key per-request state on rows and
are told when it dies.

User components may raise. A failing policy or eviction policy never leaves the queues or
the KV pool inconsistent: the scheduler finishes what it was doing in a consistent state,
records a :class:`~llmlab.errors.ComponentError`, and the engine raises it after the step.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable

import attrs

from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.errors import ComponentError, RequestFailedError
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch, ScheduledRequest
from llmlab.scheduler.policy import FCFS, SchedulingPolicy

# What ``_call_policy`` returns when the policy raised (None may be a legitimate answer).
_FAILED = object()


def _arrival(request: Request) -> float:
    return request.arrival_time


@attrs.define
class Scheduler:
    """Continuous-batching scheduler (mechanism); decisions go to ``policy``.

    Attributes:
        waiting: requests not running, in arrival order (ties: order of queueing).
        running: admitted requests, in admission order.
        chunked_prefill: split prompts across steps; when False a prompt is admitted only
            when its whole remaining prefill fits the step's budget.
    """

    kv: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy = attrs.field(factory=FCFS)
    chunked_prefill: bool = True
    waiting: list[Request] = attrs.field(factory=list)
    running: list[Request] = attrs.field(factory=list)
    _free_rows: list[int] = attrs.field(init=False)  # a heap: lowest row first
    _released_rows: list[int] = attrs.field(init=False, factory=list)
    _errors: list[Exception] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._free_rows = list(range(self.max_num_seqs))

    # -- queues ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort_right(self.waiting, request, key=_arrival)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def take_errors(self) -> list[Exception]:
        """Errors recorded since the last call (component failures, requests failed)."""
        errors, self._errors = self._errors, []
        return errors

    # -- one step ----------------------------------------------------------------------

    def schedule(self, now: float) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        entries: list[ScheduledRequest] = []
        preempted: list[str] = []

        unscheduled = list(self.running)
        while unscheduled and budget > 0:
            request = unscheduled.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            scheduled = self._grow(request, num_new, unscheduled, preempted)
            if scheduled is None:  # a component failed: stop scheduling this step
                break
            if scheduled:
                entries.append(self._entry(request, num_new, new_row=False))
                budget -= num_new

        # A step that had to preempt is short of memory: admitting more would only thrash.
        if not preempted and not self._errors:
            self._admit(entries, budget, now)
        freed, self._released_rows = tuple(self._released_rows), []
        return ScheduledBatch(
            entries=tuple(entries),
            preempted=tuple(preempted),
            freed_rows=freed,
            block_copies=tuple(self.kv.take_block_copies()),
        )

    def _grow(
        self, request: Request, num_new: int, unscheduled: list[Request], preempted: list[str]
    ) -> bool | None:
        """Reserve KV for a running request's next tokens, preempting as the policy says.

        True: reserved. False: the request itself was preempted. None: a component failed.
        """
        while True:
            try:
                if self.kv.allocate(request, num_new):
                    return True
            except ComponentError as err:
                self._errors.append(err)
                return None
            candidates = [request, *unscheduled]
            victim = self._call_policy("victim", candidates)
            if victim is _FAILED:
                return None
            if not any(victim is c for c in candidates):
                self._errors.append(
                    ComponentError(
                        "scheduling policy", self.policy, "victim",
                        f"returned {victim!r}, which is not one of the candidates",
                    )
                )
                return None
            if victim is request and len(self.running) == 1:
                # Alone in the engine and still out of room: it can never run.
                self._fail(request, self._too_big(request, request.num_computed_tokens + num_new))
                return False
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
            unscheduled.remove(victim)

    def _admit(self, entries: list[ScheduledRequest], budget: int, now: float) -> None:
        ordered = self._call_policy("order", self.waiting, now)
        if ordered is _FAILED:
            return
        admit = getattr(self.policy, "admit", None)  # optional third decision
        admitted: list[Request] = []
        for request in ordered:
            if budget <= 0 or not self._free_rows:
                break
            if admit is not None:
                verdict = self._call_policy("admit", request, budget)
                if verdict is _FAILED:
                    break
                if not verdict:
                    continue
            prefix = self.kv.lookup_prefix(request)
            num_cached = len(prefix) * self.kv.block_size
            remaining = request.num_tokens - num_cached
            if not self.chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            try:
                allocated = self.kv.allocate(request, num_new, prefix)
            except ComponentError as err:
                self._errors.append(err)
                break
            if not allocated:
                if not self.running and not entries:
                    # Nothing holds blocks, so the whole pool was on offer: it never fits.
                    self._fail(request, self._too_big(request, num_cached + num_new))
                    continue
                break
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.row = heapq.heappop(self._free_rows)
            self.running.append(request)
            admitted.append(request)
            entries.append(self._entry(request, num_new, new_row=True))
            budget -= num_new
        self._remove_waiting(admitted)

    def _entry(self, request: Request, num_new: int, *, new_row: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        return ScheduledRequest(
            request=request,
            row=request.row,
            start=start,
            token_ids=tuple(request.all_token_ids[start:end]),
            block_table=tuple(self.kv.block_ids(request.request_id)),
            num_scored=1 if end == request.num_tokens else 0,
            new_row=new_row,
        )

    def _remove_waiting(self, admitted: list[Request]) -> None:
        if not admitted:
            return
        k = len(admitted)
        if all(a is w for a, w in zip(admitted, self.waiting[:k])):
            del self.waiting[:k]  # the usual case (FCFS): admitted from the head
        else:
            gone = {id(r) for r in admitted}
            self.waiting = [r for r in self.waiting if id(r) not in gone]

    def update(self, batch: ScheduledBatch, output: BatchOutput) -> list[Request]:
        """Advance the batch's requests; append their new tokens; return those that finished.

        Tokens of an entry are appended in order until one ends the request; the rest are
        dropped (so a verifier or a multi-token step can overshoot safely).
        """
        if len(output.token_ids) != len(batch.entries) or len(output.logprobs) != len(
            batch.entries
        ):
            raise ValueError(
                f"executor returned {len(output.token_ids)} token lists and "
                f"{len(output.logprobs)} logprob lists for {len(batch.entries)} entries"
            )
        finished = []
        for entry, token_ids, logprobs in zip(batch.entries, output.token_ids, output.logprobs):
            request = entry.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens = entry.start + len(entry.token_ids)
            self.kv.cache_computed_blocks(request)
            for token_id, logprob in zip(token_ids, logprobs, strict=True):
                request.append_output(token_id, logprob)
                status = self._stop_status(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    break
        return finished

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- lifecycle transitions ---------------------------------------------------------

    def _release_row(self, request: Request) -> None:
        if request.row is not None:
            heapq.heappush(self._free_rows, request.row)
            self._released_rows.append(request.row)
            request.row = None

    def _free_blocks(self, request: Request) -> None:
        try:
            self.kv.free(request)
        except ComponentError as err:  # the pool is consistent; report after the step
            self._errors.append(err)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_row(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        bisect.insort_right(self.waiting, request, key=_arrival)
        self._free_blocks(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.running.remove(request)
        self._release_row(request)
        request.status = status
        self._free_blocks(request)

    def _fail(self, request: Request, reason: str) -> None:
        """End a request that can never be scheduled (aborted, with ``error`` set)."""
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting = [r for r in self.waiting if r is not request]
        self._release_row(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.error = reason
        self._free_blocks(request)
        self._errors.append(RequestFailedError(request.request_id, reason))

    def _too_big(self, request: Request, num_tokens: int) -> str:
        needed = self.kv.blocks_needed(num_tokens)
        return (
            f"request {request.request_id!r} can never be scheduled: {num_tokens} tokens need "
            f"{needed} KV blocks of {self.kv.block_size} tokens, but the cache has "
            f"{self.kv.num_blocks} blocks; it was aborted"
        )

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        """Remove the given requests wherever they are; frees their blocks and rows."""
        ids = set(request_ids)
        aborted = []
        for queue in (self.waiting, self.running):
            hits = [r for r in queue if r.request_id in ids]
            if not hits:
                continue
            gone = {id(r) for r in hits}
            queue[:] = [r for r in queue if id(r) not in gone]
            for request in hits:
                self._release_row(request)
                request.status = RequestStatus.FINISHED_ABORTED
                self._free_blocks(request)
                aborted.append(request)
        return aborted

    # -- user policy calls -------------------------------------------------------------

    def _call_policy(self, method: str, *args):
        """``policy.method(*args)``, or ``_FAILED`` (with the error recorded) if it raises."""
        try:
            return getattr(self.policy, method)(*args)
        except Exception as err:  # noqa: BLE001 - user code; reported after the step
            self._errors.append(ComponentError.wrap("scheduling policy", self.policy, method, err))
            return _FAILED
