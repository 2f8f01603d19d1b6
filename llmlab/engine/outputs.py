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
class RequestOutput:
    """The state of one request as reported by ``Engine.step`` or ``LLM.generate``.

    ``outputs`` holds the ``n`` completions by index (the ``n`` best by cumulative logprob,
    best first, when ``best_of > n``). ``prompt_logprobs`` (when asked for) has one entry
    per prompt token, None for the first.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
