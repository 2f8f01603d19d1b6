"""``ProfiledCostModel``: step time fitted on a real run's step events.

    recording = llmlab.observe.recording.load("run.jsonl")   # or a list of StepEvents
    model = ProfiledCostModel.fit(recording)
    model.step_time(shape)                                  # seconds

The target of the fit is each step's measured *cycle* (from the previous step's end, or
the arrival that woke an idle engine, to its own end:
:func:`~llmlab.sim.cost_model.measured_step_times`), so the engine's host time and the
driver's loop are in it, not just the forward pass. The model is linear in the
:class:`~llmlab.sim.shape.BatchShape` counts plus a constant, separately for pure decode
steps and the rest (a model tree of depth one), fitted by least squares
with every coefficient kept >= 0 (a feature whose coefficient comes out negative is
dropped and the rest refitted, until none is), so a prediction is never negative and
grows with the work. Least squares leaves the mean residual at zero, which is what sums
over many steps (makespan, latencies) need.

A fitted cycle is the loop the recorded run ran. To simulate an overlapped engine
(``async_scheduling``) from a synchronous recording (every CPU run), give the model the
recording's host term (``host``, a :class:`~llmlab.sim.host.HostCost`, e.g.
``HostCost.from_host_overhead(path)``): an overlapped step is then the fitted cycle split
into ``device = cycle - host`` and the host, priced ``max(device, hidden) + unhidden``
(never more than the cycle itself).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from llmlab.observe.events import StepEvent
from llmlab.sim.cost_model import as_shapes
from llmlab.sim.host import HostCost, overlapped_time, overlaps
from llmlab.sim.shape import FEATURES, BatchShape
from llmlab.validation import as_bool

# A fit whose rms error exceeds this share of its steps' mean time warns (fit's docstring).
NOISY_FIT = 0.25
# Steps a feature must be nonzero on to be fitted (_nonnegative_least_squares).
MIN_SUPPORT = 3

DEFAULT_FEATURES = (
    "num_requests",
    "num_prefill_tokens",
    "num_decode_requests",
    "num_draft_tokens",
    "num_sampled",
    "context_tokens",
    "attention_positions",
    "num_admitted",
    "num_preempted",
    "num_finished",
    "after_idle",
)
"""The :class:`~llmlab.sim.shape.BatchShape` fields a profiled model fits on by default."""


@attrs.frozen
class Linear:
    """``intercept + sum(coefficient * feature)``: one regime of a profiled model.

    Attributes:
        coefficients: seconds per unit of each feature (>= 0), in the model's order.
        intercept: seconds per step (>= 0).
        num_steps: steps it was fitted on.
        residual_s: root-mean-square error of the fit on them, seconds.
    """

    coefficients: tuple[float, ...]
    intercept: float
    num_steps: int = 0
    residual_s: float = 0.0


@attrs.frozen
class ProfiledCostModel:
    """A step's time, linear in its shape's counts, fitted on a real run.

    A depth-one model tree: pure decode steps and steps with prefill work are priced by
    separate linear fits (a decode batch and a prefill chunk use a CPU or GPU so
    differently that one line fits neither well); a regime with too few steps to fit
    uses the fit on all steps.

    Attributes:
        features: the :class:`~llmlab.sim.shape.BatchShape` fields used.
        decode: the fit for pure decode steps.
        prefill: the fit for every other step.
        host: the host part of the recording's (synchronous) cycles, or None: needed to
            price overlapped steps.
        overlap: whether the engine modelled overlaps its steps; None: as the simulated
            engine's ``async_scheduling`` resolves
            (:func:`~llmlab.sim.cost_model.with_overlap`), and synchronous without a
            ``host`` or on its own. True needs ``host``.
    """

    features: tuple[str, ...]
    decode: Linear
    prefill: Linear
    name: str = "profiled"
    host: HostCost | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(HostCost)),
    )
    overlap: bool | None = attrs.field(
        default=None, converter=lambda v: as_bool("overlap", v, allow_none=True)
    )
    _index: tuple[int, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; BatchShape has {list(FEATURES)}")
        for regime in (self.decode, self.prefill):
            if len(regime.coefficients) != len(self.features):
                raise ValueError(
                    f"{len(regime.coefficients)} coefficients for {len(self.features)} features"
                )
        object.__setattr__(self, "_index", tuple(FEATURES.index(f) for f in self.features))
        if self.overlap and self.host is None:
            raise ValueError(
                "overlap=True needs host: the host part of the recorded cycles (a HostCost, "
                "e.g. HostCost.from_host_overhead(path)), to split a cycle into device and host"
            )

    @property
    def num_steps(self) -> int:
        """Steps the model was fitted on."""
        return self.decode.num_steps + self.prefill.num_steps

    @classmethod
    def fit(
        cls,
        events: Iterable[StepEvent],
        features: Sequence[str] = DEFAULT_FEATURES,
        *,
        skip: int = 0,
        host: HostCost | None = None,
        overlap: bool | None = None,
    ) -> ProfiledCostModel:
        """Fit on a real run's events (a :class:`~llmlab.observe.recording.Recording`, a
        ``Comparison``'s events of one configuration, or any list of ``StepEvent``s) of a
        *warmed-up* engine (the first steps of a fresh engine meet every shape for the
        first time and are slow; ``skip`` leaves out that many first steps). ``host`` and
        ``overlap``: the fields (for pricing overlapped steps). Raises ``ValueError`` for
        an unknown feature, or with fewer steps than features. Warns (``RuntimeWarning``)
        when a regime's rms error is over :data:`NOISY_FIT` of its steps' mean time: a noisy
        run, whose predictions would carry that error without anyone noticing."""
        features = tuple(features)
        unknown = [f for f in features if f not in FEATURES]
        if unknown:
            raise ValueError(f"unknown feature(s) {unknown}; BatchShape has {list(FEATURES)}")
        shapes, times = as_shapes(events)
        shapes, times = shapes[skip:], times[skip:]
        if len(shapes) <= len(features):
            raise ValueError(
                f"fitting {len(features)} features needs more than {len(features)} steps; "
                f"the events hold {len(shapes)} that ran a batch"
            )
        index = [FEATURES.index(f) for f in features]
        x = np.array([s.as_tuple() for s in shapes], dtype=np.float64)[:, index]
        y = np.asarray(times, dtype=np.float64)
        decode = np.array([s.is_decode for s in shapes])
        pooled = _fit(x, y)
        regimes = [
            _fit(x[mask], y[mask]) if mask.sum() > 2 * len(features) else pooled
            for mask in (decode, ~decode)
        ]
        for name, regime, mask in zip(("decode", "prefill"), regimes, (decode, ~decode),
                                      strict=True):
            times = y[mask] if mask.any() else y
            mean = float(times.mean())
            if mean > 0 and regime.residual_s > NOISY_FIT * mean:
                warnings.warn(
                    f"ProfiledCostModel.fit: its {name} steps' fit is off by "
                    f"{regime.residual_s * 1e3:.3g} ms (rms), {regime.residual_s / mean:.0%} of "
                    f"their mean time ({mean * 1e3:.3g} ms): the run was noisy, or the features "
                    "miss what those steps cost, and predictions carry that error. Fit on a "
                    "quieter or longer run (skip= its warm-up steps), or with more features.",
                    RuntimeWarning, stacklevel=2,
                )
        return cls(features, *regimes, host=host, overlap=overlap)

    def step_time(self, shape: BatchShape) -> float:
        regime = self.decode if shape.is_decode else self.prefill
        counts = shape.as_tuple()
        total = regime.intercept
        for i, c in zip(self._index, regime.coefficients, strict=True):
            total += c * counts[i]
        if self.host is None or not overlaps(self.overlap, shape):
            return total
        hidden, unhidden = self.host.hidden_time(shape), self.host.unhidden_time(shape)
        device = max(total - hidden - unhidden, 0.0)
        return min(overlapped_time(device, hidden, unhidden), total)

    def describe(self) -> dict[str, dict[str, float]]:
        """Per regime, ``{feature: coefficient}`` with the intercept as ``"per_step"``
        (seconds), and the fit's ``"rms_error"``."""
        return {
            name: {"per_step": r.intercept,
                   **dict(zip(self.features, r.coefficients, strict=True)),
                   "rms_error": r.residual_s}
            for name, r in (("decode", self.decode), ("prefill", self.prefill))
        }


