"""Real against simulated: the per-request distributions overlaid, and the signed errors.

    real = compare(workload, {"real": {}}, model=path)
    sim = compare(workload, {"sim": {"cost_model": cost}}, model=path, executor="sim")
    overlay({"real": real.requests, "simulated": sim.requests}).savefig("overlay.png")
    errors(real.table.loc["real"], sim.table.loc["sim"])   # {metric: signed relative error}

matplotlib and pandas are imported when a figure or table is made.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

ACCURACY_METRICS = ("makespan_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "e2e_mean_s")
"""The summary metrics the simulator's accuracy is judged on (BENCHMARKS.md)."""

_PANELS = (("ttft_s", "TTFT (s)"), ("tpot_s", "TPOT (s)"), ("e2e_s", "end-to-end latency (s)"))


def per_request(frame: Any) -> Any:
    """``frame`` (a ``requests`` table of ``compare`` or ``simulate``) with ``tpot_s``
    added: ``(finish - first token) / (output tokens - 1)``, NaN with one output token."""
    frame = frame.copy()
    extra = frame["num_output_tokens"] - 1
    frame["tpot_s"] = (frame["finish_s"] - frame["first_token_s"]) / extra.where(extra > 0)
    return frame


def overlay(runs: Mapping[str, Any], *, metrics: Sequence[str] | None = None, fig=None):
    """A matplotlib ``Figure``: for each metric (default TTFT, TPOT, e2e), the empirical
    CDF of every run's per-request values on one axis. ``runs``: ``{label: requests
    table}``. Built with the object API (no display needed); ``fig``: draw into it."""
    import numpy as np
    from matplotlib.figure import Figure

    titles = dict(_PANELS)
    names = list(metrics) if metrics is not None else [m for m, _ in _PANELS]
    if not runs:
        raise ValueError("overlay needs at least one run: {label: requests table}")
    frames = {label: per_request(frame) for label, frame in runs.items()}
    for label, frame in frames.items():
        missing = [m for m in names if m not in frame.columns]
        if missing:
            raise ValueError(f"run {label!r} has no column(s) {missing}")
    if fig is None:
        fig = Figure(figsize=(3.6 * len(names), 3.0), layout="constrained")
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        for i, (label, frame) in enumerate(frames.items()):
            values = np.sort(frame[name].dropna().to_numpy(dtype=float))
            if values.size:
                cdf = np.arange(1, values.size + 1) / values.size
                ax.step(values, cdf, where="post", label=label, color=f"C{i % 10}",
                        linestyle="-" if i == 0 else "--")
        ax.set_xlabel(titles.get(name, name))
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return fig


def errors(real: Mapping[str, float], simulated: Mapping[str, float],
           metrics: Sequence[str] = ACCURACY_METRICS) -> dict[str, float]:
    """Signed relative error of each metric, ``(simulated - real) / real`` (NaN where the
    real value is 0 or missing): rows of two results tables, or any mappings."""
    out = {}
    for m in metrics:
        a, b = float(real[m]), float(simulated[m])
        out[m] = (b - a) / a if a and not math.isnan(a) else math.nan
    return out
