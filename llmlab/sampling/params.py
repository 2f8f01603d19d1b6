"""``SamplingParams``: how one request's tokens are chosen and when it stops (vLLM names)."""

from __future__ import annotations

import enum

import attrs


class RequestOutputKind(enum.Enum):
    """What ``Engine.step`` reports for a request: everything so far, or only the end."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


def _check(condition: bool, field: str, value: object, allowed: str) -> None:
    if not condition:
        raise ValueError(f"{field} must be {allowed}, got {value!r}")


def _validate(params: SamplingParams) -> None:
    t = params.temperature
    _check(t >= 0, "temperature", t, ">= 0 (0 means greedy)")
    _check(0 < params.top_p <= 1, "top_p", params.top_p, "in (0, 1]")
    k = params.top_k
    _check(k == -1 or k >= 0, "top_k", k, "-1 or 0 (disabled) or a positive integer")
    _check(0 <= params.min_p <= 1, "min_p", params.min_p, "in [0, 1]")
    if params.max_tokens is not None:
        _check(params.max_tokens >= 1, "max_tokens", params.max_tokens, ">= 1")
    _check(params.min_tokens >= 0, "min_tokens", params.min_tokens, ">= 0")
    if params.max_tokens is not None:
        _check(
            params.min_tokens <= params.max_tokens,
            "min_tokens",
            params.min_tokens,
            f"<= max_tokens ({params.max_tokens})",
        )
    if params.seed is not None:
        _check(isinstance(params.seed, int), "seed", params.seed, "an int or None")
    for tok in params.stop_token_ids:
        _check(isinstance(tok, int) and tok >= 0, "stop_token_ids", tok, "non-negative ints")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling and stopping parameters of one request, validated at construction.

    Attributes:
        temperature: softmax temperature; 0 selects the most likely token (greedy).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens; 0 or -1 keeps all.
        min_p: drop tokens less likely than ``min_p`` times the most likely one.
        seed: per-request random seed; the same seed gives the same tokens whatever else
            is in the batch. ``None`` draws from the engine's generator (seeded by
            ``LLM(seed=...)``).
        max_tokens: most tokens to generate; ``None`` runs to the model's length limit.
        min_tokens: EOS and ``stop_token_ids`` are suppressed until this many tokens exist.
        stop_token_ids: extra token ids that end generation (kept in the output).
        ignore_eos: keep generating past the EOS token.
        skip_special_tokens: drop special tokens when detokenizing.
        output_kind: report every step (CUMULATIVE) or only the finished output.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=lambda v: tuple(v) if v is not None else ()
    )
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __attrs_post_init__(self) -> None:
        _validate(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
