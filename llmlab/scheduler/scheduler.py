"""The scheduler: continuous batching, chunked prefill, preemption; the only writer of a
request's lifecycle.

Each step spends a budget of ``max_num_batched_tokens`` new tokens across at most
``max_num_seqs`` running requests: running ones first (:mod:`.running`: a decode takes one
token, an unfinished prefill as much of its prompt as the budget allows; when KV blocks
run out, the policy's victim is preempted), then waiting ones (:mod:`.admission`), each
after its longest cached prefix. Admission assigns a request the lowest free *row*;
finishing, preemption and abort release it, and the next batch lists released rows, so
executors key per-request state on rows and are told when it dies. Outputs are committed
by :mod:`.lifecycle`. A failing user component never leaves the queues or the KV pool
inconsistent: it is recorded as a :class:`~llmlab.errors.ComponentError`, raised by the
engine after the step.
"""

from __future__ import annotations

from typing import Any

import attrs

from llmlab import registry
from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.errors import ComponentError
from llmlab.plugin import SchedulerPlugin, StepPlan
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.admission import Admitting
from llmlab.scheduler.batch import PLACEHOLDER, Admission, Fork, RowSetup, ScheduledBatch
from llmlab.scheduler.batch import ScheduledRequest
from llmlab.scheduler.columns import BatchColumns
from llmlab.scheduler.guard import Guarded
from llmlab.scheduler.lifecycle import Lifecycle
from llmlab.scheduler.policies import FCFS
from llmlab.scheduler.policy import FAILED, SchedulerView, SchedulingPolicy, as_policy, views
from llmlab.scheduler.rows import Rows
from llmlab.scheduler.running import Running
from llmlab.validation import FrozenDict

