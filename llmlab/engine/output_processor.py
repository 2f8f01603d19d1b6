"""Output processing: a request's text, stop strings and the ``RequestOutput`` it reports.

:class:`OutputProcessor` owns everything about what a caller has been told: each request's
incremental detokenizer (text and stop strings), how much of its output was reported
(DELTA streams), and the vLLM-shaped logprob dicts built once per position. It reads
requests and writes none of their lifecycle: a stop string it finds goes to the scheduler
(``Scheduler.stop_string``), which ends the request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from llmlab.engine.detokenizer import IncrementalDetokenizer, decode_token
from llmlab.engine.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from llmlab.request import Request, RequestStatus
from llmlab.sampling.params import RequestOutputKind


@attrs.define(eq=False, slots=True)
class _Reported:
    """What one request's caller has been told so far."""

    detokenizer: IncrementalDetokenizer | None = None
    # Its text is due only when the request ends (FINAL_ONLY outputs, no stop strings): the
    # tokens are decoded then, at once, not step by step.
    deferred: bool = False
    num_reported_tokens: int = 0
    finish_reported: bool = False  # a DELTA stream says a sample finished once
    num_reported_prompt_logprobs: int = 0
    logprob_dicts: list = attrs.field(factory=list)
    prompt_logprob_dicts: list = attrs.field(factory=list)


