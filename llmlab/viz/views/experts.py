"""``ExpertLoadView``: how a mixture-of-experts model's tokens spread over its experts, step
by step (a heatmap per sparse layer) and how unevenly (the busiest expert over the mean).

It reads ``StepEvent.expert_load``, which an engine fills with ``record_expert_load=True``
(:mod:`llmlab.models.expert_load`); steps without it (another model, the setting off) are
skipped. ``series`` holds the numbers (:class:`ExpertLoadSeries`), so what the figure
draws can be read without drawing it.
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import numpy as np

from llmlab.models.expert_load import ExpertLoad
from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.viz.views.base import _PlotView


@attrs.define
class ExpertLoadSeries:
    """Per step that carried an expert load: its ``step`` index and counts.

    Attributes:
        step: the event's ``step_index``, one per recorded step.
        loads: the step's :class:`~llmlab.models.expert_load.ExpertLoad`, same order.
    """

    step: list[int] = attrs.field(factory=list)
    loads: list[ExpertLoad] = attrs.field(factory=list)

    def apply(self, event: StepEvent) -> None:
        if event.expert_load is not None:
            self.step.append(event.step_index)
            self.loads.append(event.expert_load)

    def __len__(self) -> int:
        return len(self.step)

    @property
    def layers(self) -> tuple[int, ...]:
        """The model's sparse layer indices (empty before the first load)."""
        return self.loads[0].layers if self.loads else ()

    def counts(self) -> np.ndarray:
        """``[steps, layers, experts]`` tokens per expert (int64)."""
        if not self.loads:
            return np.zeros((0, 0, 0), dtype=np.int64)
        return np.array([load.counts for load in self.loads], dtype=np.int64)

    def heatmap(self, layer: int, normalize: bool = True) -> np.ndarray:
        """``[experts, steps]`` for the model layer ``layer`` (one of :attr:`layers`): each
        step's tokens per expert, or with ``normalize`` the share of the step's tokens that
        picked each expert (a column sums to ``top_k``)."""
        if layer not in self.layers:
            raise ValueError(f"layer must be one of the sparse layers {self.layers}, got {layer!r}")
        grid = self.counts()[:, self.layers.index(layer), :].T.astype(np.float64)
        if normalize:
            tokens = np.array([load.num_tokens for load in self.loads], dtype=np.float64)
            grid = grid / np.maximum(tokens, 1.0)
        return grid

    def imbalance(self) -> np.ndarray:
        """``[steps, layers]``: per step and layer, the busiest expert's tokens over the
        mean per expert (1: even; ``experts / top_k`` for a single token)."""
        return np.array([load.imbalance() for load in self.loads], dtype=np.float64).reshape(
            len(self.loads), len(self.layers))

    def run_imbalance(self) -> np.ndarray:
        """``[layers]``: the same over the run's totals (each expert's tokens summed over
        every step): the skew the router shows, not one small step's sampling noise."""
        if not self.loads:
            return np.zeros(0)
        return np.array(ExpertLoad.total(self.loads).imbalance(), dtype=np.float64)


class ExpertLoadView(_PlotView):
    """Expert load heatmaps over steps (one per sparse layer, or the one ``layer``), and the
    imbalance per layer: per step and over the run. Follows an ``LLM`` / ``Engine`` /
    ``AsyncEngine`` from now on, or replays a recording (or its path) with a slider.

    Args:
        layer: the model layer to draw (one of its sparse layers); None: every sparse layer.
        normalize: color each step by the share of its tokens each expert got (else raw
            token counts, where a long prefill outshines every decode).
        interval: for an engine followed live, the least seconds between redraws.
    """

    def __init__(self, source: Any, *, layer: int | None = None, normalize: bool = True,
                 interval: float | None = None) -> None:
        if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
            raise ValueError(f"layer must be a layer index (int) or None, got {layer!r}")
        self.layer = layer
        self.normalize = bool(normalize)
        super().__init__(source, interval=interval)

    def _reset(self, snapshot: EngineSnapshot) -> None:
        self.series = ExpertLoadSeries()

    def _apply(self, event: StepEvent) -> None:
        self.series.apply(event)

    def _capture(self) -> ExpertLoadSeries:
        return copy.deepcopy(self.series)

    def figure(self, series: ExpertLoadSeries | None = None):
        """The heatmaps (one row per drawn layer) and the imbalance panels as a matplotlib
        ``Figure`` (of ``series``, default the view's)."""
        from matplotlib.figure import Figure

        s = self.series if series is None else series
        layers = s.layers if self.layer is None else (self.layer,)
        if self.layer is not None and s.loads and self.layer not in s.layers:
            raise ValueError(
                f"layer must be one of the sparse layers {s.layers}, got {self.layer!r}"
            )
        rows = max(len(layers), 1)
        fig = Figure(figsize=(10, 1.6 * rows + 2.6), layout="constrained")
        grid = fig.add_gridspec(rows + 1, 2, width_ratios=(3, 1),
                                height_ratios=(*([1.0] * rows), 1.3))
        if not s.loads:
            ax = fig.add_subplot(grid[:, :])
            ax.text(0.5, 0.5, "no expert load yet (record_expert_load=True on an MoE model)",
                    ha="center", va="center")
            ax.set_axis_off()
            return fig
        steps = np.asarray(s.step)
        extent = (steps[0] - 0.5, steps[-1] + 0.5, s.loads[0].num_experts - 0.5, -0.5)
        label = "share of the step's tokens" if self.normalize else "tokens"
        for i, layer in enumerate(layers):
            ax = fig.add_subplot(grid[i, :])
            # Shares on one scale for every layer (a share is at most 1).
            scale = {"vmin": 0.0, "vmax": 1.0} if self.normalize else {}
            image = ax.imshow(s.heatmap(layer, self.normalize), aspect="auto",
                              interpolation="nearest", cmap="viridis", extent=extent, **scale)
            ax.set_ylabel(f"layer {layer}\nexpert")
            if i == rows - 1:
                ax.set_xlabel("step")
            fig.colorbar(image, ax=ax, label=label if i == 0 else None, pad=0.01)
        per_step, overall = fig.add_subplot(grid[rows, 0]), fig.add_subplot(grid[rows, 1])
        imbalance = s.imbalance()
        for j, layer in enumerate(s.layers):
            per_step.plot(steps, imbalance[:, j], lw=1, label=f"layer {layer}")
        per_step.axhline(1.0, color="0.5", lw=0.8, ls="--")
        per_step.set_ylabel("busiest / mean")
        per_step.set_xlabel("step")
        per_step.set_title("imbalance per step", fontsize="medium")
        if len(s.layers) <= 8:
            per_step.legend(fontsize="small", loc="upper right")
        overall.bar([str(layer) for layer in s.layers], s.run_imbalance(), color="C1")
        overall.axhline(1.0, color="0.5", lw=0.8, ls="--")
        overall.set_xlabel("layer")
        overall.set_title("over the run", fontsize="medium")
        fig.suptitle(f"expert load: {len(s)} steps, {s.loads[0].num_experts} experts, "
                     f"top {s.loads[0].top_k}", fontsize="medium")
        return fig
