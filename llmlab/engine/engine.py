"""``Engine``: add requests, step, read outputs (the shape of vLLM's ``LLMEngine``).

One ``step()`` is: schedule -> execute the batch (an :class:`~llmlab.engine.executor.Executor`;
the model runner for a real model) -> update requests -> emit one
:class:`~llmlab.engine.events.StepEvent` -> return outputs. Build one with
:class:`~llmlab.engine.builder.EngineBuilder` (or ``LLM(...)``).

Hard edges: every argument of :meth:`Engine.add_request` is checked before anything is
queued (``TypeError``/``ValueError`` naming the field); the bookkeeping parts of a step and
of an abort run with Ctrl-C deferred (:mod:`llmlab.engine.interrupts`), so an interrupt
always leaves queues and blocks consistent; user components that fail are reported after
the step as :class:`~llmlab.errors.ComponentError`; an observer that raises is logged and
skipped; the engine is safe to call from several threads (one step at a time).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from llmlab.cache.kv_cache_manager import BlockEvents
from llmlab.config import EngineConfig
from llmlab.engine.detokenizer import IncrementalDetokenizer, decode_token
from llmlab.engine.events import Arrival, EngineSnapshot, StepEvent, StepObserver
from llmlab.engine.executor import Clock, Executor, real_clock
from llmlab.engine.interrupts import deferred_interrupts
from llmlab.engine.outputs import CompletionOutput, RequestOutput
from llmlab.errors import RequestFailedError, component_name
from llmlab.request import Request, RequestStatus, SampleGroup
from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch
from llmlab.scheduler.scheduler import Scheduler
from llmlab.validation import as_int, as_real, as_token_ids

logger = logging.getLogger(__name__)

PromptType = str | dict | Sequence[int]

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


@attrs.frozen
class PreparedRequest:
    """A request checked and tokenized by :meth:`Engine.prepare_request`, not yet queued."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    user: str | None = None
    grammar: Any = None  # the compiled structured-output grammar, if any


