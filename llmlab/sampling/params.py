"""``SamplingParams``: how one request's tokens are chosen and when it stops (vLLM names)."""

from __future__ import annotations

import enum
import functools
import logging

import attrs

from llmlab.validation import as_bool, as_int, as_real, as_seed, as_token_ids


class RequestOutputKind(enum.Enum):
    """What ``Engine.step`` reports for a request: everything so far, or only the end."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


logger = logging.getLogger(__name__)

# Below this, logits / temperature overflows to inf and softmax gives NaN (vLLM's _MAX_TEMP
# guard): such a temperature is raised to this one, which is already all but greedy.
MIN_TEMPERATURE = 1e-2


def _temperature(value: object) -> float:
    t = as_real("temperature", value, min=0, allowed=">= 0 (0 means greedy)")
    if 0 < t < MIN_TEMPERATURE:
        logger.warning(
            "temperature=%r is below %r and would overflow the logits; using %r",
            t, MIN_TEMPERATURE, MIN_TEMPERATURE,
        )
        return MIN_TEMPERATURE
    return t


def _stop_token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (set, frozenset)):
        value = list(value)  # order does not matter for stop ids, unlike for a prompt
    return tuple(as_token_ids("stop_token_ids", value))


def _output_kind(value: object) -> RequestOutputKind:
    if not isinstance(value, RequestOutputKind):
        kinds = ", ".join(f"RequestOutputKind.{k.name}" for k in RequestOutputKind)
        raise TypeError(f"output_kind must be one of {kinds}, got {type(value).__name__} {value!r}")
    return value


def _validate(params: SamplingParams) -> None:
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise ValueError(
            f"min_tokens must be <= max_tokens ({params.max_tokens}), got {params.min_tokens!r}"
        )


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling and stopping parameters of one request, validated at construction.

    A wrong type is a ``TypeError`` (``max_tokens=2.5`` or ``top_k=True`` included: ints
    must be integers, and numpy or torch integer scalars become plain ints); a value out
    of range, NaN or infinity is a ``ValueError``. Either message names the field.

    Attributes:
        temperature: softmax temperature, >= 0; 0 selects the most likely token (greedy).
            A positive value below 1e-2 would overflow the logits, so (as in vLLM) it is
            raised to 1e-2 with a warning.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps all, and so does a
            value beyond the vocabulary.
        min_p: drop tokens less likely than ``min_p`` times the most likely one; in [0, 1].
        seed: per-request random seed in [-2**63, 2**64); the same seed gives the same
            tokens whatever else is in the batch. ``None`` draws from the engine's
            generator (seeded by ``LLM(seed=...)``).
        max_tokens: most tokens to generate, >= 1; ``None`` runs to the model's length limit.
        min_tokens: EOS and ``stop_token_ids`` are suppressed until this many tokens exist;
            at most ``max_tokens``.
        stop_token_ids: extra token ids that end generation (kept in the output); any
            iterable of non-negative ints, stored as a tuple. The engine checks them
            against the vocabulary.
        ignore_eos: keep generating past the EOS token.
        skip_special_tokens: drop special tokens when detokenizing.
        output_kind: report every step (CUMULATIVE) or only the finished output.
    """

    temperature: float = attrs.field(default=1.0, converter=_temperature)
    top_p: float = attrs.field(
        default=1.0,
        converter=functools.partial(as_real, "top_p", min=0, min_inclusive=False, max=1),
    )
    top_k: int = attrs.field(
        default=0,
        converter=functools.partial(
            as_int, "top_k", min=-1, allowed="-1 or 0 (disabled) or a positive integer"
        ),
    )
    min_p: float = attrs.field(
        default=0.0, converter=functools.partial(as_real, "min_p", min=0, max=1)
    )
    seed: int | None = attrs.field(
        default=None, converter=functools.partial(as_seed, "seed", allow_none=True)
    )
    max_tokens: int | None = attrs.field(
        default=16, converter=functools.partial(as_int, "max_tokens", min=1, allow_none=True)
    )
    min_tokens: int = attrs.field(
        default=0, converter=functools.partial(as_int, "min_tokens", min=0)
    )
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_token_ids)
    ignore_eos: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "ignore_eos")
    )
    skip_special_tokens: bool = attrs.field(
        default=True, converter=functools.partial(as_bool, "skip_special_tokens")
    )
    output_kind: RequestOutputKind = attrs.field(
        default=RequestOutputKind.CUMULATIVE, converter=_output_kind
    )

    def __attrs_post_init__(self) -> None:
        _validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
