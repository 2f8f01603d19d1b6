"""``Engine``: add requests, step, read outputs (the shape of vLLM's ``LLMEngine``).

One ``step()`` is: schedule -> execute the batch (an :class:`~llmlab.runner.executor.Executor`;
the model runner for a real model) -> commit (the scheduler appends the new tokens and
decides what finished; output processing finds stop strings and builds outputs) -> emit
one :class:`~llmlab.observe.events.StepEvent` -> return outputs. Build one with
:class:`~llmlab.engine.builder.EngineBuilder` (or ``LLM(...)``).

It joins three parts, each the only writer of its facts: input processing
(:mod:`llmlab.engine.intake`, :mod:`llmlab.engine.inputs`), the scheduler (lifecycles, KV
blocks, rows) and output processing (:mod:`llmlab.engine.output_processor`); the executor
gets plain data and writes nothing of the engine's. Bookkeeping runs with Ctrl-C deferred;
failing user components are raised after the step as
:class:`~llmlab.errors.ComponentError`; steps are serialized across threads.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from llmlab.config import EngineConfig
from llmlab.engine.assembly import assemble
from llmlab.observe.events import (
    Arrival,
    StepEvent,
    StepObserver,
    notify,
)
from llmlab.observe.observable import Observable
from llmlab.runner.executor import Clock, Executor, real_clock
from llmlab.engine.inputs import InputProcessor, PreparedRequest, PromptType
from llmlab.engine.intake import Intake
from llmlab.engine.interrupts import deferred_interrupts
from llmlab.engine.output_processor import OutputProcessor
from llmlab.engine.overlap import overlap_for
from llmlab.engine.outputs import RequestOutput
from llmlab.errors import RequestFailedError, raise_first
from llmlab.lora.store import AdapterStore
from llmlab.pooling.task import PoolingSpec
from llmlab.request import Request
from llmlab.sampling.metadata import GrammarFactory
from llmlab.sampling.params import SamplingParams
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch
from llmlab.scheduler.scheduler import Scheduler

__all__ = ["Engine", "PreparedRequest", "PromptType"]


@attrs.define
class Engine(Intake, Observable):
    """Continuous-batching inference engine over a paged KV cache.

    Attributes:
        executor: runs each scheduled batch (``ModelRunner`` for a real model).
        clock: where time comes from (``time.monotonic``; a ``VirtualClock`` in simulation).
        inputs: checks and tokenizes requests (built from the other fields by default).
        outputs: text, stop strings and ``RequestOutput`` building.
    """

    config: EngineConfig
    scheduler: Scheduler
    executor: Executor
    tokenizer: Any | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    clock: Clock = real_clock
    # Used when given no SamplingParams: the checkpoint's generation_config.json (vLLM's).
    default_sampling_params: SamplingParams = attrs.field(factory=SamplingParams)
    observers: list[StepObserver] = attrs.field(factory=list)
    max_logprobs: int = 20  # most logprobs a request may ask for (-1: no limit)
    grammars: GrammarFactory | None = None  # shared with the executor: one compile cache
    # A pooling engine's tasks and defaults (runner="pooling"), or None (it generates).
    pooling: PoolingSpec | None = None
    # enable_lora: the adapters in host memory, shared by input processing and the runner.
    lora: AdapterStore | None = None
    inputs: InputProcessor = attrs.field(default=None)
    outputs: OutputProcessor = attrs.field(default=None)
    # Live requests by their own id (a parallel sample's id is ``f"{index}_{request_id}"``).
    _requests: dict[str, Any] = attrs.field(factory=dict)
    # Requests with n > 1 or best_of > 1, by the id the caller gave.
    _groups: dict[str, Any] = attrs.field(factory=dict)
    _step_index: int = 0
    _aborted_since_step: list[str] = attrs.field(factory=list)
    _arrived_since_step: list[Arrival] = attrs.field(factory=list)
    # Outputs not yet returned (a step that raised after updating requests).
    _undelivered: list[RequestOutput] = attrs.field(factory=list)
    _lock: threading.RLock = attrs.field(factory=threading.RLock)
    # Overlapped scheduling (EngineConfig.async_scheduling), or None: synchronous steps.
    overlap: Any = None

    def __attrs_post_init__(self) -> None:
        if self.grammars is None and self.tokenizer is not None:
            self.grammars = GrammarFactory(self.tokenizer, self.vocab_size, self.eos_token_ids)
        if self.inputs is None:
            self.inputs = InputProcessor.of(self)
        if self.outputs is None:
            self.outputs = OutputProcessor(self.tokenizer)
        if self.overlap is None:
            self.overlap = overlap_for(self)

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> Engine:
        """vLLM's ``LLMEngine.from_engine_args``: the engine an
        :class:`~llmlab.entrypoints.arg_utils.EngineArgs` describes (one replica; for
        ``data_parallel_size > 1`` use ``LLM`` or ``AsyncEngine``)."""
        config = engine_args.create_engine_config()
        if config.data_parallel_size > 1:
            raise ValueError(
                "Engine.from_engine_args builds one replica; data_parallel_size="
                f"{config.data_parallel_size} needs LLM(**vars(args)) or "
                "AsyncEngine.from_engine_args(args)"
            )
        return cls(**assemble(config))

    @property
    def is_alive(self) -> bool:
        """False once the executor can never run another step (a tensor-parallel rank
        died: :class:`~llmlab.errors.ExecutorDeadError`); :meth:`dead_reason` says why."""
        return getattr(self.executor, "dead", None) is None

    def dead_reason(self) -> str:
        return str(getattr(self.executor, "dead", None) or "the engine is alive")

    def shutdown(self) -> None:
        """Stop what the executor started (tensor-parallel worker processes or actors) and
        the grammar compiles (their processes, and callers waiting for them); safe to call
        twice."""
        if self.overlap is not None:
            self.overlap.shutdown()
        if self.grammars is not None:
            self.grammars.close()
        close = getattr(self.executor, "shutdown", None)
        if callable(close):
            close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0  # a batch in flight then holds only waste

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    @property
    def kv_cache(self):
        """The :class:`~llmlab.cache.kv_cache_manager.KVCacheManager` (read it, don't mutate)."""
        return self.scheduler.kv

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + execution step; return outputs of requests that progressed.

        If a user component failed during the step, the engine's state is consistent and
        the error is raised after the step; the step's outputs are returned by the next
        call instead of being lost. Overlapped (:mod:`.overlap`): the next batch is planned
        and started before this one's outputs are committed."""
        if self.overlap is not None:
            return self.overlap.step()
        with self._lock:
            start = self.clock()
            with deferred_interrupts():
                batch = self.scheduler.schedule(start)
            output, model_time = None, 0.0
            if not batch.is_empty:
                t0 = self.clock()
                # Interruptible: nothing is committed until update(); if it raises, the
                # same work is scheduled again next step, with every row's setup (the
                # executor dropped its per-row state).
                try:
                    output = self.executor.execute(batch)
                except BaseException:
                    self.scheduler.resend_rows()
                    raise
                model_time = self.clock() - t0
            return self._deliver(batch, output, start, model_time)

    def _deliver(self, batch: ScheduledBatch, output: BatchOutput | None, start: float,
                 model_time: float, told: ScheduledBatch | None = None) -> list[RequestOutput]:
        """Commit an executed batch, tell the observers, raise what failed, return outputs.
        ``told``: the batch as its step event tells it (overlapped: :mod:`.overlap`)."""
        with deferred_interrupts():
            event, errors = self._commit(batch, output, start, model_time, told)
        if event is not None:
            notify(self.observers, event)
        raise_first(errors)
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _commit(self, batch: ScheduledBatch, output: BatchOutput | None, start: float,
                model_time: float, told: ScheduledBatch | None = None,
                ) -> tuple[StepEvent | None, list[Exception]]:
        requests = self._requests
        finished: list[Request] = []
        progressed: list[tuple[Request, int]] = []  # (request, outputs before this step)
        # The batch's requests as scheduled (one that ended while it ran is in it still).
        batch_requests = self.scheduler.requests_of(batch)
        for entry in batch.entries:
            request = batch_requests[entry.request_id]
            if entry.num_scored:
                progressed.append((request, len(request.output_token_ids)))
                if entry.forks:
                    progressed.extend((batch_requests[f.request_id], 0) for f in entry.forks)
        if batch.entries:
            finished = self.scheduler.update(batch, output)
        for request, before in progressed if self.tokenizer is not None else ():
            if len(request.output_token_ids) > before:
                matched = self.outputs.stop_string(request, before)
                if matched is not None and self.scheduler.stop_string(request, matched):
                    finished.append(request)
        errors = self.scheduler.take_errors()
        failed = [
            requests[e.request_id]
            for e in errors
            if isinstance(e, RequestFailedError) and e.request_id in requests
        ]
        for request in failed:
            finished.extend(self._drop_forks(request))
        self.outputs.stamp(batch_requests.values(), progressed, finished + failed, start,
                           self.clock())
        pooled = [r for r in finished if r.pooling_params is not None]
        self._undelivered.extend(self.outputs.outputs(progressed, failed, pooled))
        for request in finished + failed:
            self._forget(request)

        event = self._step_event(batch if told is None else told, output, batch_requests,
                                 finished + failed, progressed, bool(failed), start, model_time)
        return event, errors

    def _forget(self, request: Request) -> None:
        """A request ended: drop it, and its group's output state once all samples ended."""
        self._requests.pop(request.request_id, None)
        group = request.group
        if group is None:
            self.outputs.forget(request)
        elif group.is_finished:
            self._groups.pop(group.request_id, None)
            for member in group.members:
                self.outputs.forget(member)
