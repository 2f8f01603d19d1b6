"""Parallel samples (``n`` / ``best_of`` > 1; a mixin of
:class:`~llmlab.scheduler.scheduler.Scheduler`): a request's extra samples wait as its
``forks`` until its prompt is computed, then start at its first sample (``_fan_out``):
each takes the leader's KV blocks by reference and a row reserved at admission."""

from __future__ import annotations

from llmlab.request import Request, RequestStatus


class ParallelSamples:
    """Parallel-sample transitions of the scheduler (see the module)."""

    def _fan_out(self, leader: Request, samples) -> list[Request]:
        """Start the leader's parallel samples: each takes the leader's KV blocks by
        reference (the partly filled last block is copied when first written), a reserved
        row, and its own first token."""
        members, leader.forks = leader.forks, []
        rows = self._rows.take_reserved(leader.request_id)
        for member, row, (token_id, logprob, top) in zip(members, rows, samples, strict=True):
            self.kv.fork(leader, member)
            member.num_computed_tokens = leader.num_computed_tokens
            member.num_prompt_computed = leader.num_prompt_computed
            member.num_cached_tokens = leader.num_cached_tokens
            # A leader whose KV a feature rewrote (a KV press) shares it with its forks.
            member.kv_dropped = leader.kv_dropped
            member.kv_compressed = leader.kv_compressed
            for plugin in self.plugins:
                plugin.forked(leader, member)
            member.status = RequestStatus.RUNNING
            member.row = row
            member.seq = self._next_seq
            self._next_seq += 1
            self.running.append(member)
            member.append_output(token_id, logprob, top)
            status = self._stop_status(member, token_id)
            if status is not None:
                self._finish(member, status)  # the caller reports it and tells the policy
        return members

    def drop_forks(self, request: Request) -> list[Request]:
        """A request ended before its parallel samples forked: they end with it (same
        status and error); returns them."""
        forks, request.forks = request.forks, []
        for member in forks:
            member.status = request.status
            member.error = request.error
        return forks
