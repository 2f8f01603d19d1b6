"""``PoolingParams``: what a pooling request asks for (vLLM's ``vllm.pooling_params``).

A pooling request runs its prompt through the model once (prefill only, no sampling) and
returns one vector: an embedding (``task="embed"``), class probabilities
(``"classify"``), a relevance score (``"score"``), or the task's raw output (``"encode"``
on the model's default task). Fields left ``None`` take the task's default from the
engine's pooler configuration (``normalize`` is True for embeddings, ``use_activation``
True for classification and scoring).

Every field is checked when the object is built, and again on assignment, with a message
naming the field, the value and what is allowed; what only the engine knows (the model's
hidden size, its tasks) is checked when the request is added, before anything is queued.
"""

from __future__ import annotations

import functools

import attrs

from llmlab.validation import as_bool, as_int

POOLING_TASKS = ("embed", "classify", "score", "encode")
"""Tasks a pooling request may name: ``encode`` is the model's default task."""


def _task(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in POOLING_TASKS:
        kind = TypeError if not isinstance(value, str) else ValueError
        listed = ", ".join(repr(t) for t in POOLING_TASKS)
        raise kind(f"task must be None or one of {listed}, got {value!r}")
    return value


def _truncate(value: object) -> int | None:
    converted = as_int(
        "truncate_prompt_tokens", value, min=-1, allow_none=True,
        allowed="None, -1 (max_model_len) or an int >= 1",
    )
    if converted == 0:
        raise ValueError(
            "truncate_prompt_tokens must be None, -1 (max_model_len) or an int >= 1, got 0"
        )
    return converted


def _optional_bool(field: str):
    return functools.partial(as_bool, field, allow_none=True)


# attrs.define runs each field's converter on assignment too, so a changed field is
# checked as a new one is.
@attrs.define
class PoolingParams:
    """Parameters of one pooling request (vLLM's names and meanings).

    Attributes:
        truncate_prompt_tokens: keep only the last this-many prompt tokens (-1: up to
            ``max_model_len``); None keeps the whole prompt (which must fit).
        dimensions: Matryoshka truncation of an embedding: keep its first ``dimensions``
            values (before normalizing); None keeps all. At most the model's hidden size.
        normalize: L2-normalize an embedding; None takes the pooler's default (True for
            embedding models unless their config says otherwise).
        use_activation: for classification and scoring, apply the activation (softmax over
            the labels, or sigmoid for a single label); None takes the default (True).
            ``softmax`` and ``activation`` are vLLM's older names for it.
        task: ``"embed"``, ``"classify"``, ``"score"`` or ``"encode"``; None: what the
            call sets (``LLM.embed`` sets ``"embed"`` ...), else the model's default task.
    """

    truncate_prompt_tokens: int | None = attrs.field(default=None, converter=_truncate)
    dimensions: int | None = attrs.field(
        default=None,
        converter=functools.partial(as_int, "dimensions", min=1, allow_none=True),
    )
    normalize: bool | None = attrs.field(default=None, converter=_optional_bool("normalize"))
    use_activation: bool | None = attrs.field(
        default=None, converter=_optional_bool("use_activation")
    )
    task: str | None = attrs.field(default=None, converter=_task)
    # vLLM's older spellings of use_activation; merged into it at construction.
    softmax: bool | None = attrs.field(
        default=None, converter=_optional_bool("softmax"), repr=False
    )
    activation: bool | None = attrs.field(
        default=None, converter=_optional_bool("activation"), repr=False
    )

    def __attrs_post_init__(self) -> None:
        given = {
            name: value
            for name in ("use_activation", "softmax", "activation")
            if (value := getattr(self, name)) is not None
        }
        if len(set(given.values())) > 1:
            raise ValueError(
                f"use_activation, softmax and activation are one setting (the latter two are "
                f"vLLM's older names) and disagree: {given}; pass only use_activation"
            )
        if given and self.use_activation is None:
            self.use_activation = next(iter(given.values()))
        self.softmax = self.activation = None

    def clone(self) -> PoolingParams:
        """A copy (vLLM's ``clone``)."""
        return attrs.evolve(self)

    def with_defaults(self, *, task: str, normalize: bool, use_activation: bool) -> PoolingParams:
        """A copy with ``task`` set where None, and the task defaults filled in (what the
        engine keeps: a request's own copy, so later changes to this object do not reach
        it)."""
        return attrs.evolve(
            self,
            task=self.task or task,
            normalize=normalize if self.normalize is None else self.normalize,
            use_activation=(
                use_activation if self.use_activation is None else self.use_activation
            ),
        )


__all__ = ["POOLING_TASKS", "PoolingParams"]
