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
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from llmlab.cache.kv_cache_manager import BlockEvents
from llmlab.config import EngineConfig
from llmlab.engine.events import StepEvent, StepObserver
from llmlab.engine.executor import Clock, Executor, real_clock
from llmlab.engine.interrupts import deferred_interrupts
from llmlab.engine.outputs import CompletionOutput, RequestOutput
from llmlab.errors import RequestFailedError, component_name
from llmlab.request import Request
from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch
from llmlab.scheduler.scheduler import Scheduler
from llmlab.validation import as_int, as_real, as_token_ids

logger = logging.getLogger(__name__)

PromptType = str | dict | Sequence[int]

_PROMPT_KEYS = ("prompt", "prompt_token_ids")


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
    _requests: dict[str, Request] = attrs.field(factory=dict)
    _step_index: int = 0
    _aborted_since_step: list[str] = attrs.field(factory=list)
    # Outputs built but not yet returned (a step that raised after updating requests).
    _undelivered: list[RequestOutput] = attrs.field(factory=list)
    _lock: threading.RLock = attrs.field(factory=threading.RLock)

    @property
    def runner(self) -> Executor:
        """The executor (kept under the name the model runner had)."""
        return self.executor

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
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, longer than max_model_len="
                f"{self.max_model_len}"
            )
        for tok in params.stop_token_ids:
            if tok >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {tok}, outside the vocabulary [0, {self.vocab_size})"
                )
        with self._lock, deferred_interrupts():
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            request = Request(
                request_id=request_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                arrival_time=self.clock() if arrival_time is None else arrival_time,
                priority=priority,
                user=user,
                prompt=text,
                eos_token_ids=self.eos_token_ids,
            )
            self._requests[request_id] = request
            self.scheduler.add(request)

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
                for request in self.scheduler.abort(ids):
                    self._requests.pop(request.request_id, None)
                    self._aborted_since_step.append(request.request_id)
                errors = self.scheduler.take_errors()
            _raise_first(errors)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (so it cannot be reused yet)."""
        return request_id in self._requests

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
        if batch.entries:
            finished = self.scheduler.update(batch, output)
        errors = self.scheduler.take_errors()
        failed = [
            self._requests[e.request_id]
            for e in errors
            if isinstance(e, RequestFailedError) and e.request_id in self._requests
        ]
        for entry in batch.entries:
            request = entry.request
            if not entry.samples or request in failed:
                continue
            kind = request.sampling_params.output_kind
            if request.is_finished or kind is RequestOutputKind.CUMULATIVE:
                self._undelivered.append(self._output(request))
        for request in failed:
            self._undelivered.append(self._output(request))
        for request in finished + failed:
            self._requests.pop(request.request_id, None)

        blocks = self.scheduler.kv.drain_events()
        event = None
        if batch.entries or self._aborted_since_step or failed or blocks != BlockEvents():
            event = self._event(batch, finished + failed, blocks, start, model_time)
        return event, errors

    def _output(self, request: Request) -> RequestOutput:
        params = request.sampling_params
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(
                request.output_token_ids, skip_special_tokens=params.skip_special_tokens
            )
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=request.is_finished,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _event(self, batch, finished, blocks, start: float, model_time: float) -> StepEvent:
        kv = self.scheduler.kv
        event = StepEvent(
            step_index=self._step_index,
            scheduled=tuple((e.request_id, e.num_new_tokens) for e in batch.entries),
            scheduled_users=tuple(e.request.user for e in batch.entries),
            scheduled_priorities=tuple(e.request.priority for e in batch.entries),
            num_batched_tokens=batch.num_batched_tokens,
            preempted=batch.preempted,
            finished=tuple((r.request_id, r.finish_reason) for r in finished),
            aborted=tuple(self._aborted_since_step),
            blocks_allocated=blocks.allocated,
            blocks_freed=blocks.freed,
            blocks_prefix_hit=blocks.prefix_hits,
            blocks_evicted=blocks.evicted,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            kv_usage=kv.usage,
            num_waiting=self.scheduler.num_waiting,
            num_running=len(self.scheduler.running),
            wall_time_s=self.clock() - start,
            model_time_s=model_time,
        )
        self._aborted_since_step.clear()
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