def _fit(x: np.ndarray, y: np.ndarray) -> Linear:
    coefficients, intercept = _nonnegative_least_squares(x, y)
    residual = float(np.sqrt(np.mean((x @ coefficients + intercept - y) ** 2)))
    return Linear(tuple(coefficients.tolist()), intercept, len(y), residual)


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """Least squares with an intercept and every coefficient >= 0: drop the most negative
    coefficient's feature and refit until none is negative. Columns are scaled to unit
    norm first, so features counted in thousands and in ones weigh alike. A feature nonzero
    on fewer than :data:`MIN_SUPPORT` steps is left out: its price would be those few
    steps' noise (a run's one wake-up, a cold first step, would price every later one)."""
    n, k = x.shape
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = [j for j in range(k) if np.count_nonzero(x[:, j]) >= MIN_SUPPORT]
    while True:
        design = np.column_stack([np.ones(n), xs[:, active]]) if active else np.ones((n, 1))
        solution, *_ = np.linalg.lstsq(design, y, rcond=None)
        intercept, beta = solution[0], solution[1:]
        if intercept < 0 and not active:
            intercept = 0.0
        worst = int(np.argmin(beta)) if active else -1
        if not active or beta[worst] >= 0:
            break
        del active[worst]
    coefficients = np.zeros(k)
    if active:
        coefficients[active] = beta / scale[active]
    if intercept < 0:  # fold a negative intercept away: refit through the origin
        if active:
            beta, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
            coefficients[active] = np.maximum(beta, 0.0) / scale[active]
        intercept = 0.0
    return coefficients, float(intercept)
