"""The scheduler: continuous batching, chunked prefill, and preemption by recompute.

Each step spends a budget of ``max_num_batched_tokens`` new tokens across at most
``max_num_seqs`` running requests. Running requests go first, in the policy's
``running_order`` (admission order by default): a decode takes one token, an unfinished
prefill takes as much of its prompt as the budget allows (chunked prefill, so long prompts
share steps with decodes). Whatever budget is left admits waiting requests in the order the
policy pops them, each starting after its longest cached prefix.

When the KV cache cannot hold a running request's next tokens, the policy picks a victim
among the running requests not yet scheduled this step; the victim's blocks are freed and
it rejoins the waiting queue to be recomputed later (its generated tokens are kept). A
policy with ``preempt_for`` may also preempt running requests to admit a waiting one.

Lifecycles are explicit: admission assigns a request the lowest free *row* in
``[0, max_num_seqs)``; finishing, preemption and abort release it, and the next batch lists
the released rows, so executors and attention backends key per-request state on rows and
are told when it dies. The policy is told too: ``push`` when a request starts waiting,
``remove`` when one leaves for good, ``on_step`` with what each was served.

User components may raise. A failing policy or eviction policy never leaves the queues or
the KV pool inconsistent: the scheduler finishes what it was doing in a consistent state,
records a :class:`~llmlab.errors.ComponentError`, and the engine raises it after the step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

import attrs

from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.errors import ComponentError, RequestFailedError
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.batch import Admission, BatchOutput, ScheduledBatch, ScheduledRequest
from llmlab.scheduler.policies import FCFS
from llmlab.scheduler.policy import (
    OrderPolicy,
    SchedulerView,
    SchedulingPolicy,
    Served,
    as_policy,
    request_of,
    views,
)

# What ``_call`` returns when the policy raised (None may be a legitimate answer).
_FAILED = object()


@attrs.define
class Scheduler:
    """Continuous-batching scheduler (mechanism); decisions go to ``policy``.

    Attributes:
        policy: the scheduling policy as given (a v1 ``order``/``victim`` policy is driven
            through :class:`~llmlab.scheduler.policy.OrderPolicy`).
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
    running: list[Request] = attrs.field(factory=list)
    # Requests waiting (queued in the policy, or popped during this step's admission).
    _waiting: dict[str, Request] = attrs.field(init=False, factory=dict)
    # Waiting requests whose ``push`` raised: pushed again at the next step, never lost.
    _unqueued: list[Request] = attrs.field(init=False, factory=list)
    _driver: Any = attrs.field(init=False)
    _free_rows: list[int] = attrs.field(init=False)  # a heap: lowest row first
    _released_rows: list[int] = attrs.field(init=False, factory=list)
    # Rows held for the parallel samples a running request will fork into (by request id).
    _reserved_rows: dict[str, list[int]] = attrs.field(init=False, factory=dict)
    # Requests forked into running whose first entry is still to come (new_row=True then).
    _unstarted: set[int] = attrs.field(init=False, factory=set)
    _errors: list[Exception] = attrs.field(init=False, factory=list)
    _admitted: list[Admission] = attrs.field(init=False, factory=list)  # this step's
    _next_seq: int = attrs.field(init=False, default=0)
    _now: float = attrs.field(init=False, default=0.0)  # the last step's schedule time

    def __attrs_post_init__(self) -> None:
        self._free_rows = list(range(self.max_num_seqs))
        self._driver = as_policy(self.policy)
        attach = self._optional("attach")
        if attach is not None:
            view = SchedulerView(
                self.kv, self.max_num_seqs, self.max_num_batched_tokens,
                lambda: len(self._waiting), lambda: views(self.running),
            )
            attach(view)  # at build time: a failure here is the builder's error

    # -- queues ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request (the engine validated it)."""
        request.status = RequestStatus.WAITING
        request.seq = self._next_seq
        self._next_seq += 1
        self._waiting[request.request_id] = request
        self._push(request, request.arrival_time)

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests in arrival order (a copy, O(n log n): for views and tests)."""
        return sorted(self._waiting.values(), key=lambda r: (r.arrival_time, r.seq))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self._waiting) + len(self.running)

    def take_errors(self) -> list[Exception]:
        """Errors recorded since the last call (component failures, requests failed)."""
        errors, self._errors = self._errors, []
        return errors

    # -- one step ----------------------------------------------------------------------

    def schedule(self, now: float) -> ScheduledBatch:
        self._now = now
        if self._unqueued:
            stranded, self._unqueued = self._unqueued, []
            for request in stranded:
                self._push(request, now)
        budget = self.max_num_batched_tokens
        entries: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._admitted = []

        unscheduled = self._running_order(now)
        while unscheduled is not None and unscheduled and budget > 0:
            request = unscheduled.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            scheduled = self._grow(request, num_new, unscheduled, preempted, now)
            if scheduled is None:  # a component failed: stop scheduling this step
                break
            if scheduled:
                entries.append(self._entry(request, num_new, new_row=False))
                budget -= num_new

        # A step that had to preempt is short of memory: admitting more would only thrash.
        if not preempted and not self._errors:
            self._admit(entries, budget, preempted, now)
        freed, self._released_rows = tuple(self._released_rows), []
        return ScheduledBatch(
            entries=tuple(entries),
            preempted=tuple(preempted),
            freed_rows=freed,
            block_copies=tuple(self.kv.take_block_copies()),
            admitted=tuple(a for a in self._admitted if a.request_id not in preempted),
        )

    def _running_order(self, now: float) -> list[Request] | None:
        """Running requests in the order they get budget; None if the policy failed."""
        order = self._optional("running_order")
        if order is None or not self.running:
            return list(self.running)
        answer = self._call("running_order", views(self.running), now)
        if answer is _FAILED:
            return None
        ordered = [request_of(v) for v in answer]
        if len(ordered) != len(self.running) or {id(r) for r in ordered} != {
            id(r) for r in self.running
        }:
            self._bad_answer("running_order", answer, "a reordering of the running requests")
            return None
        return ordered

    def _grow(
        self,
        request: Request,
        num_new: int,
        unscheduled: list[Request],
        preempted: list[str],
        now: float,
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
            answer = self._call("victim", views(candidates))
            if answer is _FAILED:
                return None
            victim = request_of(answer)
            if not any(victim is c for c in candidates):
                self._bad_answer("victim", answer, "one of the candidates")
                return None
            if victim is request and len(self.running) == 1:
                # Alone in the engine and still out of room: it can never run.
                self._fail(request, self._too_big(request, request.num_computed_tokens + num_new))
                return False
            self._preempt(victim, now)
            preempted.append(victim.request_id)
            if victim is request:
                return False
            unscheduled.remove(victim)

    def _admit(
        self, entries: list[ScheduledRequest], budget: int, preempted: list[str], now: float
    ) -> None:
        admit = self._optional("admit")
        preempt_for = self._optional("preempt_for")
        handed_back: list[Request] = []  # popped, not admitted: pushed back at the end
        admitted_now: set[int] = set()
        while budget > 0 and self._waiting:
            if not self._free_rows and preempt_for is None:
                break
            answer = self._call("pop", now)
            if answer is _FAILED:
                break
            if answer is None:
                lost = len(self._waiting) > len(self._unqueued) and not isinstance(
                    self._driver, OrderPolicy  # a v1 ``order`` may hold requests back
                )
                if lost and not handed_back and not admitted_now:
                    # Every waiting request was pushed and none popped yet: the policy lost
                    # some, and they would wait forever.
                    self._bad_answer(
                        "pop", None, f"a request while {len(self._waiting)} are waiting"
                    )
                break
            request = request_of(answer)
            if request is None or self._waiting.get(request.request_id) is not request:
                if request is None:
                    self._bad_answer("pop", answer, "a waiting request or None")
                    break
                continue  # a request that left (e.g. aborted) while still in its queue
            if request.request_id in preempted:
                handed_back.append(request)  # not back in the step that preempted it
                break
            if admit is not None:
                verdict = self._call("admit", request.view, budget)
                if verdict is _FAILED:
                    handed_back.append(request)
                    break
                if not verdict:
                    handed_back.append(request)
                    continue
            placed, budget = self._place(
                request, entries, budget, preempted, admitted_now, preempt_for, now
            )
            if placed is None:  # does not fit now (or a component failed)
                handed_back.append(request)
                break
            if placed:
                admitted_now.add(id(request))
        for request in handed_back:
            self._push(request, now)

    def _place(
        self,
        request: Request,
        entries: list[ScheduledRequest],
        budget: int,
        preempted: list[str],
        admitted_now: set[int],
        preempt_for,
        now: float,
    ) -> tuple[bool | None, int]:
        """Admit one popped request: ``(placed, budget left)``; ``placed`` is True when it
        was admitted, False when it failed for good, None when it is to be handed back.

        Preempting for it gives back the budget of the victims' entries in this step.
        """
        rows_needed = 1 + len(request.forks)
        while True:
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            prefix = [] if request.needs_prompt_logprobs else self.kv.lookup_prefix(request)
            num_cached = len(prefix) * self.kv.block_size
            remaining = request.num_tokens - num_cached
            if not self.chunked_prefill and remaining > budget:
                return None, budget
            num_new = min(remaining, budget)
            allocated = False
            if len(self._free_rows) >= rows_needed:
                try:
                    allocated = self.kv.allocate(request, num_new, prefix)
                except ComponentError as err:
                    self._errors.append(err)
                    return None, budget
            if allocated:
                break
            if len(self._free_rows) >= rows_needed and not self.running and not entries:
                # Nothing holds blocks, so the whole pool was on offer: it never fits.
                self._fail(request, self._too_big(request, num_cached + num_new))
                return False, budget
            # Out of blocks or rows: the policy may preempt a running request for it.
            candidates = [r for r in self.running if id(r) not in admitted_now]
            if preempt_for is None or not candidates:
                return None, budget
            answer = self._call("preempt_for", request.view, views(candidates))
            if answer is _FAILED or answer is None:
                return None, budget
            victim = request_of(answer)
            if not any(victim is c for c in candidates):
                self._bad_answer("preempt_for", answer, "one of the running candidates or None")
                return None, budget
            for i, entry in enumerate(entries):
                if entry.request is victim:
                    del entries[i]
                    budget += entry.num_new_tokens
                    break
            self._preempt(victim, now)
            preempted.append(victim.request_id)
        request.num_computed_tokens = num_cached
        queried = 0 if request.needs_prompt_logprobs or not self.kv.enable_prefix_caching else (
            request.num_tokens
        )
        self._admitted.append(
            Admission(
                request.request_id, request.arrival_time, request.num_prompt_tokens,
                queried, num_cached, resumed=request.num_preemptions > 0,
            )
        )
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        request.row = heapq.heappop(self._free_rows)
        if request.forks:  # rows for its parallel samples, taken when they fork
            self._reserved_rows[request.request_id] = [
                heapq.heappop(self._free_rows) for _ in request.forks
            ]
        del self._waiting[request.request_id]
        self.running.append(request)
        entries.append(self._entry(request, num_new, new_row=True))
        return True, budget - num_new

    def _entry(self, request: Request, num_new: int, *, new_row: bool) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new
        scored = end == request.num_tokens
        if self._unstarted and id(request) in self._unstarted:
            self._unstarted.discard(id(request))
            new_row = True
        return ScheduledRequest(
            request=request,
            row=request.row,
            start=start,
            token_ids=tuple(request.all_token_ids[start:end]),
            block_table=self.kv.block_table(request.request_id),
            num_scored=1 if scored else 0,
            new_row=new_row,
            forks=tuple(request.forks) if scored else (),
        )

    def update(self, batch: ScheduledBatch, output: BatchOutput) -> list[Request]:
        """Advance the batch's requests; append their new tokens; return those that finished.

        Tokens of an entry are appended in order until one ends the request; the rest are
        dropped (so a verifier or a multi-token step can overshoot safely). Then the policy
        hears what each request was served (``on_step``) and which finished (``remove``).
        """
        _check_output(batch, output)
        on_step = self._optional("on_step")
        served: list[Served] = []
        finished = []
        for i, (entry, token_ids, logprobs) in enumerate(
            zip(batch.entries, output.token_ids, output.logprobs)
        ):
            request = entry.request
            if request.is_finished:  # aborted while the step ran
                continue
            end = entry.start + len(entry.token_ids)
            request.num_computed_tokens = end
            prompt_end = min(end, request.num_prompt_tokens)
            new_prompt = max(0, prompt_end - max(entry.start, request.num_prompt_computed))
            request.num_prompt_computed = max(request.num_prompt_computed, prompt_end)
            self.kv.cache_computed_blocks(request)
            if output.prompt_logprobs is not None and output.prompt_logprobs[i]:
                request.add_prompt_logprobs(
                    output.prompt_logprobs_start[i], output.prompt_logprobs[i]
                )
            if entry.forks and request.forks:
                # Before the request's own token: a request that finishes now frees its
                # blocks, and the forks take them by reference first.
                for member in self._fan_out(request, output.forks[i]):
                    if on_step is not None:
                        served.append(Served(member.view, 0, 0, 1))
                    if member.is_finished:
                        finished.append(member)
            tops = output.top_logprobs[i] if output.top_logprobs is not None else None
            num_generated = 0
            for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
                request.append_output(token_id, logprob, tops[j] if tops else None)
                num_generated += 1
                status = self._stop_status(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    break
            if on_step is not None:
                served.append(Served(request.view, len(entry.token_ids), new_prompt, num_generated))
        if on_step is not None and served:
            self._call("on_step", tuple(served), self._now)
        for request in finished:
            self._forget(request)
        return finished

    def _fan_out(self, leader: Request, samples) -> list[Request]:
        """Start the leader's parallel samples: each takes the leader's KV blocks by
        reference (the partly filled last block is copied when first written), a reserved
        row, and its own first token."""
        members, leader.forks = leader.forks, []
        rows = self._reserved_rows.pop(leader.request_id)
        for member, row, (token_id, logprob, top) in zip(members, rows, samples, strict=True):
            self.kv.fork(leader, member)
            member.num_computed_tokens = leader.num_computed_tokens
            member.num_prompt_computed = leader.num_prompt_computed
            member.num_cached_tokens = leader.num_cached_tokens
            member.status = RequestStatus.RUNNING
            member.row = row
            member.seq = self._next_seq
            self._next_seq += 1
            self.running.append(member)
            self._unstarted.add(id(member))
            member.append_output(token_id, logprob, top)
            status = self._stop_status(member, token_id)
            if status is not None:
                self._finish(member, status)  # the caller reports it and tells the policy
        return members

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a running request for a reason decided above the scheduler (a stop string
        matched in its text): frees its blocks and row, and tells the policy."""
        if request.is_finished or request not in self.running:
            return
        self._finish(request, status)
        self._forget(request)

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
        # Rows held for forks that never happened were never used by any executor.
        for row in self._reserved_rows.pop(request.request_id, ()):
            heapq.heappush(self._free_rows, row)
        self._unstarted.discard(id(request))

    def _free_blocks(self, request: Request) -> None:
        try:
            self.kv.free(request)
        except ComponentError as err:  # the pool is consistent; report after the step
            self._errors.append(err)

    def _preempt(self, request: Request, now: float) -> None:
        self.running.remove(request)
        self._release_row(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._free_blocks(request)
        self._waiting[request.request_id] = request
        self._push(request, now)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.running.remove(request)
        self._release_row(request)
        request.status = status
        self._free_blocks(request)

    def _fail(self, request: Request, reason: str) -> None:
        """End a request that can never be scheduled (aborted, with ``error`` set)."""
        if request in self.running:
            self.running.remove(request)
        self._waiting.pop(request.request_id, None)
        self._release_row(request)
        request.status = RequestStatus.FINISHED_ABORTED
        request.error = reason
        self._free_blocks(request)
        self._errors.append(RequestFailedError(request.request_id, reason))
        self._forget(request)

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
        aborted = [self._waiting.pop(i) for i in ids if i in self._waiting]
        hits = [r for r in self.running if r.request_id in ids]
        if hits:
            gone = {id(r) for r in hits}
            self.running = [r for r in self.running if id(r) not in gone]
            aborted.extend(hits)
        for request in aborted:
            self._release_row(request)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_blocks(request)
            if request in self._unqueued:
                self._unqueued.remove(request)
            self._forget(request)
        return aborted

    # -- user policy calls -------------------------------------------------------------

    def _push(self, request: Request, now: float) -> None:
        """Queue a waiting request in the policy; if that fails, keep it for the next step."""
        if self._call("push", request.view, now) is _FAILED:
            self._unqueued.append(request)

    def _forget(self, request: Request) -> None:
        """Tell the policy a request is gone for good (its queue entry, if any, too)."""
        self._call("remove", request.view)

    def _optional(self, method: str):
        """The policy's optional ``method`` (looked up on the policy as given, too)."""
        found = getattr(self._driver, method, None)
        if found is None and self._driver is not self.policy:
            found = getattr(self.policy, method, None)
        return found if callable(found) else None

    def _call(self, method: str, *args):
        """``policy.method(*args)``, or ``_FAILED`` (with the error recorded) if it raises."""
        try:
            return self._optional(method)(*args)
        except Exception as err:  # noqa: BLE001 - user code; reported after the step
            self._errors.append(ComponentError.wrap("scheduling policy", self.policy, method, err))
            return _FAILED

    def _bad_answer(self, method: str, answer: object, allowed: str) -> None:
        self._errors.append(
            ComponentError(
                "scheduling policy", self.policy, method,
                f"returned {answer!r}, which is not {allowed}",
            )
        )


def _check_output(batch: ScheduledBatch, output: BatchOutput) -> None:
    """An executor's answer must cover the batch, forks included, before anything moves."""
    n = len(batch.entries)
    if len(output.token_ids) != n or len(output.logprobs) != n:
        raise ValueError(
            f"executor returned {len(output.token_ids)} token lists and "
            f"{len(output.logprobs)} logprob lists for {n} entries"
        )
    for i, entry in enumerate(batch.entries):
        if entry.forks and (
            output.forks is None or len(output.forks[i]) != len(entry.forks)
        ):
            got = None if output.forks is None else len(output.forks[i])
            raise ValueError(
                f"entry {entry.request_id!r} forks into {len(entry.forks)} parallel samples "
                f"but the executor returned {got} samples for them"
            )
