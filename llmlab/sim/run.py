"""``simulate``: a workload through one or many simulated engine replicas behind a router.

    result = simulate(trace, model=path, replicas=8, router="prefix_aware",
                      cost_model=ProfiledCostModel.fit(recording), num_gpu_blocks_override=4096)
    result.table          # one row per replica and one "overall": compare()'s columns
    result.requests       # one row per request (with the replica that served it)

Each replica is a full :class:`~llmlab.engine.engine.Engine` built by
:func:`~llmlab.sim.engine.sim_engine` (the real scheduler, KV cache manager and policies)
on its own virtual clock. A discrete-event loop interleaves them: it always does the
earliest thing next, either routing the next arrival (if it comes no later than every
busy replica's next step) or stepping the busy replica whose clock is furthest behind.
A request joins its replica before that replica's next step when it arrived by the end of
the replica's previous step, the rule :func:`~llmlab.experiments.driver.run_workload`
follows, so one replica simulated here and one simulated engine run through
``run_workload`` take the same decisions at the same times. The workload is read as the
run goes (a trace of millions of requests streams from its file), and step events are
dropped unless ``keep_events``.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Iterable, Sized
from typing import Any, NamedTuple

import attrs

from llmlab import registry
from llmlab.observe.events import StepEvent
from llmlab.experiments.collect import RunCollector
from llmlab.experiments.driver import (
    ProgressBar,
    abort_quietly,
    add_workload_request,
    check_arrival,
)
from llmlab.experiments.metrics import RecordColumns, StepTrace, merge_traces, summarize
from llmlab.experiments.workloads import WorkloadRequest
from llmlab.observe.components import component_names, name_of
from llmlab.routing.policy import check_choice
from llmlab.routing.replica import EngineReplica
from llmlab.utils.gc_heap import frozen_heap
from llmlab.validation import as_int

# Steps in a row that may go by with nothing happening before the loop gives up (an
# engine holding requests it never schedules would otherwise spin forever).
_MAX_IDLE_STEPS = 1000


class _Route(NamedTuple):
    """What a router sees of a request (:class:`~llmlab.routing.policy.RouteRequest`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    user: str | None
    session: str | None


@attrs.frozen(eq=False, repr=False, slots=False)
class SimulationResult:
    """What :func:`simulate` measured.

    Attributes:
        name: the workload's name (or the trace file's).
        table: one row per replica (``"replica 0"``, ...) and ``"overall"``: the columns of
            :func:`~llmlab.experiments.compare`'s table; the overall row merges the
            replicas' traces (:func:`~llmlab.experiments.metrics.merge_traces` says what
            each step-based metric then means: the fairness gap is the largest replica's).
        records: each replica's finished requests, as
            :class:`~llmlab.experiments.metrics.RecordColumns` (a few numbers each).
        events: each replica's ``StepEvent``s (empty unless ``keep_events``).
        num_steps: engine steps simulated, all replicas together.
        wall_s: real seconds the simulation took.
        traces: each replica's :class:`~llmlab.experiments.metrics.StepTrace`.
    """

    name: str
    table: Any
    records: tuple[RecordColumns, ...]
    events: tuple[tuple[StepEvent, ...], ...]
    num_steps: int
    wall_s: float
    traces: tuple[StepTrace, ...] = ()

    @functools.cached_property
    def requests(self) -> Any:
        """One row per request, in arrival order: the fields of
        :class:`~llmlab.experiments.metrics.RequestRecord` (no token ids) plus ``replica``,
        ``ttft_s`` and ``e2e_s``. Built when first read (a million-request run need not
        hold it)."""
        import pandas as pd

        frames = []
        for i, columns in enumerate(self.records):
            frame = columns.to_pandas()
            frame.insert(1, "replica", i)
            frames.append(frame)
        requests = pd.concat(frames, ignore_index=True)
        requests = requests.sort_values("request_id", ignore_index=True)
        requests["ttft_s"] = requests["first_token_s"] - requests["arrival_s"]
        requests["e2e_s"] = requests["finish_s"] - requests["arrival_s"]
        return requests

    @property
    def overall(self) -> Any:
        """The ``"overall"`` row of :attr:`table`."""
        return self.table.loc["overall"]

    def __repr__(self) -> str:
        return (
            f"SimulationResult({self.name!r}: {sum(map(len, self.records))} requests, "
            f"{self.num_steps} steps in {self.wall_s:.2f} s)\n{self.table.to_string()}"
        )

    def _repr_html_(self) -> str:
        return self.table.to_html(float_format=lambda x: f"{x:.4g}")


def simulate(
    workload: Iterable[WorkloadRequest],
    *,
    model: Any = None,
    replicas: int = 1,
    router: Any = "round_robin",
    progress: bool = True,
    keep_events: bool = False,
    name: str | None = None,
    **engine_kwargs: Any,
) -> SimulationResult:
    """Run ``workload`` on ``replicas`` simulated engines of ``model`` behind ``router``.

    Args:
        workload: a :class:`~llmlab.experiments.Workload`, a trace
            (:func:`~llmlab.sim.traces.read_trace`), or any iterable of
            :class:`~llmlab.experiments.WorkloadRequest` in arrival order.
        model: what :func:`~llmlab.sim.engine.sim_engine` takes (None: the built-in model).
        replicas: engine replicas, each with its own KV cache and scheduler.
        router: a :class:`~llmlab.routing.policy.RoutingPolicy` or a registered name
            (``round_robin``, ``least_loaded``, ``prefix_aware``, ``session_affinity``).
        progress: a progress bar (requests finished).
        keep_events: keep every replica's ``StepEvent``s in the result (memory grows with
            the run; off for long traces).
        engine_kwargs: :func:`~llmlab.sim.engine.sim_engine`'s keywords (``cost_model``,
            ``hardware``, ``LLM``'s settings and policies); a component instance is copied
            for each replica so replicas never share policy state (the cost model is shared).

    Raises ``ValueError`` before anything runs for a bad setting (naming it), and during the
    run for a workload out of arrival order or a router answering outside the replicas.
    """
    from llmlab.sim.engine import sim_engine

    replicas = as_int("replicas", replicas, min=1)
    if "clock" in engine_kwargs:
        raise ValueError(
            "simulate keeps one virtual clock per replica, starting at 0; it takes no clock "
            "(give one to sim_engine to drive a single engine yourself)"
        )
    router = _router(router)
    engines = []
    for _ in range(replicas):
        kwargs = {
            k: v if k == "cost_model" or isinstance(v, (str, int, float, bool, type(None)))
            else copy.deepcopy(v)
            for k, v in engine_kwargs.items()
        }
        engines.append(sim_engine(model, **kwargs))
    views = [EngineReplica(i, engine) for i, engine in enumerate(engines)]
    total = len(workload) if isinstance(workload, Sized) else None
    bar = ProgressBar(total, name or "simulate", enabled=progress)
    collectors = [
        RunCollector(engine.clock(), keep_events=keep_events, keep_tokens=False,
                     on_finish=bar.finished, compact=True)
        for engine in engines
    ]
    for engine, collector in zip(engines, collectors, strict=True):
        engine.subscribe(collector)
    on_finish = getattr(router, "on_finish", None)
    started = time.perf_counter()
    num_steps = 0
    try:
        with frozen_heap():
            num_steps = _run(workload, router, engines, views, collectors, on_finish)
    finally:
        bar.close()
        for engine, collector in zip(engines, collectors, strict=True):
            engine.unsubscribe(collector)
            abort_quietly(engine, collector.unfinished())
    wall_s = time.perf_counter() - started
    return _result(name or getattr(workload, "name", "workload"), engines, collectors,
                   num_steps, wall_s, name_of(router))


def _run(workload, router, engines, views, collectors, on_finish) -> int:
    """The discrete-event loop; returns the number of steps taken."""
    arrivals = iter(workload)
    pending = next(arrivals, None)
    previous = 0.0
    num_added = num_steps = idle_steps = 0
    clocks = [engine.clock for engine in engines]
    while True:
        busy, busy_at = -1, 0.0
        for i, engine in enumerate(engines):
            if engine.scheduler.num_unfinished:
                at = clocks[i]()
                if busy < 0 or at < busy_at:
                    busy, busy_at = i, at
        if pending is not None and (busy < 0 or pending.arrival_time <= busy_at):
            previous = check_arrival(pending, previous, num_added)
            request_id = str(num_added)
            route = _Route(request_id, pending.prompt_token_ids, pending.max_tokens,
                           pending.user, pending.session)
            chosen = check_choice(router, router.route(route, views), len(views))
            engine = engines[chosen]
            if not engine.scheduler.num_unfinished:  # an idle replica wakes at the arrival
                clocks[chosen].advance(max(pending.arrival_time - clocks[chosen](), 0.0))
            collectors[chosen].add(request_id, pending)
            views[chosen].routed(request_id, pending.num_prompt_tokens, pending.max_tokens)
            add_workload_request(engine, pending, request_id, 0.0)
            num_added += 1
            pending = next(arrivals, None)
        elif busy >= 0:
            collector = collectors[busy]
            collector.before_step()
            before = collector.last_end_s
            for out in engines[busy].step():
                record = collector.output(out)
                if record is not None and on_finish is not None:
                    on_finish(record.request_id, busy)
            num_steps += 1
            idle_steps = 0 if collector.last_end_s != before else idle_steps + 1
            if idle_steps > _MAX_IDLE_STEPS:
                raise RuntimeError(
                    f"replica {busy} holds {engines[busy].get_num_unfinished_requests()} "
                    f"request(s) but made no progress in {_MAX_IDLE_STEPS} steps"
                )
        else:
            return num_steps


def _router(router: Any) -> Any:
    if isinstance(router, str):
        return registry.resolve("router", router)()
    registry.check("router", router)
    return router


def _result(name, engines, collectors, num_steps, wall_s, router) -> SimulationResult:
    import pandas as pd

    users = list(dict.fromkeys(u for c in collectors for u in c.columns.user))
    names = {**component_names(engines[0]), "router": router}
    rows = {
        f"replica {i}": {**names, **summarize(c.columns, c.trace, users)}
        for i, c in enumerate(collectors)
    }
    everyone = RecordColumns()
    for collector in collectors:
        everyone.extend(collector.columns)
    traces = tuple(c.trace for c in collectors)
    overall = {**names, **summarize(everyone, merge_traces(traces), users)}
    del everyone
    table = pd.DataFrame.from_dict({**rows, "overall": overall}, orient="index")
    table.index.name = "replica"
    events = tuple(tuple(t.events) for t in traces)
    records = tuple(c.columns for c in collectors)
    return SimulationResult(name, table, records, events, num_steps, wall_s, traces)