@attrs.define
class Scheduler(Running, Admitting, Lifecycle):
    """Continuous-batching scheduler (mechanism); decisions go to ``policy``.

    Attributes:
        policy: the scheduling policy as given (a v1 ``order``/``victim`` policy is driven
            through :class:`~llmlab.scheduler.policy.OrderPolicy`).
        running: admitted requests, in admission order.
        chunked_prefill: split prompts across steps; when False a prompt is admitted only
            when its whole remaining prefill fits the step's budget.
        preemption_mode: ``"recompute"`` (a victim's blocks are freed and its tokens
            recomputed on resumption) or ``"swap"`` (its computed blocks are copied to the
            KV cache manager's swap space and back on resumption; recompute when that is
            full, or when a plugin says so). A policy's optional
            ``preemption_mode(victim)`` may choose per victim.
        plugins: the features plugged in (:class:`~llmlab.plugin.SchedulerPlugin`: LoRA's
            adapter limit, pooling, a KV press, speculation's lookahead, ...), bound here,
            called in order. A decode given a lookahead ``k`` is budgeted ``1 + k`` tokens
            and their KV blocks (never preempting for them); after verification the
            accepted tokens' KV is kept and the blocks past them go back.
    """

    kv: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy = attrs.field(factory=FCFS)
    chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    plugins: tuple[SchedulerPlugin, ...] = ()
    running: list[Request] = attrs.field(factory=list)
    # Requests waiting (queued in the policy, or popped during this step's admission).
    _waiting: dict[str, Request] = attrs.field(init=False, factory=dict)
    # Waiting requests whose ``push`` raised: pushed again at the next step, never lost.
    _unqueued: list[Request] = attrs.field(init=False, factory=list)
    _driver: Any = attrs.field(init=False)
    _rows: Rows = attrs.field(init=False)
    # Running requests whose next entry re-sends their row's setup (after a failed step).
    _resend: set[str] = attrs.field(init=False, factory=set)
    # The requests of the batch being built, by id; then of each batch not yet committed,
    # by ``id(batch)`` (``update`` applies the output to them).
    _scheduled: dict[str, Request] = attrs.field(init=False, factory=dict)
    _batches: dict[int, dict[str, Request]] = attrs.field(init=False, factory=dict)
    _errors: list[Exception] = attrs.field(init=False, factory=list)
    _admitted: list[Admission] = attrs.field(init=False, factory=list)  # this step's
    _next_seq: int = attrs.field(init=False, default=0)
    _now: float = attrs.field(init=False, default=0.0)  # the last step's schedule time
    _lookahead_plugins: list[SchedulerPlugin] = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._rows = Rows(self.max_num_seqs)
        self._driver = as_policy(self.policy)
        # One hook binds every component to its engine: bind(view); attach is its old name.
        bind = registry.bind_hook(self._driver, self.policy)
        if bind is not None:
            view = SchedulerView(self.kv, self.max_num_seqs, self.max_num_batched_tokens,
                                 lambda: len(self._waiting), lambda: views(self.running))
            bind(view)  # at build time: a failure here is the builder's error
        names = [p.name for p in self.plugins]
        if len(set(names)) != len(names):
            raise ValueError(f"two plugins share a name: {names}")
        for plugin in self.plugins:
            plugin.bind(self)
        self.plugins = tuple(Guarded(p, lambda err: self._errors.append(err)) for p in self.plugins)
        self._lookahead_plugins = [p for p in self.plugins if p.overrides("lookahead")]

    def plugin(self, name: str) -> SchedulerPlugin | None:
        """The plugged-in feature called ``name``, or None."""
        return next((p.plugin for p in self.plugins if p.name == name), None)

    # -- queues ------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a new request (the engine validated it)."""
        request.status = RequestStatus.WAITING
        request.seq = self._next_seq
        self._next_seq += 1
        for plugin in self.plugins:
            plugin.added(request)
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
        return errors + self.kv.take_errors()

    # -- one step ----------------------------------------------------------------------

    def schedule(self, now: float, ahead_of: ScheduledBatch | None = None) -> ScheduledBatch:
        """The next batch; ``ahead_of``: one still running, uncommitted (its spans count as
        computed, each of its samples as a :data:`~llmlab.scheduler.batch.PLACEHOLDER`)."""
        self._now = now
        if ahead_of is not None:
            self._mark_ahead(ahead_of)
        for plugin in self.plugins:
            plugin.begin_step()
        if self._unqueued:
            stranded, self._unqueued = self._unqueued, []
            for request in stranded:
                self._push(request, now)
        budget = self.max_num_batched_tokens
        entries: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._admitted = []
        self._scheduled = {}

        unscheduled = self._running_order(now)
        lookahead = None
        if self._lookahead_plugins and unscheduled:
            lookahead = self._lookahead(unscheduled)
        drafting: list[tuple[int, Request, int]] = []  # (entry index, request, lookahead)
        while unscheduled is not None and unscheduled and budget > 0:
            request = unscheduled.popleft()
            num_new = min(request.num_tokens + request.num_placeholders
                          - request.num_computed_tokens - request.num_ahead, budget)
            if num_new <= 0:  # its last prompt chunk is in flight, and it samples nothing
                continue
            scheduled = self._grow(request, num_new, unscheduled, preempted, now)
            if scheduled is None:  # a component failed: stop scheduling this step
                break
            if scheduled:
                k = lookahead.get(request.request_id, 0) if lookahead else 0
                if k:
                    drafting.append((len(entries), request, k))
                entries.append(self._entry(request, num_new, new_row=False))
                budget -= num_new

        sides: dict[str, dict[str, Any]] = {}
        planned: set[str] = set()
        if self.plugins and entries and not self._errors:
            # The running requests' plans reserve first (a KV press's compaction gives back
            # more blocks than it takes, so it goes before admission when blocks are short).
            self._plan(entries, planned, sides, "running")
        # A step that had to preempt is short of memory: admitting more would only thrash.
        if not preempted and not self._errors:
            budget = self._admit(entries, budget, preempted, now)
        if drafting and not preempted and not self._errors:
            self._extend(entries, drafting, budget)
        if self.plugins and not self._errors:
            self._plan(entries, planned, sides, "admitted")
            if preempted:  # a victim's entry left the batch: so does its plugins' data
                ids = {e.request_id for e in entries}
                sides = {k: {r: v for r, v in side.items() if r in ids}
                         for k, side in sides.items()}
        freed = self._rows.drain_released()
        batch = ScheduledBatch(
            entries=tuple(entries),
            preempted=tuple(preempted),
            freed_rows=freed,
            kv_transfers=tuple(self.kv.take_transfers()),
            block_copies=tuple(self.kv.take_block_copies()),
            admitted=tuple(a for a in self._admitted if a.request_id not in preempted),
            sides=FrozenDict({k: FrozenDict(v) for k, v in sides.items() if v}),
            columns=BatchColumns.of(entries) if entries else None,
        )
        if entries:
            self._batches[id(batch)] = self._scheduled  # update(batch) reads it
        return batch

    def _plan(self, entries: list[ScheduledRequest], planned: set[str],
              sides: dict[str, dict[str, Any]], phase: str) -> None:
        """Each plugin's side map for the entries not yet ``planned`` (their ids join it)."""
        todo = [e for e in entries if e.request_id not in planned]
        if not todo:
            return
        planned.update(e.request_id for e in todo)
        plan = StepPlan(todo, self._scheduled, self.kv, phase)
        for plugin in self.plugins:  # one that raised answers None (scheduler/guard.py)
            side = plugin.plan(plan)
            if side:
                sides.setdefault(plugin.name, {}).update(side)

    def _entry(self, request: Request, num_new: int, *, new_row: bool) -> ScheduledRequest:
        """The request's share of the step, as plain data (see :mod:`.batch`)."""
        rid = request.request_id
        self._scheduled[rid] = request
        start = request.num_computed_tokens + request.num_ahead
        end = start + num_new
        known = request.num_tokens  # positions past it: placeholders (a batch in flight)
        scored = end == known + request.num_placeholders
        setup = None
        pooling = request.pooling_params
        if new_row or (self._resend and rid in self._resend):
            self._resend.discard(rid)
            setup = RowSetup(
                request.sampling_params if pooling is None else pooling,
                tuple(request.prompt_token_ids),
                tuple(request.output_token_ids),
                request.eos_token_ids,
            )
        blocks_from, blocks = self.kv.table_delta(rid, whole=setup is not None)
        forks = ()
        if scored and request.forks and not request.num_placeholders:
            rows = self._rows.reserved(rid)
            forks = tuple(
                Fork(f.request_id, row, f.sampling_params)
                for f, row in zip(request.forks, rows, strict=True)
            )
            for f in request.forks:
                self._scheduled[f.request_id] = f
        # A pooling request is prefill only: it scores nothing (its plugin answers the entry
        # that ends the prompt with the pooled output).
        return ScheduledRequest(
            rid, request.row, start,
            tuple(request.all_token_ids[start:end]) + (PLACEHOLDER,) * max(0, end - known),
            blocks_from,
            blocks, 1 if scored and pooling is None else 0, setup, forks,
            len(request.prompt_logprobs) - 1 if request.needs_prompt_logprobs else -1,
            len(request.prompt_token_ids),
        )

    # -- user policy calls -------------------------------------------------------------

    def _push(self, request: Request, now: float) -> None:
        """Queue a waiting request in the policy; if that fails, keep it for the next step."""
        if self._call("push", request.view, now) is FAILED:
            self._unqueued.append(request)

    def _forget(self, request: Request) -> None:
        """Tell the policy a request is gone for good (its queue entry, if any, too), and
        the plugins."""
        self._call("remove", request.view)
        for plugin in self.plugins:
            plugin.finished(request)

    def _optional(self, method: str):
        """The policy's optional ``method`` (looked up on the policy as given, too)."""
        found = getattr(self._driver, method, None)
        if found is None and self._driver is not self.policy:
            found = getattr(self.policy, method, None)
        return found if callable(found) else None

    def _call(self, method: str, *args):
        """``policy.method(*args)``, or ``FAILED`` (with the error recorded) if it raises."""
        try:
            return self._optional(method)(*args)
        except Exception as err:  # noqa: BLE001 - user code; reported after the step
            self._errors.append(ComponentError.wrap("scheduling policy", self.policy, method, err))
            return FAILED

    def _bad_answer(self, method: str, answer: object, allowed: str) -> None:
        self._errors.append(
            ComponentError(
                "scheduling policy", self.policy, method,
                f"returned {answer!r}, which is not {allowed}",
            )
        )

