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

import collections
from typing import Any

import attrs

from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.errors import ComponentError
from llmlab.plugin import SchedulerPlugin, StepPlan
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.batch import (
    Admission,
    Fork,
    RowSetup,
    ScheduledBatch,
    ScheduledRequest,
)
from llmlab.scheduler.lifecycle import Lifecycle
from llmlab.scheduler.policies import FCFS
from llmlab.scheduler.policy import (
    OrderPolicy,
    SchedulerView,
    SchedulingPolicy,
    as_policy,
    request_of,
    views,
)
from llmlab.scheduler.rows import Rows
from llmlab.validation import FrozenDict

# What ``_call`` returns when the policy raised (None may be a legitimate answer).
_FAILED = object()


@attrs.define
class Scheduler(Lifecycle):
    """Continuous-batching scheduler (mechanism); decisions go to ``policy``.

    Attributes:
        policy: the scheduling policy as given (a v1 ``order``/``victim`` policy is driven
            through :class:`~llmlab.scheduler.policy.OrderPolicy`).
        running: admitted requests, in admission order.
        chunked_prefill: split prompts across steps; when False a prompt is admitted only
            when its whole remaining prefill fits the step's budget.
        speculation: speculative decoding's length policy
            (:class:`~llmlab.speculative.length.SpeculationLength`), or None (off). Each
            step it gives every running decode a lookahead ``k``; the scheduler budgets
            ``1 + k`` tokens and reserves their KV blocks (never preempting for a draft:
            when they do not fit, the request decodes plainly), and after verification
            keeps the accepted tokens' KV and returns the blocks past them.
        preemption_mode: ``"recompute"`` (a victim's blocks are freed and its tokens
            recomputed on resumption) or ``"swap"`` (its computed blocks are copied to the
            KV cache manager's swap space and back on resumption; recompute when that is
            full, or when a plugin says so). A policy's optional
            ``preemption_mode(victim)`` may choose per victim.
        plugins: the features plugged in (:class:`~llmlab.plugin.SchedulerPlugin`: LoRA's
            adapter limit, pooling, a KV press, ...), bound here, called in order.
    """

    kv: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy = attrs.field(factory=FCFS)
    chunked_prefill: bool = True
    speculation: Any = None
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
    # The requests of the last batch, by id (``update`` applies the output to them).
    _scheduled: dict[str, Request] = attrs.field(init=False, factory=dict)
    _errors: list[Exception] = attrs.field(init=False, factory=list)
    _admitted: list[Admission] = attrs.field(init=False, factory=list)  # this step's
    _next_seq: int = attrs.field(init=False, default=0)
    _now: float = attrs.field(init=False, default=0.0)  # the last step's schedule time

    def __attrs_post_init__(self) -> None:
        self._rows = Rows(self.max_num_seqs)
        self._driver = as_policy(self.policy)
        attach = self._optional("attach")
        if attach is not None:
            view = SchedulerView(
                self.kv, self.max_num_seqs, self.max_num_batched_tokens,
                lambda: len(self._waiting), lambda: views(self.running),
            )
            attach(view)  # at build time: a failure here is the builder's error
        names = [p.name for p in self.plugins]
        if len(set(names)) != len(names):
            raise ValueError(f"two plugins share a name: {names}")
        for plugin in self.plugins:
            plugin.bind(self)

    def plugin(self, name: str) -> SchedulerPlugin | None:
        """The plugged-in feature called ``name``, or None."""
        return next((p for p in self.plugins if p.name == name), None)

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

    def schedule(self, now: float) -> ScheduledBatch:
        self._now = now
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
        if self.speculation is not None and unscheduled:
            lookahead = self._lookahead(unscheduled)
        drafting: list[tuple[int, Request, int]] = []  # (entry index, request, lookahead)
        while unscheduled is not None and unscheduled and budget > 0:
            request = unscheduled.popleft()
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
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
        return ScheduledBatch(
            entries=tuple(entries),
            preempted=tuple(preempted),
            freed_rows=freed,
            kv_transfers=tuple(self.kv.take_transfers()),
            block_copies=tuple(self.kv.take_block_copies()),
            admitted=tuple(a for a in self._admitted if a.request_id not in preempted),
            sides=FrozenDict({k: FrozenDict(v) for k, v in sides.items() if v}),
        )

    def _plan(self, entries: list[ScheduledRequest], planned: set[str],
              sides: dict[str, dict[str, Any]], phase: str) -> None:
        """Each plugin's side map for the entries not yet ``planned`` (their ids join it)."""
        todo = [e for e in entries if e.request_id not in planned]
        if not todo:
            return
        planned.update(e.request_id for e in todo)
        plan = StepPlan(todo, self._scheduled, self.kv, phase)
        for plugin in self.plugins:
            try:
                side = plugin.plan(plan)
            except ComponentError as err:  # the eviction policy failed reserving blocks
                self._errors.append(err)
                return
            if side:
                sides.setdefault(plugin.name, {}).update(side)

    def _lookahead(self, running) -> dict[str, int] | None:
        """Each running decode's speculative lookahead this step, from the length policy
        (requests with a grammar decode plainly); None when the policy failed."""
        candidates = [
            r for r in running
            if r.num_tokens - r.num_computed_tokens == 1
            and r.sampling_params.structured_outputs is None
        ]
        if not candidates:
            return None
        policy = self.speculation
        try:
            answer = list(policy.lengths(views(candidates), len(self.running)))
        except Exception as err:  # noqa: BLE001 - user code; reported after the step
            self._errors.append(ComponentError.wrap("speculation length", policy, "lengths", err))
            return None
        k_max = policy.num_speculative_tokens
        if len(answer) != len(candidates) or not all(
            isinstance(k, int) and 0 <= k <= k_max for k in answer
        ):
            self._errors.append(ComponentError(
                "speculation length", policy, "lengths",
                f"returned {answer!r}, which is not one int in [0, {k_max}] per candidate",
            ))
            return None
        lengths = {}
        for request, k in zip(candidates, answer, strict=True):
            if k:
                # No draft past the length limits: the step emits at most k + 1 tokens.
                params = request.sampling_params
                room = self.max_model_len - request.num_tokens
                if params.max_tokens is not None:
                    room = min(room, params.max_tokens - request.num_output_tokens - 1)
                if room > 0:
                    lengths[request.request_id] = min(k, room)
        return lengths

    def _extend(
        self, entries: list[ScheduledRequest], drafting: list[tuple[int, Request, int]],
        budget: int,
    ) -> None:
        """Give decodes their lookahead from what the step left: budget and KV blocks
        after every running request and every admission got theirs, so a draft never
        preempts or holds back anyone. A decode whose lookahead does not fit decodes
        plainly."""
        for index, request, k in drafting:
            k = min(k, budget)
            if k <= 0:
                break
            try:
                if not self.kv.allocate(request, 1 + k):
                    continue
            except ComponentError as err:
                self._errors.append(err)
                return
            entry = entries[index]
            # The entry's table change, widened by what the lookahead added.
            first, _ = self.kv.table_delta(request.request_id)
            first = min(first, entry.blocks_from)
            entries[index] = entry._replace(
                num_lookahead=k, blocks_from=first,
                blocks=self.kv.block_table(request.request_id)[first:],
            )
            budget -= k

    def _running_order(self, now: float) -> collections.deque[Request] | None:
        """Running requests in the order they get budget; None if the policy failed."""
        order = self._optional("running_order")
        if order is None or not self.running:
            return collections.deque(self.running)
        answer = self._call("running_order", views(self.running), now)
        if answer is _FAILED:
            return None
        ordered = [request_of(v) for v in answer]
        if len(ordered) != len(self.running) or {id(r) for r in ordered} != {
            id(r) for r in self.running
        }:
            self._bad_answer("running_order", answer, "a reordering of the running requests")
            return None
        return collections.deque(ordered)

    def _grow(
        self,
        request: Request,
        num_new: int,
        unscheduled: collections.deque[Request],
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
    ) -> int:
        """Admit waiting requests with what is left of the budget; returns what remains."""
        admit = self._optional("admit")
        preempt_for = self._optional("preempt_for")
        handed_back: list[Request] = []  # popped, not admitted: pushed back at the end
        admitted_now: set[int] = set()
        while budget > 0 and self._waiting:
            if not self._rows.num_free and preempt_for is None:
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
            if not all(p.admissible(request, self.running) for p in self.plugins):
                handed_back.append(request)  # a feature holds it back (LoRA's max_loras)
                break
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
        return budget

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
            # A request preempted by swapping resumes where it stopped (its KV swapped in).
            swapped = self.kv.is_swapped(request)
            prefix = offloaded = ()
            if swapped:
                num_cached = request.num_computed_tokens
            elif not request.skips_prefix_cache:
                # Prompt logprobs, and poolers that read every position, need every prompt
                # position computed: no prefix-cache hits. A hit continues in the offload
                # tier past the device's (loaded back by allocate).
                prefix = self.kv.lookup_prefix(request)
                offloaded = self.kv.lookup_offloaded(request, len(prefix))
                limit = self._prefix_limit(request)
                if limit is not None:
                    # E.g. a KV press reads the queries of the prompt's last positions:
                    # those are computed even when cached.
                    num_blocks = limit // self.kv.block_size
                    prefix = prefix[:num_blocks]
                    offloaded = offloaded[: max(0, num_blocks - len(prefix))]
            if not swapped:
                num_cached = (len(prefix) + len(offloaded)) * self.kv.block_size
            remaining = request.num_tokens - num_cached
            if not self.chunked_prefill and remaining > budget:
                return None, budget
            num_new = min(remaining, budget)
            allocated = False
            if self._rows.num_free >= rows_needed:
                try:
                    if swapped:
                        allocated = self.kv.swap_in(request, num_new)
                    else:
                        allocated = self.kv.allocate(request, num_new, prefix, offloaded)
                except ComponentError as err:
                    self._errors.append(err)
                    return None, budget
            if allocated:
                break
            if self._rows.num_free >= rows_needed and not self.running and not entries:
                if swapped:
                    # The whole pool cannot take its KV back at once: recompute instead
                    # (in chunks), dropping the swapped copy.
                    self._free_blocks(request)
                    request.num_computed_tokens = 0
                    continue
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
                if entry.request_id == victim.request_id:
                    del entries[i]
                    budget += entry.num_new_tokens
                    break
            self._preempt(victim, now)
            preempted.append(victim.request_id)
        request.num_computed_tokens = num_cached
        queried = 0 if request.skips_prefix_cache or not self.kv.enable_prefix_caching else (
            request.num_tokens
        )
        bs = self.kv.block_size
        self._admitted.append(
            Admission(
                request.request_id, request.arrival_time, request.num_prompt_tokens,
                0 if swapped else queried, 0 if swapped else num_cached,
                resumed=request.num_preemptions > 0,
                num_offloaded_tokens=len(offloaded) * bs,
                num_swapped_tokens=num_cached if swapped else 0,
            )
        )
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        request.row = self._rows.take()
        if request.forks:  # rows for its parallel samples, taken when they fork
            self._rows.reserve(request.request_id, len(request.forks))
        del self._waiting[request.request_id]
        self.running.append(request)
        entries.append(self._entry(request, num_new, new_row=True))
        return True, budget - num_new

    def _prefix_limit(self, request: Request) -> int | None:
        limits = [p.prefix_limit(request) for p in self.plugins]
        return min((x for x in limits if x is not None), default=None)

    def _entry(self, request: Request, num_new: int, *, new_row: bool) -> ScheduledRequest:
        """The request's share of the step, as plain data (see :mod:`.batch`)."""
        rid = request.request_id
        self._scheduled[rid] = request
        start = request.num_computed_tokens
        end = start + num_new
        scored = end == request.num_tokens
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
        if scored and request.forks:
            rows = self._rows.reserved(rid)
            forks = tuple(
                Fork(f.request_id, row, f.sampling_params)
                for f, row in zip(request.forks, rows, strict=True)
            )
            for f in request.forks:
                self._scheduled[f.request_id] = f
        if pooling is not None:
            # Prefill only: nothing is sampled (the pooling plugin answers the entry that
            # ends the prompt with the pooled output).
            return ScheduledRequest(
                rid, request.row, start, tuple(request.all_token_ids[start:end]), blocks_from,
                blocks, 0, setup, num_prompt_tokens=len(request.prompt_token_ids),
            )
        return ScheduledRequest(
            rid, request.row, start, tuple(request.all_token_ids[start:end]), blocks_from,
            blocks, 1 if scored else 0, setup, forks,
            len(request.prompt_logprobs) - 1 if request.needs_prompt_logprobs else -1,
            len(request.prompt_token_ids),
        )

    def _preemption_mode(self, request: Request) -> str:
        """``"swap"`` or ``"recompute"`` for a victim: the engine's mode, unless the
        policy's optional ``preemption_mode(victim)`` names one. A plugin may insist on
        recomputing (a pooler's per-row state does not survive the row; a KV press's
        selection is recomputed in full)."""
        if any(p.recompute_only(request) for p in self.plugins):
            return "recompute"
        mode = self.preemption_mode
        if self._optional("preemption_mode") is not None:
            answer = self._call("preemption_mode", request.view)
            if answer is _FAILED:
                return "recompute"
            if answer is not None:
                if answer not in ("swap", "recompute"):
                    self._bad_answer("preemption_mode", answer, "'swap', 'recompute' or None")
                    return "recompute"
                mode = answer
        return mode

    # -- user policy calls -------------------------------------------------------------

    def _push(self, request: Request, now: float) -> None:
        """Queue a waiting request in the policy; if that fails, keep it for the next step."""
        if self._call("push", request.view, now) is _FAILED:
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

