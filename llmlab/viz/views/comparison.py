"""``PolicyComparison``: an :func:`llmlab.experiments.compare` result drawn for notebooks and
papers (metrics table, bar charts, per-step hit rate and KV usage per configuration)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from llmlab.viz.state import MetricSeries, SchedulerSeries
from llmlab.viz.views.base import _png


class PolicyComparison:
    """An :func:`llmlab.experiments.compare` result for notebooks and papers: the metrics
    table, one bar chart per key metric, and each configuration's prefix-cache hit rate and
    KV usage step by step, side by side.

    Build it from a ``Comparison`` or run one: ``PolicyComparison.run(workload, configs,
    model=...)`` takes :func:`~llmlab.experiments.compare`'s arguments.
    """

    def __init__(self, comparison: Any) -> None:
        from llmlab.experiments import Comparison

        if not isinstance(comparison, Comparison):
            raise TypeError(
                f"PolicyComparison takes an llmlab.experiments.Comparison, got "
                f"{type(comparison).__name__}"
            )
        self.comparison = comparison
        self._widget = None

    @classmethod
    def run(cls, workload: Any, configs: Any, **kwargs: Any) -> PolicyComparison:
        from llmlab.experiments import compare

        return cls(compare(workload, configs, **kwargs))

    @property
    def table(self):
        return self.comparison.table

    def series(self) -> dict[str, SchedulerSeries]:
        """Per configuration, its scheduler series (from the recorded events)."""
        out = {}
        for label, events in self.comparison.events.items():
            series = SchedulerSeries()
            for event in events:
                series.apply(event)
            out[label] = series
        return out

    def figure(self, metrics: Any = None):
        """Bar charts of the key metrics (default: those with a value in some run), then
        each run's prefix-cache hit rate and KV usage per step."""
        from matplotlib.figure import Figure

        fig = Figure(figsize=(13, 8.5), layout="constrained")
        bars, lines = fig.subfigures(2, 1, height_ratios=[1.2, 1])
        self.comparison.figure(metrics, fig=bars)
        hits, usage = lines.subplots(1, 2)
        for i, label in enumerate(self.comparison.events):
            series = MetricSeries()
            for event in self.comparison.events[label]:
                series.apply(event)
            color = f"C{i % 10}"
            hits.plot(series.hit_rate, color=color, label=label)
            usage.plot(series.kv_usage, color=color, label=label)
        hits.set_title("prefix-cache hit rate (cumulative, tokens)", fontsize="medium")
        usage.set_title("KV cache usage (blocks held by requests)", fontsize="medium")
        for ax in (hits, usage):
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("step")
            ax.legend(fontsize="small")
        return fig

    @property
    def widget(self):
        if self._widget is None:
            import ipywidgets as w

            table = w.HTML(self.comparison._repr_html_())
            image = w.Image(value=_png(self.figure()), format="png")
            self._widget = w.VBox([table, image])
        return self._widget

    def display(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _ipython_display_(self) -> None:
        self.display()

    def to_png(self, path: str | os.PathLike, *, dpi: int = 150) -> pathlib.Path:
        path = pathlib.Path(path)
        self.figure().savefig(path, dpi=dpi)
        return path
