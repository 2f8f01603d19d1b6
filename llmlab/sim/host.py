"""``HostCost``: the engine's own host time per step, split by what overlap can hide.

A synchronous engine step is schedule -> execute -> commit, so its cycle is the device's
time plus all of the host's. An overlapped engine (``async_scheduling``,
:mod:`llmlab.engine.overlap`) schedules batch N+1 and commits batch N on the engine thread
while the executor thread runs a batch, so only the executor thread's own host work (its
inputs, sampling, the runner's glue) stays on the critical path:

    synchronous:  device + hidden + unhidden
    overlapped:   max(device, hidden) + unhidden

``hidden`` is the engine thread's part, ``unhidden`` the executor thread's; each is linear in
the step's running requests (``a + b * n``). :meth:`HostCost.from_host_overhead` reads both
from ``benchmarks/host_overhead.py``'s ``--json`` output: the null model's host work per
decode step at each count of running requests, and its split by stage
(:data:`EXECUTOR_STAGES` are the executor thread's).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from llmlab.validation import as_real

if TYPE_CHECKING:
    from llmlab.sim.shape import BatchShape

EXECUTOR_STAGES = ("batch", "metadata", "sampling", "runner")
"""The stages of ``benchmarks/host_overhead.py``'s split (``benchmarks.throughput.host_stages``)
that run on the executor thread of an overlapped engine: building the batch's inputs, the
attention metadata, sampling, the runner's own glue. The others (``schedule``, ``update``,
``text``, ``outputs``, ``events``, ``commit``, ``observers``, ``rest``: the scheduler, the
commit, the driver's loop) run on the engine thread, which overlap hides."""


def overlaps(overlap: bool | None, shape: BatchShape) -> bool:
    """Whether an engine with overlapped scheduling ``overlap`` (None: off) runs this step
    overlapped. A step that verifies speculative drafts is synchronous: the engine plans
    ahead only of a batch whose successor cannot depend on its outputs
    (:mod:`llmlab.engine.overlap`)."""
    return bool(overlap) and shape.num_draft_tokens == 0


def overlapped_time(device_s: float, hidden_s: float, unhidden_s: float) -> float:
    """An overlapped step: the engine thread's host work (``hidden_s``) runs while the
    device computes; the executor thread's (``unhidden_s``) adds to whichever is longer."""
    return max(device_s, hidden_s) + unhidden_s


def _nonnegative_real(field: str):
    return functools.partial(as_real, field, min=0)


