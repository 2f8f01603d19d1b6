"""Running requests (a mixin of :class:`~llmlab.scheduler.scheduler.Scheduler`): the order
they get the step's budget (the policy's ``running_order``), KV for their next tokens,
preemption of the policy's victim when the pool is full (recompute or swap: the engine's
mode, the policy's ``preemption_mode``, what plugins require), and each decode's lookahead
(speculative drafts) asked of the plugins."""

from __future__ import annotations

import collections

from llmlab.errors import ComponentError
from llmlab.request import Request
from llmlab.scheduler.batch import ScheduledRequest
from llmlab.scheduler.policy import FAILED, request_of, views


class Running:
    """Running-request handling of :class:`~llmlab.scheduler.scheduler.Scheduler`."""

    def _running_order(self, now: float) -> collections.deque[Request] | None:
        """Running requests in the order they get budget; None if the policy failed."""
        order = self._optional("running_order")
        if order is None or not self.running:
            return collections.deque(self.running)
        answer = self._call("running_order", views(self.running), now)
        if answer is FAILED:
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
            if answer is FAILED:
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
            if answer is FAILED:
                return "recompute"
            if answer is not None:
                if answer not in ("swap", "recompute"):
                    self._bad_answer("preemption_mode", answer, "'swap', 'recompute' or None")
                    return "recompute"
                mode = answer
        return mode

    def _lookahead(self, running) -> dict[str, int] | None:
        """Each running decode's lookahead this step (speculative drafts), from the plugin
        that answers ``lookahead``; None when none does or it failed."""
        decodes = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        if not decodes:
            return None
        for plugin in self._lookahead_plugins:  # one that raised answers None
            answer = plugin.lookahead(decodes, len(self.running))
            if answer is not None:
                break
        else:
            return None
        lengths = {}
        for request, k in zip(decodes, answer, strict=True):
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
