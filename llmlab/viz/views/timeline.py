"""``SchedulerTimeline``: running, waiting and preempted requests and the batch's prefill vs
decode tokens, per step."""

from __future__ import annotations

import copy

import numpy as np

from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.viz.state import SchedulerSeries
from llmlab.viz.views.base import _PlotView


class SchedulerTimeline(_PlotView):
    """Running / waiting / preempted requests, and the batch's prefill vs decode tokens,
    per step. ``series`` holds the numbers (:class:`~llmlab.viz.state.SchedulerSeries`)."""

    def _reset(self, snapshot: EngineSnapshot) -> None:
        self.series = SchedulerSeries()

    def _apply(self, event: StepEvent) -> None:
        self.series.apply(event)

    def _capture(self) -> SchedulerSeries:
        return copy.deepcopy(self.series)

    def figure(self, series: SchedulerSeries | None = None):
        """The two panels as a matplotlib ``Figure`` (of ``series``, default the view's)."""
        from matplotlib.figure import Figure

        s = self.series if series is None else series
        fig = Figure(figsize=(9, 4.2), layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True)
        steps = np.asarray(s.step)
        top.plot(steps, s.running, label="running", color="C0")
        top.plot(steps, s.waiting, label="waiting", color="C1")
        top.plot(steps, s.preempted, label="preempted (to resume)", color="C3")
        top.set_ylabel("requests")
        top.legend(fontsize="small", loc="upper right")
        prefill = np.asarray(s.prefill_tokens)
        decode = np.asarray(s.decode_tokens)
        bottom.bar(steps, prefill, width=1.0, label="prefill", color="C2", linewidth=0)
        bottom.bar(steps, decode, width=1.0, bottom=prefill, label="decode", color="C4",
                   linewidth=0)  # fmt: skip
        hits = steps[np.asarray(s.preemptions) > 0]
        if hits.size:
            top.plot(hits, np.zeros_like(hits), "v", color="C3", markersize=5)
        bottom.set_ylabel("tokens in batch")
        bottom.set_xlabel("step")
        bottom.legend(fontsize="small", loc="upper right")
        fig.suptitle(f"scheduler: {len(s)} steps", fontsize="medium")
        return fig
