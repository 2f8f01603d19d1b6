"""``Engine``: add requests, step, read outputs (the shape of vLLM's ``LLMEngine``).

One ``step()`` is: schedule -> run the model on the batch -> sample -> update requests ->
emit one :class:`~llmlab.engine.events.StepEvent` -> return outputs. Build one with
:class:`~llmlab.engine.builder.EngineBuilder` (or ``LLM(...)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from llmlab.cache.kv_cache_manager import BlockEvents
from llmlab.config import EngineConfig
from llmlab.engine.events import StepEvent, StepObserver
from llmlab.engine.model_runner import ModelRunner
from llmlab.engine.outputs import CompletionOutput, RequestOutput
from llmlab.request import Request
from llmlab.sampling.params import RequestOutputKind, SamplingParams
from llmlab.scheduler.scheduler import Scheduler

PromptType = str | dict | Sequence[int]


@attrs.define
class Engine:
    """Continuous-batching inference engine over a paged KV cache."""

    config: EngineConfig
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Any | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    observers: list[StepObserver] = attrs.field(factory=list)
    _requests: dict[str, Request] = attrs.field(factory=dict)
    _step_index: int = 0
    _aborted_since_step: list[str] = attrs.field(factory=list)

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request. Raises ``ValueError`` (and queues nothing) on bad input.

        ``prompt`` is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a
        list of token ids.
        """
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        self._validate_tokens(token_ids)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.runner.device)
            generator.manual_seed(params.seed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority,
            prompt=text,
            eos_token_ids=self.eos_token_ids,
            generator=generator,
        )
        self._requests[request_id] = request
        self.scheduler.add(request)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(
                    f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: it must contain at least one character")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, Sequence):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a str, a dict or a list of token ids, got {type(prompt).__name__}"
        )

    def _validate_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, longer than max_model_len="
                f"{self.max_model_len}"
            )
        for tok in token_ids:
            if not isinstance(tok, int) or not 0 <= tok < self.vocab_size:
                raise ValueError(
                    f"prompt token id {tok!r} is outside the vocabulary [0, {self.vocab_size})"
                )

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are and free their KV blocks. Unknown ids are ignored."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for request in self.scheduler.abort(ids):
            self._requests.pop(request.request_id, None)
            self._aborted_since_step.append(request.request_id)

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
        """Call ``observer(event)`` after every step; returns it (usable as a decorator)."""
        self.observers.append(observer)
        return observer

    def unsubscribe(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step; return outputs of requests that progressed."""
        start = time.perf_counter()
        batch = self.scheduler.schedule(time.monotonic())
        model_time = 0.0
        finished: list[Request] = []
        if batch.entries:
            t0 = time.perf_counter()
            sampled = self.runner.execute(batch)
            model_time = time.perf_counter() - t0
            finished = self.scheduler.update(batch, sampled)

        outputs = []
        for entry in batch.entries:
            request = entry.request
            if not entry.samples:
                continue
            kind = request.sampling_params.output_kind
            if request.is_finished or kind is RequestOutputKind.CUMULATIVE:
                outputs.append(self._output(request))
        for request in finished:
            self._requests.pop(request.request_id, None)

        blocks = self.scheduler.kv.drain_events()
        if batch.entries or self._aborted_since_step or blocks != BlockEvents():
            self._emit(batch, finished, blocks, start, model_time)
        return outputs

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

    def _emit(self, batch, finished, blocks, start: float, model_time: float) -> None:
        kv = self.scheduler.kv
        event = StepEvent(
            step_index=self._step_index,
            scheduled=tuple((e.request.request_id, e.num_new_tokens) for e in batch.entries),
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
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            wall_time_s=time.perf_counter() - start,
            model_time_s=model_time,
        )
        self._aborted_since_step.clear()
        if batch.entries:
            self._step_index += 1
        for observer in list(self.observers):
            observer(event)
