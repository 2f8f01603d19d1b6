"""What one run of a workload measured: per-request records, the step trace, and the
summary metrics :func:`~llmlab.experiments.comparison.compare` puts in its table.

Definitions (times in seconds on the engine's clock; a request's arrival is its scheduled
arrival ``t0 + arrival_time``, so time spent before the engine first saw it counts):

* ``output_tokens_per_s``: output tokens of all requests / makespan, where makespan is the
  last finish minus the first arrival.
* ``ttft_*_s``: time to first token, first output with >= 1 token minus arrival; mean,
  median and 99th percentile (numpy's linear interpolation).
* ``tpot_mean_s``: mean over requests with more than one output token of
  ``(e2e - ttft) / (num_output_tokens - 1)``.
* ``e2e_mean_s``: mean of finish minus arrival.
* ``prefix_hit_rate``: sum of ``num_cached_tokens`` (prompt tokens found in the prefix cache
  at first admission) / sum of prompt tokens.
* ``num_preemptions``: sum over steps of ``len(event.preempted)``.
* ``served[user]``: tokens computed for the user's requests, the sum of ``num_new_tokens``
  of its entries in ``StepEvent.scheduled`` (prefill chunks, recomputation after
  preemption, and decodes; prefix-cache hits are not computed, so not counted).
* ``fairness_gap_tokens``: see :func:`fairness_gap`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Hashable, Mapping, Sequence

import attrs
import numpy as np

from llmlab.engine.events import StepEvent


@attrs.define
class RequestRecord:
    """What happened to one request in one run (times: seconds since the run's start)."""

    request_id: str
    user: str | None
    priority: int
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    first_token_s: float | None = None
    finish_s: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    output_token_ids: tuple[int, ...] = ()


@attrs.define
class StepTrace:
    """What a run's steps did, for the metrics: per step, the tokens computed per user and
    the users that were backlogged (had an arrived, unfinished request) when it began;
    the preemptions; and, unless a long run drops them, the ``StepEvent``s themselves."""

    events: list[StepEvent] = attrs.field(factory=list)
    backlogged: list[frozenset] = attrs.field(factory=list)
    served: list[dict[str | None, int]] = attrs.field(factory=list)
    num_preemptions: int = 0
    keep_events: bool = True

    def append(self, event: StepEvent, backlogged: frozenset) -> None:
        """Note one step's event (``backlogged``: the users backlogged as it began)."""
        if self.keep_events:
            self.events.append(event)
        self.backlogged.append(backlogged)
        served: dict[str | None, int] = {}
        for (_, num_new), user in zip(event.scheduled, event.scheduled_users, strict=True):
            served[user] = served.get(user, 0) + num_new
        self.served.append(served)
        self.num_preemptions += len(event.preempted)

    def service(self) -> list[dict[str | None, int]]:
        """Tokens computed per user in each step."""
        return self.served


def fairness_gap(
    service: Sequence[Mapping[Hashable, float]],
    backlogged: Sequence[Collection[Hashable]],
) -> float:
    """The largest difference in service between two users while both were backlogged.

    ``service[k]`` maps each user to the service it received in step ``k`` (here: tokens
    computed), ``backlogged[k]`` holds the users with an arrived, unfinished request when
    step ``k`` began. For every pair of users ``f, g`` and every run of consecutive steps
    ``i..j`` in which both are backlogged, the gap is ``|W_f(i, j) - W_g(i, j)|`` with
    ``W_u(i, j)`` the service ``u`` received in steps ``i..j``; the result is the largest
    gap (0 if no two users are ever backlogged together, NaN with fewer than two users).
    This is the quantity Sheng et al. ("Fairness in Serving Large Language Models", OSDI
    2024, Theorem 4.4) bound for VTC, measured with unit weights on computed tokens.
    """
    if len(service) != len(backlogged):
        raise ValueError(
            f"service and backlogged must be aligned, got {len(service)} and "
            f"{len(backlogged)} steps"
        )
    users = list(dict.fromkeys(u for step in backlogged for u in step))
    if len(users) < 2:
        return math.nan
    column = {u: i for i, u in enumerate(users)}
    served = np.zeros((len(service), len(users)))
    waiting = np.zeros((len(service), len(users)), dtype=bool)
    for k, (step_service, step_backlog) in enumerate(zip(service, backlogged, strict=True)):
        for user, amount in step_service.items():
            if user in column:
                served[k, column[user]] = amount
        for user in step_backlog:
            waiting[k, column[user]] = True
    gap = 0.0
    for f, g in itertools.combinations(range(len(users)), 2):
        steps = np.flatnonzero(waiting[:, f] & waiting[:, g])
        if steps.size == 0:
            continue
        diff = served[steps, f] - served[steps, g]
        # Runs of consecutive steps; within a run the largest |W_f - W_g| over sub-intervals
        # is max - min of the running difference, counting the 0 before the run's first step.
        starts = np.flatnonzero(np.diff(steps) != 1) + 1
        starts = np.concatenate([[0], starts])
        running = np.cumsum(diff)
        before = running[starts] - diff[starts]
        high = np.maximum(np.maximum.reduceat(running, starts), before)
        low = np.minimum(np.minimum.reduceat(running, starts), before)
        gap = max(gap, float(np.max(high - low)))
    return gap


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(
    records: Sequence[RequestRecord], trace: StepTrace, users: Sequence[str | None]
) -> dict[str, float | int]:
    """The metrics of one run (module docstring), ``served[user]`` for each of ``users``."""
    done = [r for r in records if r.finish_s is not None]
    started = [r for r in records if r.first_token_s is not None]
    num_output_tokens = sum(r.num_output_tokens for r in records)
    makespan = (
        max(r.finish_s for r in done) - min(r.arrival_s for r in records) if done else math.nan
    )
    ttft = [r.first_token_s - r.arrival_s for r in started]
    tpot = [
        (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
        for r in done
        if r.first_token_s is not None and r.num_output_tokens > 1
    ]
    num_prompt_tokens = sum(r.num_prompt_tokens for r in records)
    service = trace.served
    served = {u: 0 for u in users}
    for step in service:
        for user, amount in step.items():
            served[user] = served.get(user, 0) + amount
    row: dict[str, float | int] = {
        "num_requests": len(done),
        "num_output_tokens": num_output_tokens,
        "makespan_s": makespan,
        "output_tokens_per_s": num_output_tokens / makespan if makespan > 0 else math.nan,
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "tpot_mean_s": _mean(tpot),
        "e2e_mean_s": _mean([r.finish_s - r.arrival_s for r in done]),
        "prefix_hit_rate": (
            sum(r.num_cached_tokens for r in records) / num_prompt_tokens
            if num_prompt_tokens else math.nan
        ),
        "num_preemptions": trace.num_preemptions,
        "fairness_gap_tokens": fairness_gap(service, trace.backlogged),
    }
    for user, amount in served.items():
        row[f"served[{user}]"] = amount
    return row
