"""How many tokens to draft: the speculation-length component, chosen each step.

``lengths(candidates, num_running) -> [k, ...]``: one lookahead per candidate (a running
decode, as a read-only :class:`~llmlab.request.RequestView`), each in
``[0, num_speculative_tokens]``; 0 means that request decodes plainly this step. The
scheduler asks once per step, before it budgets the step, so the answer can depend on the
batch size. A policy that also defines ``observe(event)`` is subscribed to the engine's
step events (what was drafted and accepted, how long steps took): that is how
:class:`AdaptiveLength` learns.

Built-ins: :class:`FixedLength` (always ``k``), :class:`BatchSizeLength` (``k`` by batch
size, vLLM's ``num_speculative_tokens_per_batch_size``) and :class:`AdaptiveLength` (the
default: drafts only as far as the measured acceptance pays for the verification cost).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np


def _at_least_one(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@runtime_checkable
class SpeculationLength(Protocol):
    """Per-step lookahead of each running decode (see the module)."""

    num_speculative_tokens: int

    def lengths(self, candidates: Sequence[Any], num_running: int) -> Sequence[int]: ...


@attrs.define
class FixedLength:
    """Every decode drafts ``num_speculative_tokens`` tokens, every step."""

    num_speculative_tokens: int = attrs.field(validator=_at_least_one)

    def lengths(self, candidates: Sequence[Any], num_running: int) -> list[int]:
        return [self.num_speculative_tokens] * len(candidates)


def _as_table(value: Any) -> tuple[tuple[int, int], ...]:
    """``{batch_size: k}`` or ``[(batch_size, k), ...]`` as sorted pairs, checked."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        table = tuple(sorted((int(b), int(k)) for b, k in pairs))
    except (TypeError, ValueError):
        raise ValueError(
            "num_speculative_tokens_per_batch_size must map batch sizes to token counts, "
            f"e.g. {{1: 4, 16: 2, 64: 0}}; got {value!r}"
        ) from None
    if not table or any(b < 1 or k < 0 for b, k in table):
        raise ValueError(
            "num_speculative_tokens_per_batch_size needs batch sizes >= 1 and token counts "
            f">= 0; got {value!r}"
        )
    return table


@attrs.define
class BatchSizeLength:
    """``k`` by the number of running requests: the entry with the smallest batch size at
    or above the current one (``{1: 4, 8: 2, 32: 1}``: 4 tokens up to batch 1, 2 up to 8,
    1 up to 32, none beyond). vLLM's ``num_speculative_tokens_per_batch_size``."""

    num_speculative_tokens: int = attrs.field(validator=_at_least_one)
    table: tuple[tuple[int, int], ...] = attrs.field(converter=_as_table)

    def lengths(self, candidates: Sequence[Any], num_running: int) -> list[int]:
        k = 0
        for batch_size, tokens in self.table:
            if num_running <= batch_size:
                k = tokens
                break
        return [min(k, self.num_speculative_tokens)] * len(candidates)


