"""The scheduler: continuous batching, chunked prefill, and preemption by recompute.

Each step spends a budget of ``max_num_batched_tokens`` new tokens across at most
``max_num_seqs`` running requests. Running requests go first, in admission order: a decode
takes one token, an unfinished prefill takes as much of its prompt as the budget allows
(chunked prefill, so long prompts share steps with decodes). Whatever budget is left admits
waiting requests in the policy's order, each starting after its longest cached prefix.

When the KV cache cannot hold a running request's next tokens, the policy picks a victim
among the running requests not yet scheduled this step; the victim's blocks are freed and
it rejoins the waiting queue to be recomputed later (its generated tokens are kept).
"""

from __future__ import annotations

import attrs

from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.policy import FCFS, SchedulingPolicy


@attrs.frozen
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # KV positions already cached before this step (prefix hit or earlier chunks).
    num_computed_tokens: int
    # Whether this step reaches the request's last known token and so yields a new one
    # (False for a prefill chunk that stops short of the end of the prompt).
    samples: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        end = self.num_computed_tokens + self.num_new_tokens
        object.__setattr__(self, "samples", end == self.request.num_tokens)


@attrs.frozen
class ScheduledBatch:
    entries: tuple[ScheduledRequest, ...]
    preempted: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(e.num_new_tokens for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


@attrs.define
class Scheduler:
    """Continuous-batching scheduler (mechanism); decisions go to ``policy``."""

    kv: KVCacheManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: SchedulingPolicy = attrs.field(factory=FCFS)
    waiting: list[Request] = attrs.field(factory=list)
    running: list[Request] = attrs.field(factory=list)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, now: float) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        entries: list[ScheduledRequest] = []
        preempted: list[str] = []

        unscheduled = list(self.running)
        while unscheduled and budget > 0:
            request = unscheduled.pop(0)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate(request, num_new):
                victim = self.policy.victim([request, *unscheduled])
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                unscheduled.remove(victim)
            else:
                entries.append(ScheduledRequest(request, num_new, request.num_computed_tokens))
                budget -= num_new

        # A step that had to preempt is short of memory: admitting more would only thrash.
        if not preempted:
            budget = self._admit(entries, budget, now)
        return ScheduledBatch(tuple(entries), tuple(preempted))

    def _admit(self, entries: list[ScheduledRequest], budget: int, now: float) -> int:
        admit = getattr(self.policy, "admit", None)  # optional third decision
        for request in self.policy.order(self.waiting, now):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if admit is not None and not admit(request, budget):
                continue
            prefix = self.kv.lookup_prefix(request)
            num_cached = len(prefix) * self.kv.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.kv.allocate(request, num_new, prefix):
                break
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.waiting.remove(request)
            self.running.append(request)
            entries.append(ScheduledRequest(request, num_new, num_cached))
            budget -= num_new
        return budget

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.append(request)

    def update(
        self, batch: ScheduledBatch, sampled: dict[str, tuple[int, float]]
    ) -> list[Request]:
        """Advance the batch's requests; append sampled tokens; return those that finished."""
        finished = []
        for entry in batch.entries:
            request = entry.request
            request.num_computed_tokens = entry.num_computed_tokens + entry.num_new_tokens
            self.kv.cache_computed_blocks(request)
            if not entry.samples:
                continue
            token_id, logprob = sampled[request.request_id]
            request.append_output(token_id, logprob)
            status = self._stop_status(request, token_id)
            if status is not None:
                request.status = status
                self.running.remove(request)
                self.kv.free(request)
                finished.append(request)
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

    def abort(self, request_ids: set[str]) -> list[Request]:
        """Remove the given requests wherever they are; frees their blocks."""
        aborted = []
        for queue in (self.waiting, self.running):
            for request in [r for r in queue if r.request_id in request_ids]:
                queue.remove(request)
                self.kv.free(request)
                request.status = RequestStatus.FINISHED_ABORTED
                aborted.append(request)
        return aborted