@attrs.frozen
class HostCost:
    """The engine's host time per step, in two parts:

        hidden   = per_step_s + per_request_s * num_requests + per_admission_s * num_admitted
        unhidden = executor_per_step_s + executor_per_request_s * num_requests
                   + per_token_s * num_tokens + per_wakeup_s * after_idle
        time     = hidden + unhidden

    ``hidden``: the engine thread's scheduling and commit (the scheduler, token updates,
    detokenization, outputs, events, the driver's loop), which an overlapped engine runs
    while the device computes. ``unhidden``: the executor thread's work (the batch's inputs
    and metadata, sampling, the runner's glue), on the critical path in either loop. Work
    per admitted request is the scheduler's (hidden); work per token is input preparation
    (unhidden: the side that never makes a prediction optimistic). ``per_wakeup_s``: the
    first step after the engine sat idle (``BatchShape.after_idle``): the driver's sleep
    overshooting and the arrivals added before it; nothing runs beside it to hide it.

    The defaults are this repository's 2-core CPU VM (2026-11-28):
    ``python -m benchmarks.host_overhead --running 16 64 256 --model-kind null --loop sync``
    (median of 3 engines, 40 steps each; 0.51 / 1.23 / 10.3 ms a step), with the stage
    split also taken at 16 and 64 running (``--running 16``, ``--running 64``), read by
    :meth:`from_host_overhead`: 107 us + 3.3 us per request on the executor thread,
    19 us per request on the engine thread (0.47 / 1.54 / 5.85 ms at 16 / 64 / 256: this
    machine's host work grows faster than linearly past 64). Per admission and per token
    the benchmark measures nothing (pure decode): those are rough guesses. Another
    machine's host (a GPU server's CPU) differs: load its own numbers
    (:meth:`from_host_overhead`) or fit a real run (``RooflineCostModel.fit_host``).
    """

    per_step_s: float = attrs.field(default=0.0, converter=_nonnegative_real("per_step_s"))
    per_request_s: float = attrs.field(
        default=1.9e-5, converter=_nonnegative_real("per_request_s")
    )
    per_token_s: float = attrs.field(default=0.0, converter=_nonnegative_real("per_token_s"))
    per_admission_s: float = attrs.field(
        default=5e-5, converter=_nonnegative_real("per_admission_s")
    )
    executor_per_step_s: float = attrs.field(
        default=1.07e-4, converter=_nonnegative_real("executor_per_step_s")
    )
    executor_per_request_s: float = attrs.field(
        default=3.3e-6, converter=_nonnegative_real("executor_per_request_s")
    )
    per_wakeup_s: float = attrs.field(default=0.0, converter=_nonnegative_real("per_wakeup_s"))

    def hidden_time(self, shape: BatchShape) -> float:
        """The engine thread's part: what an overlapped engine hides behind the device."""
        return (
            self.per_step_s
            + self.per_request_s * shape.num_requests
            + self.per_admission_s * shape.num_admitted
        )

    def unhidden_time(self, shape: BatchShape) -> float:
        """The executor thread's part: on the critical path, overlapped or not."""
        return (
            self.executor_per_step_s
            + self.executor_per_request_s * shape.num_requests
            + self.per_token_s * shape.num_tokens
            + self.per_wakeup_s * shape.after_idle
        )

    def time(self, shape: BatchShape) -> float:
        """All of it: a synchronous step's host time."""
        return self.hidden_time(shape) + self.unhidden_time(shape)

    def with_totals(self, per_step_s: float, per_request_s: float, per_token_s: float,
                    per_admission_s: float, per_wakeup_s: float = 0.0) -> HostCost:
        """A term with these totals (both threads together), the per-step and per-request
        ones split between the threads in this term's proportions (all to the engine
        thread where this term has nothing). For a fit that sees only whole steps."""

        def split(total: float, hidden: float, unhidden: float) -> tuple[float, float]:
            share = unhidden / (hidden + unhidden) if hidden + unhidden > 0 else 0.0
            return total * (1 - share), total * share

        step, executor_step = split(per_step_s, self.per_step_s, self.executor_per_step_s)
        request, executor_request = split(per_request_s, self.per_request_s,
                                          self.executor_per_request_s)
        return HostCost(
            per_step_s=step, per_request_s=request, per_token_s=per_token_s,
            per_admission_s=per_admission_s, executor_per_step_s=executor_step,
            executor_per_request_s=executor_request, per_wakeup_s=per_wakeup_s,
        )

    @classmethod
    def from_host_overhead(
        cls, *reports: str | os.PathLike | Mapping[str, Any], loop: str = "sync",
        **fields: float,
    ) -> HostCost:
        """The host term ``benchmarks/host_overhead.py`` measured: each report is the path
        of its ``--json`` output or :func:`benchmarks.host_overhead.main`'s return value;
        several are pooled (a repeated count of running requests: their median).

        The null model's host work per decode step (in ``loop``: ``"sync"``, where nothing
        hides; ``"default"`` is the engine's default loop, synchronous on a CPU) is fitted as
        ``a + b * running`` by least squares on the relative errors (every count weighs
        alike) with both terms >= 0, over at least two counts.
        The stage split (one count of running requests per report) gives the executor
        thread's share (:data:`EXECUTOR_STAGES`) at that count: one split scales the whole
        line by it; splits at two or more counts fit the executor thread's line on their
        own (each clipped to the total's). The rest is the engine thread's. Per token and
        per admission the benchmark measures nothing (every step a pure decode): those keep
        the defaults unless ``fields`` gives them (any field given there wins).

        Raises ``ValueError`` naming the report for a missing loop, missing stages, fewer
        than two counts, or a value that is not a finite number >= 0."""
        if not reports:
            raise ValueError("from_host_overhead needs at least one report")
        points: dict[int, list[float]] = {}
        shares: dict[int, list[float]] = {}
        for report in reports:
            source, data = _load(report)
            for n, host_ms, share in _read(data, loop, source):
                if host_ms is not None:
                    points.setdefault(n, []).append(host_ms)
                if share is not None:
                    shares.setdefault(n, []).append(share)
        if len(points) < 2:
            raise ValueError(
                f"fitting host work per step and per request needs at least two counts of "
                f"running requests; the reports hold {sorted(points)} (run benchmarks."
                "host_overhead with --running at two or more counts)"
            )
        if not shares:
            raise ValueError(
                f"the reports hold no stage split for loop={loop!r} (benchmarks.host_overhead "
                "writes one with --model-kind null)"
            )
        counts = sorted(points)
        totals = [float(np.median(points[n])) / 1e3 for n in counts]
        per_step, per_request = _line(counts, totals)
        split_counts = sorted(shares)
        share_at = [float(np.mean(shares[n])) for n in split_counts]
        if len(split_counts) == 1:
            executor_step, executor_request = per_step * share_at[0], per_request * share_at[0]
        else:
            executor_step, executor_request = _line(
                split_counts,
                [s * (per_step + per_request * n) for n, s in zip(split_counts, share_at,
                                                                   strict=True)],
            )
            executor_step = min(executor_step, per_step)
            executor_request = min(executor_request, per_request)
        return cls(**{
            "per_step_s": per_step - executor_step,
            "per_request_s": per_request - executor_request,
            "executor_per_step_s": executor_step,
            "executor_per_request_s": executor_request,
            **fields,
        })