@attrs.define
class AdaptiveLength:
    """Drafts as far as measured acceptance pays for the verification cost (the default).

    Two things are measured from the step events:

    * each request's acceptance: a draft of ``m`` tokens with ``a`` accepted is ``a``
      successes in ``a + (a < m)`` trials of a per-token acceptance ``alpha``; a request's
      estimate starts from the engine-wide one (``prior_weight`` trials of it);
    * what a step costs: ``time = c0 + c1 * tokens`` (tokens computed: scheduled plus
      drafted), fitted by least squares over the last ``window`` steps.

    A draft's ``j``-th token yields an extra token with probability ``alpha ** j`` and
    costs ``c1``; the step without drafts yields ``B`` tokens (its decodes) in ``c0 + c1 *
    tokens``. Drafting it raises tokens per second only when ``alpha ** j > c1 * B /
    time``, so each request drafts the largest ``j`` that passes (at most
    ``num_speculative_tokens``). At batch 1 on a small model (fixed cost dominant) almost
    any acceptance pays; at a large batch whose cost grows with tokens, only drafts that
    are nearly certain do. A request turned off is re-tried with one draft token now and
    then (``probe_rate / B`` per step), so its estimate can recover.
    """

    num_speculative_tokens: int = attrs.field(validator=_at_least_one)
    prior_weight: float = 4.0
    window: int = 64
    probe_rate: float = 0.25
    # Before any step is measured: c1 / c0, the cost of one token against the fixed cost.
    initial_token_cost: float = 0.05
    seed: int = 0
    _requests: dict[str, list[float]] = attrs.field(init=False, factory=dict)
    _accepted: float = attrs.field(init=False, default=1.0)  # engine-wide, with a prior
    _trials: float = attrs.field(init=False, default=2.0)
    _steps: list[tuple[float, float]] = attrs.field(init=False, factory=list)
    _rng: random.Random = attrs.field(init=False)
    _fit: tuple[float, float] | None = attrs.field(init=False, default=None)
    _num_steps: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @property
    def alpha(self) -> float:
        """Engine-wide per-token acceptance estimate."""
        return self._accepted / self._trials

    def acceptance(self, request_id: str) -> float:
        """Per-token acceptance estimate of a request (the engine-wide one if unseen)."""
        prior = self.alpha
        stats = self._requests.get(request_id)
        if stats is None:
            return prior
        w = self.prior_weight
        return (stats[0] + w * prior) / (stats[1] + w)

    def cost(self) -> tuple[float, float]:
        """``(c0, c1)``: fixed seconds per step and seconds per computed token."""
        if self._fit is None:
            self._fit = self._refit()
        return self._fit

    def _refit(self) -> tuple[float, float]:
        if len(self._steps) >= 8:
            x, y = np.asarray(self._steps, dtype=np.float64).T
            if np.ptp(x) > 0:
                c1, c0 = np.polyfit(x, y, 1)
                if c1 > 0 and c0 > 0:
                    return float(c0), float(c1)
            # All steps the same size, or a fit without meaning: the mean as fixed cost.
            mean = float(np.mean(y / np.maximum(x, 1)))
            return mean * np.mean(x) * 0.5, mean * 0.5
        return 1.0, self.initial_token_cost

    def lengths(self, candidates: Sequence[Any], num_running: int) -> list[int]:
        c0, c1 = self.cost()
        batch = max(len(candidates), 1)
        threshold = c1 * batch / (c0 + c1 * batch)
        # Runs every step for every decode: requests not yet measured share one answer.
        prior = self.alpha
        k_prior = self._k(prior, threshold)
        stats, w = self._requests, self.prior_weight
        probe = self.probe_rate / batch
        random = self._rng.random
        out = []
        for view in candidates:
            own = stats.get(view.request_id)
            k = k_prior if own is None else self._k((own[0] + w * prior) / (own[1] + w), threshold)
            if k == 0 and random() < probe:
                k = 1
            out.append(k)
        return out

    def _k(self, alpha: float, threshold: float) -> int:
        """The largest ``j <= num_speculative_tokens`` with ``alpha ** j > threshold``."""
        if alpha <= threshold or alpha <= 0.0:
            return 0
        if alpha >= 1.0 or threshold <= 0.0:
            return self.num_speculative_tokens
        return min(self.num_speculative_tokens, int(math.log(threshold) / math.log(alpha)))

    def observe(self, event: Any) -> None:
        """Learn from a step: acceptance per request, and the step's cost."""
        drafted_total = 0
        for request_id, drafted, accepted in event.speculated:
            drafted_total += drafted
            trials = accepted + (1 if accepted < drafted else 0)
            stats = self._requests.setdefault(request_id, [0.0, 0.0])
            stats[0] += accepted
            stats[1] += trials
            self._accepted += accepted
            self._trials += trials
        for request_id, _ in event.finished:
            self._requests.pop(request_id, None)
        for request_id in event.aborted:
            self._requests.pop(request_id, None)
        tokens = event.num_batched_tokens + drafted_total
        if tokens and event.model_time_s > 0:
            self._steps.append((float(tokens), float(event.model_time_s)))
            if len(self._steps) > self.window:
                del self._steps[: len(self._steps) - self.window]
            self._num_steps += 1
            if self._num_steps % 8 == 0:
                self._fit = None  # refit every few steps: the cost drifts slowly
