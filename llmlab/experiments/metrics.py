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
* Machine-independent (the same on any machine for the same scheduling decisions):
  ``ttft_mean_steps`` / ``e2e_mean_steps``, engine steps from the step whose event reports a
  request's arrival to the one that gave its first token / ended it, both counted;
  ``prefill_tokens`` (sum of ``num_prefill_tokens``); ``recomputed_tokens``, tokens whose KV
  had been computed before (recomputation after preemption); ``kv_blocks_peak`` /
  ``kv_blocks_mean``, blocks held per step (total minus free, cached-free counted free).

On several replicas (data parallelism, real or simulated) each replica steps on its own
and a "step" is one replica's step: the records of every replica make one set of requests
(latencies, throughput and hit rate as above), and each replica's trace is merged by
:func:`merge_traces`, which says what each step-based metric then means.
"""

from __future__ import annotations

import array
import itertools
import math
from collections.abc import Collection, Hashable, Mapping, Sequence

import attrs
import numpy as np

from llmlab.observe.events import StepEvent


@attrs.define
class RequestRecord:
    """What happened to one request in one run (times: seconds since the run's start;
    ``ttft_steps`` and ``e2e_steps``: engine steps from the one whose event reported its
    arrival to the one that gave its first token, or ended it, both counted: the same on
    every machine, they depend on the scheduling decisions alone)."""

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
    ttft_steps: int | None = None
    e2e_steps: int | None = None


# Counts that may be missing (a request that never got a token) are kept as floats (NaN).
_FLOAT_FIELDS = ("arrival_s", "first_token_s", "finish_s", "ttft_steps", "e2e_steps")
_INT_FIELDS = ("priority", "num_prompt_tokens", "max_tokens", "num_output_tokens",
               "num_cached_tokens")


class RecordColumns:
    """Finished requests' records as columns: a few numbers per request instead of a
    :class:`RequestRecord` object, for runs of millions of requests (a simulation of a long
    trace). Request ids must be integers in text (the run loops' ``"0"``, ``"1"``, ...);
    output token ids are not kept. Times missing from a record are NaN."""

    def __init__(self) -> None:
        self.request_id = array.array("q")
        self.user: list[str | None] = []
        self.finish_reason: list[str | None] = []
        self._floats = {name: array.array("d") for name in _FLOAT_FIELDS}
        self._ints = {name: array.array("q") for name in _INT_FIELDS}

    def __len__(self) -> int:
        return len(self.request_id)

    def append(self, record: RequestRecord) -> None:
        self.request_id.append(int(record.request_id))
        self.user.append(record.user)
        self.finish_reason.append(record.finish_reason)
        for name, column in self._floats.items():
            value = getattr(record, name)
            column.append(math.nan if value is None else value)
        for name, column in self._ints.items():
            column.append(getattr(record, name))

    def extend(self, other: RecordColumns) -> None:
        """Append every row of ``other``."""
        self.request_id.extend(other.request_id)
        self.user.extend(other.user)
        self.finish_reason.extend(other.finish_reason)
        for name, column in self._floats.items():
            column.extend(other._floats[name])
        for name, column in self._ints.items():
            column.extend(other._ints[name])

    def arrays(self) -> dict[str, np.ndarray]:
        """Every numeric column as a numpy array (no copy of the data)."""
        out = {"request_id": np.frombuffer(self.request_id, dtype=np.int64)}
        out.update({k: np.frombuffer(v, dtype=np.float64) for k, v in self._floats.items()})
        out.update({k: np.frombuffer(v, dtype=np.int64) for k, v in self._ints.items()})
        return out

    def to_pandas(self):
        """One row per request, the columns of :class:`RequestRecord` (no token ids)."""
        import pandas as pd

        columns = {k: v.copy() for k, v in self.arrays().items()}
        frame = pd.DataFrame(columns)
        frame.insert(1, "user", self.user)
        frame["finish_reason"] = self.finish_reason
        order = [f.name for f in attrs.fields(RequestRecord) if f.name in frame.columns]
        return frame[order]


def _record_arrays(records: Sequence[RequestRecord] | RecordColumns) -> dict[str, np.ndarray]:
    if isinstance(records, RecordColumns):
        return records.arrays()
    nan = math.nan
    return {
        "arrival_s": np.array([r.arrival_s for r in records], dtype=np.float64),
        "first_token_s": np.array(
            [nan if r.first_token_s is None else r.first_token_s for r in records],
            dtype=np.float64),
        "finish_s": np.array([nan if r.finish_s is None else r.finish_s for r in records],
                             dtype=np.float64),
        "num_prompt_tokens": np.array([r.num_prompt_tokens for r in records], dtype=np.int64),
        "num_output_tokens": np.array([r.num_output_tokens for r in records], dtype=np.int64),
        "num_cached_tokens": np.array([r.num_cached_tokens for r in records], dtype=np.int64),
    }


class FairnessMeter:
    """:func:`fairness_gap`, computed step by step: memory per pair of users, not per step.

    For each pair, the running difference of service over the current run of consecutive
    steps in which both are backlogged, and its highest and lowest value in that run
    (counting the 0 before it); the gap is the largest spread seen. Each step costs
    O(pairs of backlogged users), so a long simulation keeps no per-step history.
    """

    def __init__(self) -> None:
        self.users: dict[Hashable, int] = {}  # user -> order of first backlog
        self._step = 0
        self._gap = 0.0
        # (f, g) -> [last step both were backlogged, running difference, high, low]
        self._pairs: dict[tuple[Hashable, Hashable], list] = {}

    def step(self, served: Mapping[Hashable, float], backlogged: Collection[Hashable]) -> None:
        """One step: who was served how much, and who was backlogged as it began."""
        users = self.users
        for user in backlogged:
            users.setdefault(user, len(users))
        if len(backlogged) > 1:
            order = sorted(backlogged, key=users.__getitem__)
            for i, f in enumerate(order):
                for g in order[i + 1:]:
                    state = self._pairs.get((f, g))
                    if state is None or state[0] != self._step - 1:  # a new run starts
                        state = self._pairs[(f, g)] = [self._step, 0.0, 0.0, 0.0]
                    state[0] = self._step
                    state[1] += served.get(f, 0) - served.get(g, 0)
                    state[2] = max(state[2], state[1])
                    state[3] = min(state[3], state[1])
                    self._gap = max(self._gap, state[2] - state[3])
        self._step += 1

    def value(self) -> float:
        """The gap so far (NaN with fewer than two users ever backlogged)."""
        return self._gap if len(self.users) > 1 else math.nan


@attrs.define
class StepTrace:
    """What a run's steps did, for the metrics: tokens computed per user, the fairness gap
    (:class:`FairnessMeter`), the preemptions; and, unless a long run drops them
    (``keep_events=False``), the ``StepEvent``s with, per step, the tokens computed per
    user and the users that were backlogged (had an arrived, unfinished request) when it
    began."""

    events: list[StepEvent] = attrs.field(factory=list)
    backlogged: list[frozenset] = attrs.field(factory=list)
    served: list[dict[str | None, int]] = attrs.field(factory=list)
    num_preemptions: int = 0
    keep_events: bool = True
    served_total: dict[str | None, int] = attrs.field(factory=dict)
    fairness: FairnessMeter = attrs.field(factory=FairnessMeter)
    # Machine-independent counts (the step-based metrics), kept as running totals so a
    # long run that drops its events still has them.
    num_steps: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    kv_blocks_peak: int = 0
    kv_blocks_sum: int = 0
    ttft_steps: list = attrs.field(factory=lambda: [0, 0])  # [sum, count]
    e2e_steps: list = attrs.field(factory=lambda: [0, 0])
    _arrived_at: dict = attrs.field(factory=dict)  # request -> step that reported it
    _waiting_first: set = attrs.field(factory=set)
    _computed: dict = attrs.field(factory=dict)  # request -> most tokens computed so far

    def append(self, event: StepEvent, backlogged: frozenset) -> None:
        """Note one step's event (``backlogged``: the users backlogged as it began)."""
        served: dict[str | None, int] = {}
        for (_, num_new), user in zip(event.scheduled, event.scheduled_users, strict=True):
            served[user] = served.get(user, 0) + num_new
        total = self.served_total
        for user, amount in served.items():
            total[user] = total.get(user, 0) + amount
        self.fairness.step(served, backlogged)
        self.num_preemptions += len(event.preempted)
        self._count(event)
        if self.keep_events:
            self.events.append(event)
            self.backlogged.append(backlogged)
            self.served.append(served)

    def _count(self, event: StepEvent) -> None:
        """The step-based totals: steps from a request's arrival (the step whose event
        reports it) to its first token and to its end, both counted inclusively; prefill
        tokens; tokens computed again (their KV had been computed before: recomputation
        after a preemption); KV blocks held."""
        step = self.num_steps
        self.num_steps += 1
        self.prefill_tokens += event.num_prefill_tokens
        held = event.num_total_blocks - event.num_free_blocks
        self.kv_blocks_peak = max(self.kv_blocks_peak, held)
        self.kv_blocks_sum += held
        for arrival in event.arrived:
            self._arrived_at[arrival.request_id] = step
            self._waiting_first.add(arrival.request_id)
        computed = self._computed
        for (rid, num_new), after in zip(event.scheduled, event.num_computed):
            before = computed.get(rid, 0)
            self.recomputed_tokens += max(0, min(after, before) - (after - num_new))
            computed[rid] = max(before, after)
        for rid, num_tokens in event.sampled:
            if num_tokens and rid in self._waiting_first:
                self._waiting_first.discard(rid)
                self.ttft_steps[0] += step - self._arrived_at[rid] + 1
                self.ttft_steps[1] += 1
        for rid, _reason in event.finished:
            arrived = self._arrived_at.pop(rid, None)
            self._waiting_first.discard(rid)
            computed.pop(rid, None)
            if arrived is not None:
                self.e2e_steps[0] += step - arrived + 1
                self.e2e_steps[1] += 1
        for rid in event.aborted:  # gone without an end to count: forget it
            self._arrived_at.pop(rid, None)
            self._waiting_first.discard(rid)
            computed.pop(rid, None)

    def service(self) -> list[dict[str | None, int]]:
        """Tokens computed per user in each step (kept with the events)."""
        return self.served


@attrs.frozen
class WorstGap:
    """The fairness gap of a run on several replicas: the largest of theirs (each replica
    schedules only the requests routed to it, so a gap is measured per replica; NaN when no
    replica had two users backlogged at once). Reads as a :class:`FairnessMeter`."""

    meters: tuple[FairnessMeter, ...]

    def value(self) -> float:
        known = [g for g in (m.value() for m in self.meters) if not math.isnan(g)]
        return max(known) if known else math.nan


def merge_traces(traces: Sequence[StepTrace]) -> StepTrace:
    """One trace for a run on several replicas (data parallelism), each replica's steps
    traced on their own; :func:`summarize` reads it as one engine's (module docstring).

    Tokens, preemptions and steps add up; the step-based latencies are each request's count
    of its own replica's steps, averaged over every request; ``kv_blocks_peak`` is the most
    one replica held, ``kv_blocks_mean`` the mean over every replica's steps of what that
    replica held; the fairness gap is the largest replica's (:class:`WorstGap`). The
    events (when kept) are every replica's, in order of ``end_time_s``; each keeps its
    replica's ``step_index`` and block ids.
    """
    merged = StepTrace(keep_events=all(t.keep_events for t in traces))
    for trace in traces:
        for user, amount in trace.served_total.items():
            merged.served_total[user] = merged.served_total.get(user, 0) + amount
        merged.num_preemptions += trace.num_preemptions
        merged.num_steps += trace.num_steps
        merged.prefill_tokens += trace.prefill_tokens
        merged.recomputed_tokens += trace.recomputed_tokens
        merged.kv_blocks_peak = max(merged.kv_blocks_peak, trace.kv_blocks_peak)
        merged.kv_blocks_sum += trace.kv_blocks_sum
        for total, part in ((merged.ttft_steps, trace.ttft_steps),
                            (merged.e2e_steps, trace.e2e_steps)):
            total[0] += part[0]
            total[1] += part[1]
    merged.fairness = WorstGap(tuple(t.fairness for t in traces))
    steps = sorted(
        (step for t in traces for step in zip(t.events, t.backlogged, t.served, strict=True)),
        key=lambda step: step[0].end_time_s,
    )
    for event, backlogged, served in steps:
        merged.events.append(event)
        merged.backlogged.append(backlogged)
        merged.served.append(served)
    return merged


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


def _ratio(total: float, count: int) -> float:
    return total / count if count else math.nan


def _mean(values: np.ndarray) -> float:
    return float(np.mean(values)) if values.size else math.nan


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def summarize(
    records: Sequence[RequestRecord] | RecordColumns,
    trace: StepTrace,
    users: Sequence[str | None],
) -> dict[str, float | int]:
    """The metrics of one run (module docstring), ``served[user]`` for each of ``users``.
    ``records``: a list of :class:`RequestRecord` or a :class:`RecordColumns`."""
    cols = _record_arrays(records)
    arrival, first, finish = cols["arrival_s"], cols["first_token_s"], cols["finish_s"]
    num_out = cols["num_output_tokens"]
    done = ~np.isnan(finish)
    started = ~np.isnan(first)
    num_output_tokens = int(num_out.sum())
    makespan = float(finish[done].max() - arrival.min()) if done.any() else math.nan
    ttft = first[started] - arrival[started]
    timed = done & started & (num_out > 1)
    tpot = (finish[timed] - first[timed]) / (num_out[timed] - 1)
    num_prompt_tokens = int(cols["num_prompt_tokens"].sum())
    served = {u: 0 for u in users}
    for user, amount in trace.served_total.items():
        served[user] = served.get(user, 0) + amount
    row: dict[str, float | int] = {
        "num_requests": int(done.sum()),
        "num_output_tokens": num_output_tokens,
        "makespan_s": makespan,
        "output_tokens_per_s": num_output_tokens / makespan if makespan > 0 else math.nan,
        "ttft_mean_s": _mean(ttft),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "tpot_mean_s": _mean(tpot),
        "e2e_mean_s": _mean(finish[done] - arrival[done]),
        "prefix_hit_rate": (
            int(cols["num_cached_tokens"].sum()) / num_prompt_tokens
            if num_prompt_tokens else math.nan
        ),
        "num_preemptions": trace.num_preemptions,
        "fairness_gap_tokens": trace.fairness.value(),
        # Machine-independent: the same on any machine for the same decisions.
        "ttft_mean_steps": _ratio(*trace.ttft_steps),
        "e2e_mean_steps": _ratio(*trace.e2e_steps),
        "prefill_tokens": trace.prefill_tokens,
        "recomputed_tokens": trace.recomputed_tokens,
        "kv_blocks_peak": trace.kv_blocks_peak,
        "kv_blocks_mean": _ratio(trace.kv_blocks_sum, trace.num_steps),
    }
    for user, amount in served.items():
        row[f"served[{user}]"] = amount
    return row
