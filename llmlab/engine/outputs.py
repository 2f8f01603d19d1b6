"""What callers get back: vLLM-shaped ``RequestOutput`` and ``CompletionOutput``."""

from __future__ import annotations

from typing import Any

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

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Fold the request's next output into this one (vLLM's ``RequestOutput.add``).

        ``aggregate``: both are DELTA outputs, so each completion's text, token ids and
        logprobs are appended; otherwise a completion is replaced by its newer self. The
        latest finish and stop reasons, cumulative logprob, metrics and ``finished`` win;
        the prompt's logprobs (sent with a stream's first output) are kept.
        """
        self.finished = self.finished or next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                self.outputs.append(new)
                by_index[new.index] = len(self.outputs) - 1
            elif not aggregate:
                self.outputs[i] = new
            else:
                old = self.outputs[i]
                logprobs = old.logprobs
                if new.logprobs is not None:
                    logprobs = new.logprobs if logprobs is None else logprobs + new.logprobs
                self.outputs[i] = CompletionOutput(
                    index=old.index, text=old.text + new.text,
                    token_ids=old.token_ids + new.token_ids,
                    cumulative_logprob=new.cumulative_logprob, logprobs=logprobs,
                    finish_reason=new.finish_reason, stop_reason=new.stop_reason,
                )


# -- pooling outputs (vLLM's shapes) ------------------------------------------------------


@attrs.define
class PoolingOutput:
    """The output of one pooling request: ``data``, a 1-D float32 tensor (an embedding,
    class probabilities or a one-element score, as the request's task made it)."""

    data: Any


@attrs.define
class PoolingRequestOutput:
    """A pooling request's result (vLLM's ``PoolingRequestOutput``): ``outputs`` is a
    :class:`PoolingOutput` (or, from ``LLM.embed`` / ``classify`` / ``score``, the task's
    own output type); ``finished`` is True (a pooling request reports once, when done).
    ``num_cached_tokens``: prompt tokens served from the prefix cache."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None

    def _as(self, cls: type, outputs: Any) -> Any:
        return cls(
            request_id=self.request_id, outputs=outputs, prompt_token_ids=self.prompt_token_ids,
            finished=self.finished, num_cached_tokens=self.num_cached_tokens,
            prompt=self.prompt, metrics=self.metrics,
        )


@attrs.define
class EmbeddingOutput:
    """An embedding (vLLM's): ``embedding`` as a list of floats."""

    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@attrs.define
class ClassificationOutput:
    """Class probabilities (vLLM's): ``probs``, one per label (logits when the request
    set ``use_activation=False``)."""

    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ClassificationOutput:
        return cls(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@attrs.define
class ScoringOutput:
    """A relevance score (vLLM's): a cross-encoder's sigmoid output, or the cosine
    similarity of two embeddings."""

    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> ScoringOutput:
        data = output.data
        if data.numel() != 1:
            raise ValueError(f"a score is one number; the pooled output has {data.numel()}")
        return cls(float(data.reshape(()).item()))


@attrs.define
class EmbeddingRequestOutput(PoolingRequestOutput):
    """``LLM.embed``'s result: ``outputs`` is an :class:`EmbeddingOutput`."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return output._as(cls, EmbeddingOutput.from_base(output.outputs))


@attrs.define
class ClassificationRequestOutput(PoolingRequestOutput):
    """``LLM.classify``'s result: ``outputs`` is a :class:`ClassificationOutput`."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return output._as(cls, ClassificationOutput.from_base(output.outputs))


@attrs.define
class ScoringRequestOutput(PoolingRequestOutput):
    """``LLM.score``'s result: ``outputs`` is a :class:`ScoringOutput`."""

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ScoringRequestOutput:
        return output._as(cls, ScoringOutput.from_base(output.outputs))