def _load(report: Any) -> tuple[str, Mapping[str, Any]]:
    if isinstance(report, (str, os.PathLike)):
        with open(report) as f:
            data = json.load(f)
        source = os.fspath(report)
    else:
        data, source = report, "the report"
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: not a benchmarks.host_overhead report (a JSON object)")
    return source, data


def _read(data: Mapping[str, Any], loop: str, source: str):
    """``(running, host ms or None, executor share or None)`` of one report's loop."""
    null = data.get("null")
    if not isinstance(null, Mapping) or not isinstance(null.get(loop), Mapping):
        have = sorted(null) if isinstance(null, Mapping) else []
        raise ValueError(
            f"{source}: no null-model results for loop={loop!r} (it has {have}); run "
            f"python -m benchmarks.host_overhead --model-kind null --loop {loop} --json PATH"
        )
    section = null[loop]
    for key, value in section.items():
        if key in ("stages_ms", "growth_256_1024"):
            continue
        n = _running(key, source)
        if not isinstance(value, Mapping) or "host_ms" not in value:
            raise ValueError(f"{source}: null.{loop}.{key} has no host_ms")
        yield n, _ms(value["host_ms"], f"{source}: null.{loop}.{key}.host_ms"), None
    stages = section.get("stages_ms")
    if stages is not None:
        if not isinstance(stages, Mapping) or "running" not in stages:
            raise ValueError(f"{source}: null.{loop}.stages_ms has no 'running' count")
        n = _running(stages["running"], source)
        parts = {k: _ms(v, f"{source}: null.{loop}.stages_ms.{k}", allow_negative=True)
                 for k, v in stages.items() if k != "running"}
        missing = [s for s in EXECUTOR_STAGES if s not in parts]
        if missing:
            raise ValueError(f"{source}: null.{loop}.stages_ms lacks {missing}")
        # A stage's figure is a difference of timers ("runner", "rest"): noise can make a
        # small one negative. Count those as nothing.
        executor = sum(max(parts[s], 0.0) for s in EXECUTOR_STAGES)
        total = sum(max(v, 0.0) for v in parts.values())
        if total <= 0:
            raise ValueError(f"{source}: null.{loop}.stages_ms sums to nothing")
        yield n, None, executor / total


def _running(key: Any, source: str) -> int:
    try:
        n = int(key)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {key!r} is not a count of running requests") from None
    if n < 1:
        raise ValueError(f"{source}: {n} running requests; counts are >= 1")
    return n


def _ms(value: Any, field: str, allow_negative: bool = False) -> float:
    return as_real(field, value, min=None if allow_negative else 0)


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """``(intercept, slope)``, both >= 0, by least squares on the *relative* residuals
    (``(a + b x - y) / y``), so that 16 running requests weigh as much as 1,024."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-12)
    if len(set(xs)) >= 2:
        (intercept, slope), *_ = np.linalg.lstsq(np.column_stack([w, w * x]), w * y, rcond=None)
        if intercept >= 0 and slope >= 0:
            return float(intercept), float(slope)
        if intercept < 0 <= slope:  # through the origin
            return 0.0, max(float((w * x) @ (w * y) / ((w * x) @ (w * x))), 0.0)
    return max(float((w @ (w * y)) / (w @ w)), 0.0), 0.0  # a constant
