"""What callers get back: vLLM-shaped ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

import attrs

from llmlab.sampling.logprobs import Logprob

# One position's logprobs: the chosen token and the top-k, each with its rank.
PositionLogprobs = dict[int, Logprob]


@attrs.define
class CompletionOutput:
    """One generated sequence of a request.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
    (``max_tokens`` or the model's length limit), ``"abort"``, or ``None`` while running.
    ``stop_reason`` is the stop token id or stop string that ended it (None for EOS).
    ``cumulative_logprob`` and ``logprobs`` are filled only when the request asked for
    ``logprobs``: one ``{token_id: Logprob}`` per generated token (the sampled token plus
    the top ``logprobs``). With ``RequestOutputKind.DELTA``, ``text``, ``token_ids`` and
    ``logprobs`` hold only what is new since the previous output.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestMetrics:
    """vLLM's ``RequestMetrics``: when a request reached each stage, in seconds of the
    engine's clock (``time.monotonic`` by default; a virtual clock in simulation). A stage
    not reached yet is None.

    Attributes:
        arrival_time: when the request was added (or the ``arrival_time`` it was given).
        last_token_time: when its latest token was generated.
        first_scheduled_time: the start of the first step that scheduled it.
        first_token_time: when its first token was generated.
        time_in_queue: ``first_scheduled_time - arrival_time``.
        finished_time: when it finished (every sample, for ``n`` / ``best_of`` > 1).
        scheduler_time, model_forward_time, model_execute_time: vLLM's; not measured per
            request here (None).
    """

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@attrs.define
class RequestOutput:
    """The state of one request as reported by ``Engine.step`` or ``LLM.generate``.

    ``outputs`` holds the ``n`` completions by index (the ``n`` best by cumulative logprob,
    best first, when ``best_of > n``). ``prompt_logprobs`` (when asked for) has one entry
    per prompt token, None for the first. ``metrics`` (vLLM's :class:`RequestMetrics`)
    says when the request arrived, was first scheduled, got its first and latest token and
    finished (None where not known, e.g. for an output built without an engine).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