@attrs.define
class Engine:
    """Continuous-batching inference engine over a paged KV cache.

    Attributes:
        executor: runs each scheduled batch (``ModelRunner`` for a real model).
        clock: where time comes from (``time.monotonic``; a ``VirtualClock`` in simulation).
    """

    config: EngineConfig
    scheduler: Scheduler
    executor: Executor
    tokenizer: Any | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    clock: Clock = real_clock
    # What ``LLM.generate`` uses when given no SamplingParams (the checkpoint's
    # generation_config.json settings, as vLLM does).
    default_sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    observers: list[StepObserver] = attrs.field(factory=list)
    # Most logprobs a request may ask for (``EngineConfig.max_logprobs``; -1: no limit).
    max_logprobs: int = 20
    # Live requests by their own id (a parallel sample's id is ``f"{index}_{request_id}"``).
    _requests: dict[str, Request] = attrs.field(factory=dict)
    # Requests with n > 1 or best_of > 1, by the id the caller gave.
    _groups: dict[str, SampleGroup] = attrs.field(factory=dict)
    _structured: Any = None  # the structured-output backend, built at first use
    _step_index: int = 0
    _aborted_since_step: list[str] = attrs.field(factory=list)
    _arrived_since_step: list[Arrival] = attrs.field(factory=list)
    # Outputs built but not yet returned (a step that raised after updating requests).
    _undelivered: list[RequestOutput] = attrs.field(factory=list)
    _lock: threading.RLock = attrs.field(factory=threading.RLock)
    _init_lock: threading.Lock = attrs.field(factory=threading.Lock)

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
    ) -> None:
        """Queue a request. Raises ``TypeError``/``ValueError`` (and queues nothing) on bad input.

        ``prompt`` is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a
        sequence of token ids (list, tuple, numpy array or 1-D torch tensor).
        ``priority``: lower is served first by policies that read it (vLLM's semantics).
        ``user``: who sent it (a string, or None); per-user policies such as ``fair`` share
        service between users.

        The same as :meth:`add_prepared_request` of :meth:`prepare_request`.
        """
        prepared = self.prepare_request(request_id, prompt, params, arrival_time, priority, user)
        self.add_prepared_request(prepared)

    def prepare_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
    ) -> PreparedRequest:
        """Check and tokenize a request without queueing it (same arguments and errors as
        :meth:`add_request`).

        It reads no state that steps change, so it may run in another thread while the
        engine steps: front ends (the :class:`~llmlab.engine.async_engine.AsyncEngine`)
        tokenize and compile grammars here, off the engine's loop.
        """
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__} {request_id!r}")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or None, got {type(params).__name__}")
        arrival_time = as_real("arrival_time", arrival_time, allow_none=True)
        priority = as_int("priority", priority)
        if user is not None and not isinstance(user, str):
            raise TypeError(f"user must be a str or None, got {type(user).__name__} {user!r}")
        text, token_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            keep = self.max_model_len if keep == -1 else keep
            token_ids = token_ids[-keep:]  # vLLM keeps the end of the prompt
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, longer than max_model_len="
                f"{self.max_model_len}"
            )
        kv = self.scheduler.kv
        if kv.blocks_needed(len(token_ids)) > kv.num_blocks:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, needing {kv.blocks_needed(len(token_ids))} "
                f"KV blocks of {kv.block_size} tokens, but the whole KV cache has "
                f"{kv.num_blocks}; shorten the prompt or give the cache more memory"
            )
        self._check_params(params)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self._structured_backend().compile(params.structured_outputs)
        return PreparedRequest(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            priority=priority,
            user=user,
            grammar=grammar,
        )

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Queue a request checked by :meth:`prepare_request`. Raises ``ValueError`` (and
        queues nothing) when its id is already in use."""
        if not isinstance(prepared, PreparedRequest):
            raise TypeError(
                f"expected a PreparedRequest (from prepare_request), got {type(prepared).__name__}"
            )
        with self._lock, deferred_interrupts():
            members = self._new_requests(prepared)
            for member in members:
                if prepared.grammar is not None:
                    member.grammar = self._structured.new_state(prepared.grammar)
                if self.tokenizer is not None and member.sampling_params.detokenize:
                    member.detokenizer = IncrementalDetokenizer.from_params(
                        self.tokenizer, prepared.prompt_token_ids, member.sampling_params
                    )
            for member in members:
                self._requests[member.request_id] = member
            if members[0].group is not None:
                self._groups[prepared.request_id] = members[0].group
            self.scheduler.add(members[0])
            params = prepared.params
            self._arrived_since_step.append(
                Arrival(
                    request_id=prepared.request_id,
                    arrival_time=members[0].arrival_time,
                    prompt_len=len(prepared.prompt_token_ids),
                    max_tokens=params.max_tokens,
                    n=params.n,
                    priority=prepared.priority,
                    user=prepared.user,
                )
            )

    def _new_requests(self, prepared: PreparedRequest) -> list[Request]:
        """The request, or its ``best_of`` parallel samples (the first one leads)."""
        request_id, params = prepared.request_id, prepared.params
        num = params.num_samples
        ids = [request_id] if num == 1 else [f"{i}_{request_id}" for i in range(num)]
        taken = [i for i in {request_id, *ids} if i in self._requests or i in self._groups]
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in use")
        arrival = prepared.arrival_time
        group = SampleGroup(request_id, params.n) if num > 1 else None
        members = []
        for index, rid in enumerate(ids):
            own = params
            if num > 1:
                # vLLM's rule: sample i draws from seed + i, so samples differ but repeat.
                seed = None if params.seed is None else params.seed + index
                own = attrs.evolve(params, n=1, best_of=None, seed=seed)
            members.append(
                Request(
                    request_id=rid,
                    prompt_token_ids=list(prepared.prompt_token_ids),
                    sampling_params=own,
                    arrival_time=arrival,
                    priority=prepared.priority,
                    user=prepared.user,
                    prompt=prepared.prompt,
                    eos_token_ids=self.eos_token_ids,
                    group=group,
                    index=index,
                )
            )
            if params.prompt_logprobs is not None:
                members[-1].prompt_logprobs = [None]  # the first token has no context
        if group is not None:
            group.members = members
            members[0].forks = members[1:]
        return members

    def _check_params(self, params: SamplingParams) -> None:
        """What only the engine can check: vocabulary, tokenizer, limits."""
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {tok}, outside the vocabulary [0, {self.vocab_size})"
                )
        for field in ("allowed_token_ids",):
            for tok in getattr(params, field) or ():
                if tok >= self.vocab_size:
                    raise ValueError(
                        f"{field} contains {tok}, outside the vocabulary [0, {self.vocab_size})"
                    )
        for tok in params.logit_bias or ():
            if tok >= self.vocab_size:
                raise ValueError(
                    f"logit_bias has token id {tok}, outside the vocabulary [0, {self.vocab_size})"
                )
        limit = self.max_logprobs
        for field in ("logprobs", "prompt_logprobs"):
            k = getattr(params, field)
            wanted = self.vocab_size if k == -1 else k
            if k is not None and limit != -1 and wanted > limit:
                raise ValueError(
                    f"{field}={k} is more than max_logprobs={limit} (an engine setting: "
                    f"LLM(max_logprobs=...), -1 for no limit); allowed: 0 to {limit}"
                )
        if params.num_samples > self.scheduler.max_num_seqs:
            raise ValueError(
                f"{'best_of' if params.best_of else 'n'}={params.num_samples} parallel samples "
                f"cannot run at once with max_num_seqs={self.scheduler.max_num_seqs}"
            )
        if self.tokenizer is None:
            for field in ("stop", "bad_words"):
                if getattr(params, field):
                    raise ValueError(f"{field} needs a tokenizer (skip_tokenizer_init=True)")
        elif params.stop and not params.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True)")

    def _structured_backend(self):
        # Built once even when two threads prepare requests at once; not under the step
        # lock, which a running step holds.
        with self._init_lock:
            return self._make_structured_backend()

    def _make_structured_backend(self):
        if self._structured is None:
            from llmlab.sampling.structured import StructuredOutputBackend

            self._structured = StructuredOutputBackend(
                self.tokenizer, self.vocab_size, self.eos_token_ids
            )
        return self._structured

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - set(_PROMPT_KEYS), key=str)
            if unknown:
                raise ValueError(
                    f"prompt dict has unsupported key(s) {unknown}; allowed: 'prompt', "
                    "'prompt_token_ids'"
                )
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise TypeError(f"prompt must be a str, got {type(text).__name__}")
                prompt = prompt["prompt_token_ids"]
                if isinstance(prompt, str):
                    raise TypeError("prompt_token_ids must be a sequence of ints, got a str")
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must contain at least one character")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(
                f"prompt must be a str, a dict or a sequence of token ids, got "
                f"{type(prompt).__name__} (decode bytes to str first)"
            )
        token_ids = as_token_ids("prompt_token_ids", prompt, vocab_size=self.vocab_size)
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        return text, token_ids

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are and free their KV blocks. Unknown ids are ignored."""
        if isinstance(request_id, str):
            ids = {request_id}
        else:
            ids = set(request_id)
            bad = [i for i in ids if not isinstance(i, str)]
            if bad:
                raise TypeError(f"request ids must be str, got {bad[0]!r}")
        with self._lock:
            with deferred_interrupts():
                for group_id in ids & self._groups.keys():
                    group = self._groups.pop(group_id)
                    ids.update(m.request_id for m in group.members)
                for request in self.scheduler.abort(ids):
                    self._requests.pop(request.request_id, None)
                    self._aborted_since_step.append(request.request_id)
                    for member in self._drop_forks(request):
                        self._aborted_since_step.append(member.request_id)
                    group = request.group
                    if group is not None and group.is_finished:  # a sample aborted by its id
                        self._groups.pop(group.request_id, None)
                errors = self.scheduler.take_errors()
            _raise_first(errors)

    def _drop_forks(self, request: Request) -> list[Request]:
        """A request ended before its parallel samples forked: they end with it."""
        forks, request.forks = request.forks, []
        for member in forks:
            member.status = request.status
            member.error = request.error
            self._requests.pop(member.request_id, None)
        return forks

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (so it cannot be reused yet)."""
        return request_id in self._requests or request_id in self._groups

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    @property
    def kv_cache(self):
        """The :class:`~llmlab.cache.kv_cache_manager.KVCacheManager` (read it, don't mutate)."""
        return self.scheduler.kv

    # -- observation -------------------------------------------------------------------

    def subscribe(self, observer: StepObserver) -> StepObserver:
        """Call ``observer(event)`` after every step; returns it (usable as a decorator).

        An observer that raises is logged (with its name) and skipped for that event; the
        step's outputs and the other observers are unaffected.
        """
        self.observers.append(observer)
        return observer

    def unsubscribe(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    def observe(self, observer: StepObserver) -> EngineSnapshot:
        """Subscribe ``observer`` and return the state it starts from, atomically.

        Applying every later event to the snapshot follows the engine exactly (no step can
        fall between the two), which is how a view attached mid-run stays right.
        """
        with self._lock:
            snapshot = self.snapshot()
            self.subscribe(observer)
        return snapshot

    def record(self, path: str | os.PathLike):
        """Record the run from now on to a JSON Lines file; returns the ``Recorder``.

        The file starts with the engine's config and an :class:`EngineSnapshot`, then has
        one line per step event (request arrivals included). Stop with ``close()`` or a
        ``with`` block; read it back with :func:`llmlab.viz.load` (``llmlab.engine.recording``).
        """
        from llmlab.engine.recording import Recorder

        return Recorder(self, path)

    def snapshot(self) -> EngineSnapshot:
        """The KV pool, block tables and queue lengths now (see :class:`EngineSnapshot`)."""
        with self._lock:
            kv = self.scheduler.kv
            cache = kv.snapshot()
            computed = {}
            for rid in cache.block_tables:
                request = self._requests.get(rid)
                computed[rid] = request.num_computed_tokens if request is not None else 0
            return EngineSnapshot(
                step_index=self._step_index,
                block_size=kv.block_size,
                num_blocks=kv.num_blocks,
                kv=cache,
                num_computed=computed,
                num_waiting=self.scheduler.num_waiting,
                num_running=len(self.scheduler.running),
                time_s=self.clock(),
            )

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + execution step; return outputs of requests that progressed.

        If a user component failed during the step, the engine's state is consistent and
        the error is raised after the step; the step's outputs are returned by the next
        call instead of being lost.
        """
        with self._lock:
            start = self.clock()
            with deferred_interrupts():
                batch = self.scheduler.schedule(start)
            output = None
            model_time = 0.0
            if not batch.is_empty:
                t0 = self.clock()
                # Interruptible: nothing is committed until update(); if it raises, the
                # same work is scheduled again next step.
                output = self.executor.execute(batch)
                model_time = self.clock() - t0
            with deferred_interrupts():
                event, errors = self._commit(batch, output, start, model_time)
            if event is not None:
                self._notify(event)
            _raise_first(errors)
            outputs, self._undelivered = self._undelivered, []
            return outputs

    def _commit(
        self, batch: ScheduledBatch, output: BatchOutput | None, start: float, model_time: float
    ) -> tuple[StepEvent | None, list[Exception]]:
        finished: list[Request] = []
        progressed: list[tuple[Request, int]] = []  # (request, outputs before this step)
        if batch.entries:
            for entry in batch.entries:
                if entry.samples:
                    progressed.append((entry.request, entry.request.num_output_tokens))
                    progressed.extend((f, 0) for f in entry.forks)
            finished = self.scheduler.update(batch, output)
        for request, before in progressed:
            if request.num_output_tokens > before and self._advance_text(request, before):
                finished.append(request)
        errors = self.scheduler.take_errors()
        failed = [
            self._requests[e.request_id]
            for e in errors
            if isinstance(e, RequestFailedError) and e.request_id in self._requests
        ]
        for request in failed:
            finished.extend(self._drop_forks(request))
        # One output per caller-visible request that progressed, in batch order.
        touched: dict[str, Request] = {}
        for request, before in progressed:
            if request.num_output_tokens > before and request not in failed:
                touched.setdefault(_caller_id(request), request)
        for request in failed:
            touched.setdefault(_caller_id(request), request)
        for request in touched.values():
            out = self._output(request)
            if out is not None:
                self._undelivered.append(out)
        for request in finished + failed:
            self._requests.pop(request.request_id, None)
            group = request.group
            if group is not None and group.is_finished:
                self._groups.pop(group.request_id, None)

        sampled = tuple(
            (r.request_id, r.num_output_tokens - before)
            for r, before in progressed
            if r.num_output_tokens > before
        )
        blocks = self.scheduler.kv.drain_events()
        event = None
        if (
            batch.entries
            or self._aborted_since_step
            or self._arrived_since_step
            or failed
            or blocks != BlockEvents()
        ):
            event = self._event(batch, finished + failed, blocks, start, model_time, sampled)
        return event, errors

    def _advance_text(self, request: Request, before: int) -> bool:
        """Feed a request's new tokens to its grammar and detokenizer; True when a stop
        string ended it now."""
        new = request.output_token_ids[before:]
        if request.grammar is not None and not request.grammar.is_terminated:
            for token_id in new:
                if not request.grammar.accept(token_id):
                    logger.warning(
                        "request %r: structured-output grammar rejected token %d",
                        request.request_id, token_id,
                    )
                    break
        detok = request.detokenizer
        if detok is None:
            return False
        # The EOS or stop token that ended it stays out of the text (vLLM v1).
        terminated = request.status is RequestStatus.FINISHED_STOPPED
        matched = detok.update(new, request.num_output_tokens, stop_terminated=terminated)
        if matched is None:
            return False
        if not request.is_finished:
            request.stop_reason = matched
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            return True
        if request.status is RequestStatus.FINISHED_LENGTH:
            # The token that reached max_tokens also completed a stop string: the text is
            # cut there, so the request stopped on the string (vLLM reports it the same way).
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = matched
        return False

    def _output(self, request: Request) -> RequestOutput | None:
        """The caller's view of ``request`` (all samples of its group), or None when its
        output kind says nothing is due yet."""
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
                if leader.num_reported_prompt_logprobs:
                    prompt_logprobs = None  # sent with the first delta
                else:
                    leader.num_reported_prompt_logprobs = len(prompt_logprobs)
        return RequestOutput(
            request_id=group.request_id if group is not None else request.request_id,
            prompt=leader.prompt,
            prompt_token_ids=leader.prompt_token_ids,
            outputs=completions,
            finished=done,
            num_cached_tokens=leader.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _completion(self, request: Request, index: int, delta: bool) -> CompletionOutput | None:
        params = request.sampling_params
        detok = request.detokenizer
        start = request.num_reported_tokens if delta else 0
        if delta and start == request.num_output_tokens and not request.is_finished:
            return None
        finished = request.is_finished
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
            request.num_reported_tokens = request.num_output_tokens
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
        return self._extend_dicts(request, request.output_logprobs, request.logprob_dicts, {})

    def _prompt_logprob_dicts(self, request: Request) -> list[dict | None]:
        """The same for the prompt (None for its first token); a copy for the output."""
        return list(self._extend_dicts(
            request, request.prompt_logprobs, request.prompt_logprob_dicts, None
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

    def _event(
        self, batch, finished, blocks, start: float, model_time: float, sampled
    ) -> StepEvent:
        kv = self.scheduler.kv
        end = self.clock()
        # One pass over the entries for every per-entry field (this runs every step).
        scheduled, users, priorities, num_computed = [], [], [], []
        num_decode = 0
        for e in batch.entries:
            request = e.request
            n = len(e.token_ids)
            scheduled.append((request.request_id, n))
            users.append(request.user)
            priorities.append(request.priority)
            num_computed.append(request.num_computed_tokens)
            # A decode is a one-token span past the prompt; everything else is prefill
            # (prompt chunks, and recomputation after preemption).
            if n == 1 and e.start >= len(request.prompt_token_ids):
                num_decode += 1
        event = StepEvent(
            step_index=self._step_index,
            scheduled=tuple(scheduled),
            scheduled_users=tuple(users),
            scheduled_priorities=tuple(priorities),
            num_batched_tokens=batch.num_batched_tokens,
            preempted=batch.preempted,
            finished=tuple((r.request_id, r.finish_reason) for r in finished),
            aborted=tuple(self._aborted_since_step),
            blocks_allocated=blocks.allocated,
            blocks_freed=blocks.freed,
            blocks_prefix_hit=blocks.prefix_hits,
            blocks_evicted=blocks.evicted,
            blocks_forked=blocks.forked,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_usage=kv.usage,
            num_waiting=self.scheduler.num_waiting,
            num_running=len(self.scheduler.running),
            wall_time_s=end - start,
            model_time_s=model_time,
            start_time_s=start,
            end_time_s=end,
            admitted=batch.admitted,
            sampled=sampled,
            arrived=tuple(self._arrived_since_step),
            num_prefill_tokens=batch.num_batched_tokens - num_decode,
            num_computed=tuple(num_computed),
            blocks_cached=blocks.cached,
            block_tables=blocks.tables,
        )
        self._aborted_since_step.clear()
        self._arrived_since_step.clear()
        if batch.entries:
            self._step_index += 1
        return event

    def _notify(self, event: StepEvent) -> None:
        for observer in list(self.observers):
            try:
                observer(event)
            except Exception:
                logger.exception(
                    "step observer %s raised on step %d; it is skipped for this event",
                    _observer_name(observer),
                    event.step_index,
                )


def _caller_id(request: Request) -> str:
    """The id the caller gave: the group's for a parallel sample."""
    return request.group.request_id if request.group is not None else request.request_id


def _observer_name(observer: object) -> str:
    name = getattr(observer, "__qualname__", None) or getattr(observer, "__name__", None)
    return repr(name) if name else component_name(observer)


def _raise_first(errors: list[Exception]) -> None:
    """Raise the first error of a step; log the others so none goes unseen."""
    if not errors:
        return
    for extra in errors[1:]:
        logger.error("also in this step: %s: %s", type(extra).__name__, extra)
    first = errors[0]
    if len(errors) > 1 and hasattr(first, "add_note"):
        first.add_note(f"({len(errors) - 1} more error(s) in the same step were logged)")
    raise first