@attrs.define
class OutputProcessor:
    """Turns requests' progress into text and :class:`RequestOutput`\\ s.

    Attributes:
        tokenizer: decodes text (None: token ids only, no stop strings).
    """

    tokenizer: Any | None
    _reported: dict[str, _Reported] = attrs.field(factory=dict)

    def add(self, request: Request) -> None:
        """Start tracking a queued request (its detokenizer, when it wants text)."""
        detok = None
        params = request.sampling_params
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer.from_params(
                self.tokenizer, request.prompt_token_ids, params
            )
        deferred = (detok is not None and not detok.stop
                    and params.output_kind is RequestOutputKind.FINAL_ONLY)
        self._reported[request.request_id] = _Reported(detok, deferred)

    def forget(self, request: Request) -> None:
        self._reported.pop(request.request_id, None)

    def stop_string(self, request: Request, before: int) -> str | None:
        """Feed the request's tokens from output index ``before`` on to its detokenizer;
        the stop string they completed, if any (the caller tells the scheduler)."""
        state = self._reported.get(request.request_id)
        detok = None if state is None else state.detokenizer
        if detok is None or state.deferred:
            return None
        # The EOS or stop token that ended it stays out of the text (vLLM v1).
        terminated = request.status is RequestStatus.FINISHED_STOPPED
        return detok.update(
            request.output_token_ids[before:], request.num_output_tokens,
            stop_terminated=terminated,
        )

    @staticmethod
    def stamp(
        scheduled: Iterable[Request], progressed: Iterable[tuple[Request, int]],
        finished: Iterable[Request], start: float, now: float,
    ) -> None:
        """Record the step's times on its requests (their :class:`RequestMetrics`):
        ``scheduled`` ran in the step that began at ``start``; ``progressed`` (``(request,
        outputs before the step)``) got tokens by ``now``; ``finished`` ended by ``now``."""
        for request in scheduled:
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
        for request, before in progressed:
            if len(request.output_token_ids) > before:
                if request.first_scheduled_time is None:  # a fork starts with its leader
                    request.first_scheduled_time = start
                if request.first_token_time is None:
                    request.first_token_time = now
                request.last_token_time = now
        for request in finished:
            if request.finished_time is None:
                request.finished_time = now

    def outputs(
        self, progressed: Iterable[tuple[Request, int]], failed: Iterable[Request],
        pooled: Iterable[Request] = (),
    ) -> list[RequestOutput | PoolingRequestOutput]:
        """One output per caller-visible request that progressed (``(request, outputs
        before the step)``), was pooled (a pooling request that finished) or failed, in
        that order; a parallel sample's output covers its whole group."""
        touched: dict[str, Request] = {}
        for request in pooled:
            touched[request.request_id] = request
        failed = list(failed)
        final_only = RequestOutputKind.FINAL_ONLY
        for request, before in progressed:
            if len(request.output_token_ids) <= before or request in failed:
                continue
            if (request.group is None and request.sampling_params.output_kind is final_only
                    and not request.is_finished):
                continue  # nothing due until it ends
            touched.setdefault(_caller_id(request), request)
        for request in failed:
            touched.setdefault(_caller_id(request), request)
        built = (self.output(request) for request in touched.values())
        return [out for out in built if out is not None]

    def output(self, request: Request) -> RequestOutput | PoolingRequestOutput | None:
        """The caller's view of ``request`` (all samples of its group), or None when its
        output kind says nothing is due yet."""
        if request.pooling_params is not None:
            # Reported once, when it ends; a failed one (no pooled output) has outputs None.
            return PoolingRequestOutput(
                request_id=request.request_id,
                outputs=None if request.pooled is None else PoolingOutput(request.pooled),
                prompt_token_ids=request.prompt_token_ids,
                finished=request.is_finished,
                num_cached_tokens=request.num_cached_tokens,
                prompt=request.prompt,
                metrics=_metrics(request, [request], request.is_finished),
            )
        group = request.group
        members = group.members if group is not None else [request]
        leader = members[0]
        params = leader.sampling_params
        kind = params.output_kind
        done = all(m.is_finished for m in members)
        n = group.n if group is not None else 1
        if not done and (kind is RequestOutputKind.FINAL_ONLY or len(members) > n):
            return None  # best_of > n: the best are known only at the end
        chosen = members
        if len(members) > n:
            chosen = sorted(members, key=lambda m: m.cumulative_logprob, reverse=True)[:n]
        delta = kind is RequestOutputKind.DELTA
        completions = []
        for index, member in enumerate(chosen):
            completion = self._completion(member, index if len(members) > n else member.index,
                                          delta)
            if completion is not None:
                completions.append(completion)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = self._prompt_logprob_dicts(leader)
            if delta:
                state = self._reported[leader.request_id]
                if state.num_reported_prompt_logprobs:
                    prompt_logprobs = None  # sent with the first delta
                else:
                    state.num_reported_prompt_logprobs = len(prompt_logprobs)
        return RequestOutput(
            request_id=group.request_id if group is not None else request.request_id,
            prompt=leader.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            outputs=completions,
            finished=done,
            num_cached_tokens=leader.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            metrics=_metrics(leader, members, done),
        )

    def _completion(self, request: Request, index: int, delta: bool) -> CompletionOutput | None:
        params = request.sampling_params
        state = self._reported[request.request_id]
        detok = state.detokenizer
        start = state.num_reported_tokens if delta else 0
        finished = request.is_finished
        if delta and start == request.num_output_tokens and (
            not finished or state.finish_reported
        ):
            return None  # nothing new (a finished sample's end was already reported)
        if state.deferred and finished and detok.num_tokens < request.num_output_tokens:
            detok.update(request.output_token_ids[detok.num_tokens:], request.num_output_tokens,
                         stop_terminated=request.status is RequestStatus.FINISHED_STOPPED,
                         final=True)
        if detok is None:
            text = ""
        elif delta:
            text = detok.delta(finished)
        else:
            text = detok.text(finished)
        logprobs = None
        if params.logprobs is not None:
            logprobs = self._logprob_dicts(request)[start:]
        if delta:
            state.num_reported_tokens = request.num_output_tokens
            state.finish_reported = finished
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=request.output_token_ids[start:],
            cumulative_logprob=request.cumulative_logprob if params.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )

    def _decoder(self, request: Request):
        if self.tokenizer is None or not request.sampling_params.detokenize:
            return None
        tokenizer = self.tokenizer
        return lambda token_id: decode_token(tokenizer, token_id)

    def _logprob_dicts(self, request: Request) -> list[dict]:
        """vLLM's per-position ``{token_id: Logprob}`` of the output, converted once each."""
        state = self._reported[request.request_id]
        return self._extend_dicts(request, request.output_logprobs, state.logprob_dicts, {})

    def _prompt_logprob_dicts(self, request: Request) -> list[dict | None]:
        """The same for the prompt (None for its first token); a copy for the output."""
        state = self._reported[request.request_id]
        return list(self._extend_dicts(
            request, request.prompt_logprobs, state.prompt_logprob_dicts, None
        ))

    def _extend_dicts(self, request: Request, entries: list, dicts: list, missing) -> list:
        """Convert the ``TokenLogprobs`` in ``entries`` not yet in ``dicts`` (None becomes
        ``missing``), so a position is decoded once however often it is reported."""
        if len(dicts) < len(entries):
            decode = self._decoder(request)
            dicts.extend(
                t.to_dict(decode) if t is not None else missing for t in entries[len(dicts) :]
            )
        return dicts


def _metrics(leader: Request, members: list[Request], done: bool) -> RequestMetrics:
    """vLLM's per-request times (the leader's; a group finishes with its last sample)."""
    first = leader.first_scheduled_time
    last = [m.last_token_time for m in members if m.last_token_time is not None]
    ends = [m.finished_time for m in members if m.finished_time is not None]
    return RequestMetrics(
        arrival_time=leader.arrival_time,
        last_token_time=max(last) if last else None,
        first_scheduled_time=first,
        first_token_time=leader.first_token_time,
        time_in_queue=None if first is None else first - leader.arrival_time,
        finished_time=max(ends) if done and ends else None,
    )


def _caller_id(request: Request) -> str:
    """The id the caller gave: the group's for a parallel sample."""
    return request.group.request_id if request.group is not None else request.request_id
