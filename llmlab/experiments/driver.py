"""Run one workload on one engine: each request injected at its arrival time, the engine
stepped until all finish, the records and step trace collected. The loop
:func:`~llmlab.experiments.comparison.compare` runs per configuration and run
(:func:`run_replicated` on a data-parallel engine), and the simulator's cluster loop
(:mod:`llmlab.sim.run`) shares its arrival rule and helpers.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sized
from typing import TYPE_CHECKING, Any

from llmlab.engine.engine import Engine
from llmlab.experiments.collect import RunCollector
from llmlab.experiments.metrics import RequestRecord, StepTrace
from llmlab.experiments.workloads import WorkloadRequest
from llmlab.utils.gc_heap import frozen_heap
from llmlab.sampling.params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from llmlab.distributed.data_parallel import DataParallelEngine

logger = logging.getLogger(__name__)


def run_workload(
    engine: Engine,
    workload: Iterable[WorkloadRequest],
    *,
    label: str = "",
    progress: bool = False,
    keep_events: bool = True,
) -> tuple[list[RequestRecord], StepTrace]:
    """Inject ``workload`` into an idle ``engine`` at its arrival times; step until all finish.

    ``workload``: a :class:`Workload` or any iterable of :class:`WorkloadRequest` in arrival
    order (a trace streamed from a file: it is read as the run goes). Requests get ids
    ``"0"``, ``"1"``, ... in arrival order, greedy sampling with ``ignore_eos`` (so exactly
    ``max_tokens`` each) and final-only outputs. A request joins before the next step if it
    arrived by the end of the step before (``StepEvent.end_time_s``); when the engine has
    nothing to do, the loop waits for the next arrival (sleeps, or advances the clock when
    it has an ``advance`` method: a ``VirtualClock``) and adds what arrived by then. So the
    decisions depend only on recorded times, which lets a simulation replay them exactly.
    Record times are seconds since the run's start, taken from the step events. On any
    error or Ctrl-C the observer is removed and the workload's requests still in the engine
    are aborted before the exception propagates.
    """
    clock = engine.clock
    t0, bar = _begin(engine, workload, label, progress)
    collector = RunCollector(t0, keep_events=keep_events, on_finish=bar.finished)
    arrivals = iter(workload)
    pending = next(arrivals, None)
    num_added = 0
    previous = 0.0
    horizon = 0.0  # requests that arrived by then (s since t0) join before the next step
    engine.subscribe(collector)
    # A simulated run (virtual clock) is host-bound: keep full GC passes short.
    simulated = callable(getattr(clock, "advance", None))
    try:
        with frozen_heap(simulated):
            while True:
                while pending is not None and pending.arrival_time <= horizon:
                    request_id = str(num_added)
                    previous = check_arrival(pending, previous, num_added)
                    collector.add(request_id, pending)
                    add_workload_request(engine, pending, request_id, t0)
                    num_added += 1
                    pending = next(arrivals, None)
                if engine.has_unfinished_requests():
                    collector.before_step()
                    last = collector.last_end_s
                    for out in engine.step():
                        collector.output(out)
                    ended = collector.last_end_s
                    horizon = (ended if ended != last else clock()) - t0
                elif pending is not None:
                    _wait_until(clock, t0 + pending.arrival_time)
                    horizon = pending.arrival_time
                else:
                    break
            if collector.num_finished < num_added:
                raise RuntimeError(
                    "the engine has no unfinished requests but "
                    f"{num_added - collector.num_finished} of the workload's have not "
                    "finished (aborted from outside?)"
                )
    finally:
        engine.unsubscribe(collector)
        bar.close()
        abort_quietly(engine, collector.unfinished())
    return list(collector.records.values()), collector.trace


def run_replicated(
    engine: DataParallelEngine,
    workload: Iterable[WorkloadRequest],
    *,
    label: str = "",
    progress: bool = False,
    keep_events: bool = True,
) -> list[RunCollector]:
    """:func:`run_workload` on a data-parallel engine: one
    :class:`~llmlab.experiments.collect.RunCollector` per replica, holding the records of
    the requests routed there and that replica's step trace (its events reach the front
    end with the replica's index: ``subscribe(..., replica=True)``).

    The same requests, ids and sampling as :func:`run_workload`. The replicas step on
    their own, so there is no step of the whole engine to join: a request is added as soon
    as the front end's clock passes its arrival time, checked each time ``step()``
    returns (after a replica's report, or ``step_timeout_s`` without one), so it may join
    up to one replica step late; its arrival is still its scheduled time. The users
    backlogged at a replica's step (for the fairness gap) are those with a request there
    not known finished when that step's report is read. Times are on ``time.monotonic``,
    which replicas on one machine share (Ray replicas on other nodes do not: their times
    would not compare). A replica that fails or stops answering fails the run.
    """
    clock = engine.clock
    t0, bar = _begin(engine, workload, label, progress)
    collectors = [RunCollector(t0, keep_events=keep_events, on_finish=bar.finished)
                  for _ in engine.replicas]
    replica_of: dict[str, int] = {}  # request id -> the replica it was routed to

    def observe(index: int, event) -> None:
        collectors[index].before_step()
        collectors[index](event)

    arrivals = iter(workload)
    pending = next(arrivals, None)
    num_added = 0
    previous = 0.0
    engine.subscribe(observe, replica=True)
    try:
        while True:
            now = clock() - t0
            while pending is not None and pending.arrival_time <= now:
                request_id = str(num_added)
                previous = check_arrival(pending, previous, num_added)
                add_workload_request(engine, pending, request_id, t0)
                index = replica_of[request_id] = next(
                    r.replica_index for r in engine.replicas if request_id in r.requests)
                collectors[index].add(request_id, pending)
                num_added += 1
                pending = next(arrivals, None)
            if engine.has_unfinished_requests():
                for out in engine.step():
                    collectors[replica_of[out.request_id]].output(out)
            elif pending is not None:
                _wait_until(clock, t0 + pending.arrival_time)
            else:
                break
        num_finished = sum(c.num_finished for c in collectors)
        if num_finished < num_added:
            raise RuntimeError(
                f"the engine has no unfinished requests but {num_added - num_finished} of "
                "the workload's have not finished (aborted from outside, or moved off a "
                "replica that stopped answering?)"
            )
    finally:
        engine.unsubscribe(observe)
        bar.close()
        abort_quietly(engine, [i for c in collectors for i in c.unfinished()])
    return collectors


def _begin(engine: Any, workload: object, label: str, progress: bool) -> tuple[float, ProgressBar]:
    """A run's start on the engine's clock and its progress bar; refuses a busy engine."""
    if engine.has_unfinished_requests():
        raise ValueError(
            f"the engine has {engine.get_num_unfinished_requests()} unfinished request(s); "
            "run a workload on an idle engine, so its measurements are its own"
        )
    total = len(workload) if isinstance(workload, Sized) else None
    return engine.clock(), ProgressBar(total, label, enabled=progress)


def check_arrival(request: object, previous: float, index: int) -> float:
    """``request``'s arrival time, checked: a ``WorkloadRequest`` arriving no earlier than
    the one before it (``previous``)."""
    if not isinstance(request, WorkloadRequest):
        raise TypeError(
            f"workload item {index} must be a WorkloadRequest, got {type(request).__name__}"
        )
    if request.arrival_time < previous:
        raise ValueError(
            f"workload item {index} arrives at {request.arrival_time!r} s, before the one "
            f"before it ({previous!r} s); a workload is in arrival order"
        )
    return request.arrival_time


def add_workload_request(engine: Engine, request: WorkloadRequest, request_id: str,
                         t0: float) -> None:
    """Add ``request`` as ``request_id``, arrived ``t0 + request.arrival_time``."""
    engine.add_request(
        request_id,
        {"prompt_token_ids": list(request.prompt_token_ids)},
        workload_params(request.max_tokens),
        arrival_time=t0 + request.arrival_time,
        priority=request.priority,
        user=request.user,
    )


@functools.lru_cache(maxsize=4096)  # params are immutable: requests may share them
def workload_params(max_tokens: int) -> SamplingParams:
    """How a workload request samples: greedy, exactly ``max_tokens`` tokens (EOS ignored),
    one output at the end."""
    return SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def abort_quietly(engine: Engine, request_ids: list[str]) -> None:
    """Abort what is left; an error here must not mask the one being raised."""
    if not request_ids:
        return
    pending = sys.exc_info()[1] is not None
    try:
        engine.abort_request(request_ids)
    except Exception:
        if not pending:
            raise
        logger.exception("while cleaning up after an error, aborting requests also failed")


def _wait_until(clock: Callable[[], float], deadline: float) -> None:
    delay = deadline - clock()
    if delay <= 0:
        return
    advance = getattr(clock, "advance", None)
    if callable(advance):
        advance(delay)
    else:
        time.sleep(delay)


class ProgressBar:
    """Requests finished out of the workload's (when known), with the output rate so far
    on the run's clock (tqdm.auto)."""

    def __init__(self, total: int | None, label: str, *, enabled: bool) -> None:
        self._bar = None
        self._num_output_tokens = 0
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=label or "requests", unit="req",
                             dynamic_ncols=True, mininterval=0.5)

    def finished(self, record: RequestRecord) -> None:
        if self._bar is None:
            return
        self._num_output_tokens += record.num_output_tokens
        self._bar.update(1)
        if record.finish_s:
            rate = self._num_output_tokens / record.finish_s
            self._bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
