"""A request's lifetime state: owned by the scheduler, read by everything below the engine.

This module sits below the engine, scheduler, cache and sampler (it imports only
``SamplingParams``), so those packages import it downward and never reach into the engine.
"""

from __future__ import annotations

import enum

import attrs
import torch

from llmlab.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@attrs.define(eq=False)
class Request:
    """One generation request.

    ``all_token_ids`` is prompt + output so far. ``num_computed_tokens`` counts the leading
    tokens whose KV is in the cache; a request is in prefill while it is below
    ``num_tokens - 1`` and decoding after. Preemption by recompute resets it to 0 and keeps
    the generated tokens, which are then prefilled again with the prompt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    prompt: str | None = None
    # Tokens that end generation unless ``ignore_eos``: the tokenizer's EOS plus any the
    # checkpoint's generation_config lists (e.g. Llama 3 instruct's end-of-turn token).
    eos_token_ids: frozenset[int] = frozenset()
    # The request's own random stream when ``sampling_params.seed`` is set; the sampler
    # creates it on the logits' device at the first draw and it lives with the request, so
    # a preempted request continues its stream.
    generator: torch.Generator | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = attrs.field(factory=list)
    all_token_ids: list[int] = attrs.field(init=False)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when the request was first admitted.
    num_cached_tokens: int = 0
    stop_reason: int | None = None
    # Chained hashes of this request's full blocks, computed once and kept across
    # preemptions (the tokens they cover never change).
    block_hashes: list[int] = attrs.field(factory=list)
    # Scheduler row while admitted (None while waiting or finished); see scheduler.batch.
    row: int | None = None
    # Why the engine ended the request itself (e.g. it can never fit the KV cache).
    error: str | None = None

    def __attrs_post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def append_output(self, token_id: int, logprob: float) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.cumulative_logprob += logprob
