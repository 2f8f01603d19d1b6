"""``MetricsPanel``: TTFT and TPOT distributions, prefix-cache hit rate and KV usage over
time."""

from __future__ import annotations

import copy

import numpy as np

from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.viz.state import MetricSeries
from llmlab.viz.views.base import _PlotView


class MetricsPanel(_PlotView):
    """TTFT and TPOT distributions, prefix-cache hit rate and KV usage over time.
    ``metrics`` holds the numbers (:class:`~llmlab.viz.state.MetricSeries`)."""

    def _reset(self, snapshot: EngineSnapshot) -> None:
        self.metrics = MetricSeries()
        self._t0 = snapshot.time_s

    def _apply(self, event: StepEvent) -> None:
        self.metrics.apply(event)

    def _capture(self) -> MetricSeries:
        return copy.deepcopy(self.metrics)

    def figure(self, metrics: MetricSeries | None = None):
        """The four panels as a matplotlib ``Figure`` (of ``metrics``, default the view's)."""
        from matplotlib.figure import Figure

        m = self.metrics if metrics is None else metrics
        fig = Figure(figsize=(10, 5), layout="constrained")
        (ttft, tpot), (hits, usage) = fig.subplots(2, 2)
        for ax, values, name in ((ttft, m.ttft_s, "TTFT"), (tpot, m.tpot_s, "TPOT")):
            ms = np.asarray(values) * 1e3
            if ms.size:
                ax.hist(ms, bins=min(30, max(5, ms.size // 2)), color="C0")
                p50, p99 = np.percentile(ms, [50, 99])
                ax.axvline(p50, color="C1", label=f"p50 {p50:.3g} ms")
                ax.axvline(p99, color="C3", label=f"p99 {p99:.3g} ms")
                ax.legend(fontsize="small")
            ax.set_title(f"{name} ({ms.size} requests)", fontsize="medium")
            ax.set_xlabel("ms")
        t = np.asarray(m.time_s) - self._t0
        hits.plot(t, m.hit_rate, color="C2")
        hits.set_ylim(0, 1.02)
        hits.set_title("prefix-cache hit rate (cumulative, tokens)", fontsize="medium")
        usage.plot(t, m.kv_usage, color="C4")
        usage.set_ylim(0, 1.02)
        usage.set_title("KV cache usage", fontsize="medium")
        for ax in (hits, usage):
            ax.set_xlabel("seconds since the view started")
        return fig
