"""Admission (a mixin of :class:`~llmlab.scheduler.scheduler.Scheduler`): what the running
requests left of the step's budget goes to waiting ones, popped in the policy's order
(its optional ``admit`` and the plugins' ``admissible`` may hold one back), each after its
longest cached prefix (device, then the offload tier; a request swapped out resumes where
it stopped), with its KV blocks and a row; a policy's ``preempt_for`` may make room."""

from __future__ import annotations

from llmlab.errors import ComponentError
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.batch import Admission, ScheduledRequest
from llmlab.scheduler.policy import FAILED, OrderPolicy, request_of, views


class Admitting:
    """Admission of :class:`~llmlab.scheduler.scheduler.Scheduler` (see the module)."""

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
            if answer is FAILED:
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
                if verdict is FAILED:
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
            if answer is FAILED or answer is None:
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
