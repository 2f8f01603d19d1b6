"""The ``CostModel`` component: how long one engine step takes, from its shape.

A cost model is any object with ``step_time(shape) -> seconds``
(:class:`~llmlab.sim.shape.BatchShape` in, a finite number >= 0 out). The time is the
*whole* step cycle of the engine being modelled, host time included (scheduling, batch
building, sampling, commit, and the driver's own loop between steps), because on small
models the host is a large share of it. Built-ins:

* :class:`~llmlab.sim.roofline.RooflineCostModel` (``"roofline"``): hardware peak rates,
  from the model's shape and a hardware preset;
* :class:`~llmlab.sim.profiled.ProfiledCostModel` (``"profiled"``): fitted on a real run's
  recorded step events;
* :class:`ReplayCostModel`: the measured step times of one real run, in order: for
  checking that the simulator makes the same decisions as the engine.

A cost model is user code: :func:`step_time` refuses an answer that is not a finite
number >= 0, naming the model, before the clock moves.

Overlapped scheduling (``async_scheduling``, :mod:`llmlab.engine.overlap`) is priced, not
run: the simulated engine always steps synchronously (its executor plans nothing ahead), and
a cost model with an ``overlap`` field (the roofline and profiled ones) prices an overlapped
step as ``max(device, hidden host) + unhidden host`` (:class:`~llmlab.sim.host.HostCost`).
``overlap=None`` follows the simulated engine's ``async_scheduling``, resolved as the real
engine resolves it (:func:`with_overlap`). A cost model without the field prices every
step itself, whichever loop the engine it models runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from llmlab.observe.events import StepEvent
from llmlab.errors import ComponentError
from llmlab.sim.host import overlapped_time, overlaps
from llmlab.sim.shape import BatchShape

__all__ = [
    "CostModel",
    "ReplayCostModel",
    "as_shapes",
    "measured_step_times",
    "overlapped_time",
    "overlaps",
    "step_time",
    "with_overlap",
]


@runtime_checkable
class CostModel(Protocol):
    """Predicts the duration of one engine step (seconds, host time included)."""

    def step_time(self, shape: BatchShape) -> float: ...


def step_time(model: CostModel, shape: BatchShape) -> float:
    """``model.step_time(shape)``, checked: a :class:`~llmlab.errors.ComponentError` naming
    the model when it raises or answers anything but a finite number >= 0."""
    try:
        seconds = model.step_time(shape)
    except Exception as err:
        raise ComponentError.wrap("cost model", model, "step_time", err) from err
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        try:  # numpy scalars and the like
            seconds = float(seconds)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ComponentError(
                "cost model", model, "step_time",
                f"returned {seconds!r}; a step time is a number of seconds >= 0",
            ) from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ComponentError(
            "cost model", model, "step_time",
            f"returned {seconds!r} for {shape}; a step time is a finite number of seconds >= 0",
        )
    return float(seconds)


def with_overlap(model: CostModel, async_scheduling: bool | None, device_type: str) -> CostModel:
    """``model`` as a simulated engine with ``async_scheduling`` on ``device_type``
    (``"cuda"`` for a GPU preset, ``"cpu"``) uses it.

    The real engine overlaps when ``async_scheduling`` is True, or None on a CUDA device.
    A cost model with an ``overlap`` field (an attrs class: the roofline and profiled ones)
    whose ``overlap`` is None gets that; one whose ``overlap`` is set keeps it, unless an
    explicit ``async_scheduling`` says the opposite (``ValueError``). A model that cannot
    split its steps into device and host (``host`` is None: a profiled model fitted
    without one) prices its steps as its recording measured them, in whichever loop that
    run ran: it is left as it is when the overlap is only the device's default (a profile
    of a CUDA run already holds that run's overlap), and refused when
    ``async_scheduling=True`` asks for an overlap it cannot price. Any other cost model is
    returned as it is."""
    cls = type(model)
    if not attrs.has(cls) or "overlap" not in attrs.fields_dict(cls):
        return model
    current = model.overlap  # type: ignore[attr-defined]
    if current is not None:
        if async_scheduling is not None and current != async_scheduling:
            raise ValueError(
                f"async_scheduling={async_scheduling} but the cost model "
                f"{getattr(model, 'name', cls.__name__)!r} has overlap={current}; set one "
                "of them (overlap=None follows async_scheduling)"
            )
        return model
    wanted = device_type == "cuda" if async_scheduling is None else async_scheduling
    if wanted and getattr(model, "host", True) is None:
        if async_scheduling is None:
            return model
        raise ValueError(
            f"async_scheduling=True: the cost model {getattr(model, 'name', cls.__name__)!r} "
            "cannot price an overlapped step without its host term: give it host=HostCost"
            "(...) (e.g. HostCost.from_host_overhead(path)) to overlap the steps of a "
            "synchronous recording, or leave async_scheduling=None to price the steps as "
            "recorded (a recording of an overlapped engine holds its overlap already)"
        )
    return attrs.evolve(model, overlap=wanted)


def measured_step_times(events: Iterable[StepEvent]) -> list[tuple[StepEvent, float]]:
    """Each batch-running event of a real run with the time its step cycle took.

    The cycle of step ``k`` runs from the end of the step before it to its own end: the
    host time between the two (the driver's loop, adding arrivals) belongs to it. After
    the engine sat idle (nothing waiting or running after the previous step) until an
    arrival woke it, it starts at that arrival instead, so idle time never counts. The
    first step starts at the earliest arrival it received (or at its own start).
    """
    return [(event, seconds) for event, seconds, _ in _cycles(events)]


def _cycles(events: Iterable[StepEvent]):
    """``(event, cycle seconds, woke)`` per step that ran a batch (:func:`measured_step_times`);
    ``woke``: the engine sat idle, waiting for an arrival, before it (and the first step).
    An arrival during the step before an empty engine's next one is no wake-up: the
    engine never waited (a simulated engine's clock never moved: the same rule)."""
    previous: StepEvent | None = None
    for event in events:
        if event.scheduled:
            first = min((a.arrival_time for a in event.arrived), default=None)
            if previous is None:
                woke = True
                begin = event.start_time_s if first is None else min(event.start_time_s, first)
            else:
                begin = previous.end_time_s
                woke = previous.num_waiting == 0 and previous.num_running == 0 and (
                    first is None or first > begin)
                if woke:
                    begin = event.start_time_s if first is None else first
            yield event, max(event.end_time_s - begin, 0.0), woke
        previous = event


@attrs.define
class ReplayCostModel:
    """Replays a real run's measured step times, one per call, in order.

    Given the run's events and the simulated clock, step ``k`` ends exactly when the real
    step ``k`` ended (relative to the first arrival), so arrivals, admissions and every
    time-dependent decision see the times the real engine saw. For the check that the
    simulator and the engine decide the same: a replay of a different workload makes no
    sense, and running past the recording raises.

    Attributes:
        end_times: each real step's end, seconds after the real run's start.
        clock: the simulation's clock (read to land each step on its recorded end).
    """

    end_times: Sequence[float]
    clock: object
    name: str = "replay"
    _next: int = 0

    @classmethod
    def of(cls, events: Iterable[StepEvent], t0: float, clock: object) -> ReplayCostModel:
        """From a real run's events and the engine-clock time ``t0`` its run started."""
        return cls([e.end_time_s - t0 for e in events if e.scheduled], clock)

    def step_time(self, shape: BatchShape) -> float:
        if self._next >= len(self.end_times):
            raise ValueError(
                f"the recording has {len(self.end_times)} steps; the simulation asked for "
                "more (it diverged from the recorded run)"
            )
        end = self.end_times[self._next]
        self._next += 1
        return max(end - self.clock(), 0.0)


def as_shapes(events: Iterable[StepEvent]) -> tuple[list[BatchShape], list[float]]:
    """The shapes and measured cycle times (:func:`measured_step_times`) of a real run;
    each shape's ``after_idle`` says whether the engine sat idle before its step."""
    shapes, times = [], []
    for event, seconds, woke in _cycles(events):
        shape = BatchShape.of_event(event)
        shapes.append(attrs.evolve(shape, after_idle=1) if woke else shape)
        times.append(seconds)
    return shapes, times
