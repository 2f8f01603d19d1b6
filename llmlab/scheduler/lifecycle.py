"""Lifecycle transitions: how a step's outcome and outside events change requests.

The half of :class:`~llmlab.scheduler.scheduler.Scheduler` that writes lifecycle state
after a batch is built: appending an executor's tokens and deciding what stopped
(``update``; parallel samples start in :mod:`.parallel`), a stop string found by output
processing (``stop_string``), preemption, failure and abort (a mixin of ``Scheduler``).
"""

from __future__ import annotations

from collections.abc import Iterable

from llmlab.errors import ComponentError, RequestFailedError
from llmlab.request import Request, RequestStatus
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch
from llmlab.scheduler.parallel import ParallelSamples
from llmlab.scheduler.policy import Served


class Lifecycle(ParallelSamples):
    """Transitions of :class:`~llmlab.scheduler.scheduler.Scheduler` (see the module)."""

    def resend_rows(self) -> None:
        """The executor failed mid-step and dropped its per-row state: every running
        request's next entry carries its row's setup and whole block table again, and no
        batch is in flight any more (its spans are scheduled again)."""
        self._resend = {r.request_id for r in self.running}
        self._batches.clear()
        for request in self.running:
            request.num_ahead = request.num_placeholders = 0

    def requests_of(self, batch: ScheduledBatch) -> dict[str, Request]:
        """The requests of a batch not yet committed, by id (its forks' included)."""
        return self._batches.get(id(batch), {})

    def _mark_ahead(self, batch: ScheduledBatch) -> None:
        """Planning ahead of ``batch`` (in flight): its running requests' spans count as
        computed, and each token it samples as a placeholder, until ``update(batch)``."""
        scheduled = self.requests_of(batch)
        for entry in batch.entries:
            request = scheduled[entry.request_id]
            if request.status is RequestStatus.RUNNING:
                request.num_ahead, request.num_placeholders = len(entry.token_ids), entry.num_scored

    def update(self, batch: ScheduledBatch, output: BatchOutput) -> list[Request]:
        """Advance the batch's requests; append their new tokens; return those that finished.

        Tokens of an entry are appended in order until one ends the request; the rest are
        dropped (so a verifier or a multi-token step can overshoot safely). Then the policy
        hears what each request was served (``on_step``) and which finished (``remove``).
        """
        try:
            output.check(batch)
            for plugin in self.plugins:
                plugin.check(batch, output)
        except ValueError:
            self.resend_rows()  # the executor's row state may be ahead of ours
            raise
        on_step = self._optional("on_step")
        served: list[Served] = []
        finished = []
        scheduled = self._batches.pop(id(batch), {})  # {}: a batch of no entries
        cache_computed_blocks = self.kv.cache_computed_blocks
        block_size = self.kv.block_size
        prompt_logprobs, all_tops = output.prompt_logprobs, output.top_logprobs
        failures = output.failed
        drafted = output.num_drafted
        # Each plugin's side maps in and out; committers: the plugins overriding commit.
        sides = [(p, batch.sides.get(p.name), output.sides.get(p.name)) for p in self.plugins]
        committers = [s for s in sides if s[0].overrides("commit")]
        running = RequestStatus.RUNNING
        for i, (entry, token_ids, logprobs) in enumerate(
            zip(batch.entries, output.token_ids, output.logprobs)
        ):
            request = scheduled[entry.request_id]
            if request.status is not running:  # ended (or preempted) while the step ran
                continue
            request.num_ahead = request.num_placeholders = 0  # committed now
            if failures is not None and failures[i] is not None:
                # This request alone failed in execution: it ends; the batch goes on.
                self._fail(request, f"request {request.request_id!r} failed: {failures[i]}")
                continue

            start = entry.start
            end = start + len(entry.token_ids)
            speculated = drafted is not None and drafted[i] and token_ids
            if speculated:
                # The accepted draft tokens' KV is valid too (verification computed it);
                # the rejected ones' is not, and their whole blocks go back below.
                end += len(token_ids) - 1
            request.num_computed_tokens = end
            new_prompt = 0
            if start < entry.num_prompt_tokens:  # prompt positions (first time or again)
                prompt_end = min(end, entry.num_prompt_tokens)
                new_prompt = max(0, prompt_end - max(start, request.num_prompt_computed))
                request.num_prompt_computed = max(request.num_prompt_computed, prompt_end)
            if not speculated and end // block_size > start // block_size:
                cache_computed_blocks(request)  # only when a block filled up this step
            if prompt_logprobs is not None and prompt_logprobs[i]:
                request.add_prompt_logprobs(output.prompt_logprobs_start[i], prompt_logprobs[i])
            for plugin, sent_map, returned in sides:
                # After the full blocks computed this step entered the prefix index (their
                # KV is exact), before the forks take the request's blocks.
                sent = sent_map.get(entry.request_id) if sent_map else None
                got = returned[i] if returned else None
                if sent is not None or got is not None:
                    plugin.settle(request, sent, got)
            if entry.forks and request.forks:
                # Before the request's own token: a request that finishes now frees its
                # blocks, and the forks take them by reference first.
                for member in self._fan_out(request, output.forks[i]):
                    if on_step is not None:
                        served.append(Served(member.view, 0, 0, 1))
                    if member.is_finished:
                        finished.append(member)
            tops = all_tops[i] if all_tops is not None else None
            num_generated = 0
            for j, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
                request.append_output(token_id, logprob, tops[j] if tops else None)
                num_generated += 1
                status = self._stop_status(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
                    break
            for plugin, sent_map, returned in committers if request.status is running else ():
                reason = plugin.commit(
                    request, sent_map.get(entry.request_id) if sent_map else None,
                    returned[i] if returned else None,
                )
                if reason is not None and reason is not False:
                    if reason is not True:
                        request.stop_reason = reason
                    self._finish(request, RequestStatus.FINISHED_STOPPED)
                    finished.append(request)
                    break
            if entry.num_lookahead and request.status is running:
                # Keep the blocks of the tokens known now (the last one is written next
                # step); blocks reserved for rejected or unproposed drafts go back.
                request.num_computed_tokens = min(end, request.num_tokens - 1)
                self.kv.truncate(request, request.num_tokens)
                cache_computed_blocks(request)  # only accepted full blocks enter the index
            if on_step is not None:
                served.append(Served(request.view, len(entry.token_ids), new_prompt, num_generated))
        if on_step is not None and served:
            self._call("on_step", tuple(served), self._now)
        for request in finished:
            self._forget(request)
        return finished

    def stop_string(self, request: Request, matched: str) -> bool:
        """A stop string matched in the request's text (the output side found it): the one
        way a stop decided above the scheduler reaches a request's lifecycle. A running
        request stops (blocks and row freed, the policy told); one that just reached its
        length limit with the same token is reported as stopped on the string, since its
        text is cut there. True when it stopped now."""
        if request.status is RequestStatus.FINISHED_LENGTH:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = matched
            return False
        if request.is_finished or request not in self.running:
            return False
        request.stop_reason = matched
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        self._forget(request)
        return True

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token_id in request.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- lifecycle transitions ---------------------------------------------------------

    def _release_row(self, request: Request) -> None:
        self._rows.release(request.row, request.request_id)
        request.row = None
        self._resend.discard(request.request_id)

    def _free_blocks(self, request: Request) -> None:
        try:
            self.kv.free(request)
        except ComponentError as err:  # the pool is consistent; report after the step
            self._errors.append(err)

    def _preempt(self, request: Request, now: float) -> None:
        self.running.remove(request)
        self._release_row(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        request.num_ahead = request.num_placeholders = 0  # its batch in flight: dropped
        swapped = False
        if self._preemption_mode(request) == "swap":
            try:  # keeps num_computed_tokens: it resumes where it stopped
                swapped = self.kv.swap_out(request)
            except ComponentError as err:  # swapped, and the pool is consistent
                self._errors.append(err)
                swapped = self.kv.is_swapped(request)
        if not swapped:  # recompute (the default, and the fallback when swap is full)
            request.num_computed_tokens = 0
            request.kv_dropped = 0  # recomputed in full
            request.kv_compressed = False
            self._free_blocks(request)
        for plugin in self.plugins:
            plugin.preempted(request, recomputed=not swapped)
        self._waiting[request.request_id] = request
        self._push(request, now)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.running.remove(request)
        self._release_row(request)
        request.status = status
        self._free_blocks(request)

    def _fail(self, request: Request, reason: str) -> None:
        """End a request that failed on its own: it can never be scheduled, or execution
        failed for it alone (aborted, with ``error`` set; reported after the step)."""
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
