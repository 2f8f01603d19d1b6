"""Following one engine through a workload run: records per request, a trace per step.

A :class:`RunCollector` observes the engine's ``StepEvent``s (it is subscribed as an
observer) and reads each request's final output; every time it keeps comes from an
event's ``end_time_s`` on the engine's clock, so a simulated run (virtual clock) and a
real one (``time.monotonic``) are measured by the same code. The single-engine run loop
(:func:`~llmlab.experiments.driver.run_workload`) uses one; the data-parallel one
(:func:`~llmlab.experiments.driver.run_replicated`) and the simulator's cluster loop one
per replica.
"""

from __future__ import annotations

from collections import Counter

from llmlab.observe.events import StepEvent
from llmlab.engine.outputs import RequestOutput
from llmlab.experiments.metrics import RecordColumns, RequestRecord, StepTrace
from llmlab.experiments.workloads import WorkloadRequest


class RunCollector:
    """Records and a :class:`~llmlab.experiments.metrics.StepTrace` of one engine's run.

    Args:
        t0: the engine-clock time the run started (record times are seconds since then).
        keep_events: keep every ``StepEvent`` in the trace (a long simulation drops them).
        keep_tokens: keep each request's output token ids in its record.
        on_finish: called with each record when its request finishes (progress bars,
            routers' bookkeeping).
        compact: move each finished request's record into :attr:`columns` (a few numbers
            each), so a run of millions of requests keeps only the unfinished ones as
            objects; ``records`` then holds those.
    """

    def __init__(self, t0: float, *, keep_events: bool = True, keep_tokens: bool = True,
                 on_finish=None, compact: bool = False) -> None:
        self.t0 = t0
        self.records: dict[str, RequestRecord] = {}
        self.columns: RecordColumns | None = RecordColumns() if compact else None
        self.trace = StepTrace(keep_events=keep_events)
        self.keep_tokens = keep_tokens
        self.on_finish = on_finish
        self.num_finished = 0
        self.last_end_s: float | None = None  # the latest event's end, engine clock
        self._unfinished: Counter = Counter()  # per user: arrived, not finished
        self._arrival_step: dict[str, int] = {}  # request -> the step that reported it
        self._backlogged: frozenset = frozenset()

    def add(self, request_id: str, request: WorkloadRequest) -> RequestRecord:
        """A record for a request being added now (arrival: its workload time)."""
        record = RequestRecord(
            request_id=request_id, user=request.user, priority=request.priority,
            arrival_s=request.arrival_time, num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
        )
        self.records[request_id] = record
        self._unfinished[request.user] += 1
        return record

    def before_step(self) -> None:
        """Note who is backlogged as a step begins (for the fairness metric)."""
        self._backlogged = frozenset(u for u, n in self._unfinished.items() if n)

    def __call__(self, event: StepEvent) -> None:
        self.trace.append(event, self._backlogged)
        self.last_end_s = event.end_time_s
        now = event.end_time_s - self.t0
        step = self.trace.num_steps - 1  # this event's, counted as the trace counts
        arrival_step = self._arrival_step
        for arrival in event.arrived:
            arrival_step.setdefault(arrival.request_id, step)
        records = self.records
        for request_id, num_tokens in event.sampled:
            record = records.get(request_id)
            if record is not None and record.first_token_s is None:
                record.first_token_s = now
            if record is not None and num_tokens and record.ttft_steps is None:
                record.ttft_steps = step - arrival_step.get(request_id, step) + 1
        for request_id, reason in event.finished:
            record = records.get(request_id)
            if record is not None and record.finish_s is None:
                record.finish_s = now
                record.finish_reason = reason
                record.e2e_steps = step - arrival_step.pop(request_id, step) + 1
                self._unfinished[record.user] -= 1
                self.num_finished += 1

    def output(self, out: RequestOutput) -> RequestRecord | None:
        """Read a request's output; returns its record once it is final."""
        record = self.records.get(out.request_id)
        if record is None or not out.finished:
            return None
        completion = out.outputs[0]
        record.num_output_tokens = len(completion.token_ids)
        if self.keep_tokens:
            record.output_token_ids = tuple(completion.token_ids)
        record.num_cached_tokens = out.num_cached_tokens
        if record.finish_reason is None:
            record.finish_reason = completion.finish_reason
        if self.on_finish is not None:
            self.on_finish(record)
        if self.columns is not None:
            self.columns.append(self.records.pop(out.request_id))
        return record

    def unfinished(self) -> list[str]:
        """Ids of the requests added and not finished."""
        return [i for i, r in self.records.items() if r.finish_s is None]
