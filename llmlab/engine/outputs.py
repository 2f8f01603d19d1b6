"""What callers get back: vLLM-shaped ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

import attrs


@attrs.define
class CompletionOutput:
    """One generated sequence of a request.

    ``finish_reason`` is ``"stop"`` (EOS or a stop token), ``"length"`` (``max_tokens`` or
    the model's length limit), ``"abort"``, or ``None`` while still running.
    ``stop_reason`` is the stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.define
class RequestOutput:
    """The state of one request as reported by ``Engine.step`` or ``LLM.generate``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
