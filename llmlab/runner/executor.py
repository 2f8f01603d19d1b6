"""The executor seam and the engine's clock.

The engine drives an :class:`Executor` with one :class:`~llmlab.scheduler.batch.ScheduledBatch`
per step and reads time from a clock. The :class:`~llmlab.runner.model_runner.ModelRunner`
runs a real model; the simulator's cost model advances a :class:`VirtualClock` instead.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

import attrs

from llmlab.scheduler.batch import BatchOutput, ScheduledBatch


@runtime_checkable
class Executor(Protocol):
    """Runs one scheduled batch.

    ``execute`` first drops per-row state of ``batch.freed_rows`` and applies
    ``batch.block_copies``, then computes ``batch.entries`` and returns, per entry (same
    order), the tokens to append with their log-probabilities. It must not change request
    lifecycle state; the scheduler does that with the returned :class:`BatchOutput`. If it
    raises, the scheduler's state is as before the call and the same work is scheduled
    again next step, so an executor that keeps per-row state resets it on failure.
    """

    def execute(self, batch: ScheduledBatch) -> BatchOutput: ...


@runtime_checkable
class Clock(Protocol):
    """Seconds as a float; only differences matter. Real time by default."""

    def __call__(self) -> float: ...


@attrs.define
class VirtualClock:
    """Time that moves only when told: for simulated executors and deterministic tests."""

    now_s: float = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self.now_s += seconds


def real_clock() -> float:
    """The default clock: ``time.monotonic`` (immune to wall-clock adjustments)."""
    return time.monotonic()
