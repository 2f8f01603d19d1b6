"""Notebook views of a running engine or a recording (ipywidgets + matplotlib).

Every view is fed by step events only: attached to a live engine it starts from
``Engine.observe`` (a snapshot, then each event as it happens); given a
:class:`~llmlab.engine.recording.Recording` it replays the same events with a slider and a
play button. Redraws are throttled (at most every ``interval`` seconds, and at most a
``draw_budget`` share of the time) so watching costs the engine little; once events stop
(the engine went idle or paused) a timer draws the newest state, so the last frame is
always shown. Each
view has ``display()``, ``figure()`` (a matplotlib ``Figure``) and ``to_png(path)``.

ipywidgets is imported only when a widget is shown; ``figure``/``to_png`` need only
matplotlib, so views work in scripts and tests too.
"""

from __future__ import annotations

import copy
import html
import io
import os
import pathlib
import threading
import time
from typing import Any

import numpy as np

from llmlab.engine.events import EngineSnapshot, StepEvent
from llmlab.engine.recording import Recording, load
from llmlab.viz.state import (
    CACHED,
    EMPTY,
    SHARED,
    Frame,
    KVCacheState,
    MetricSeries,
    SchedulerSeries,
)

# Request colors: matplotlib's tab20 without its grays (gray means "cached" here), dark
# shades first so neighbouring requests differ clearly.
PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
    "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5",
    "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
)  # fmt: skip
EMPTY_COLOR = "#eeeeee"
CACHED_COLOR = "#b5b5b5"
SHARED_MARK = "inset 0 0 0 2px #111"
PARTIAL_WASH = "rgba(255,255,255,0.6)"


def request_color(index: int) -> str:
    """The color of the request with this index in a frame's ``requests``."""
    return PALETTE[index % len(PALETTE)]


def _engine_of(source: Any):
    """The ``Engine`` behind an ``LLM``, ``AsyncEngine`` or ``Engine``."""
    from llmlab.engine.engine import Engine

    for candidate in (source, getattr(source, "llm_engine", None), getattr(source, "engine", None)):
        if isinstance(candidate, Engine):
            return candidate
    raise TypeError(
        "a view watches an LLM, Engine or AsyncEngine, or replays a Recording (or the path "
        f"of one); got {type(source).__name__}"
    )


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    return buffer.getvalue()


class _View:
    """Live-or-replay plumbing shared by the views: subclasses fold events into a model
    (``_reset``/``_apply``), copy what a drawing needs (``_capture``) and draw it
    (``_show`` into the widget, ``figure``)."""

    interval: float = 0.25
    # Most of the wall time drawing may take: after a draw that took ``c`` seconds the
    # next waits at least ``c / draw_budget`` (so a slow renderer cannot slow the engine).
    draw_budget: float = 0.02

    def __init__(self, source: Any, *, interval: float | None = None) -> None:
        if interval is not None:
            if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval < 0:
                raise ValueError(f"interval must be a number of seconds >= 0, got {interval!r}")
            self.interval = float(interval)
        self._engine = None
        self._widget = None
        self._next_draw = 0.0
        self._stale = False  # events applied since the last draw
        self._trailing: threading.Timer | None = None
        self._trailing_due = 0.0
        if isinstance(source, (str, os.PathLike)):
            source = load(source)
        self.recording: Recording | None = source if isinstance(source, Recording) else None
        if self.recording is not None:
            self._events = self.recording.events
            self._snapshot = self.recording.snapshot
            self._reset(self._snapshot)
            self.position = 0
            self.seek(len(self._events))
        else:
            self._engine = _engine_of(source)
            self._events = ()
            self.position = None
            # Holding the engine's (reentrant) lock until the model is set up: no event can
            # arrive before it.
            with self._engine._lock:
                self._snapshot = self._engine.observe(self._on_event)
                self._reset(self._snapshot)

    # -- live ------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Whether the view follows an engine (False: it replays a recording)."""
        return self._engine is not None

    def _on_event(self, event: StepEvent) -> None:
        # Runs inside the engine's step. A draw due now happens here, charged to the step
        # but bounded by the budget; otherwise a timer draws the newest state if no event
        # comes first (the engine went idle or paused), when the engine is not running. A
        # renderer on another thread *while* the engine runs would cost more than drawing
        # inline: it holds the GIL the engine thread keeps needing back.
        self._apply(event)
        self._stale = True
        if self._widget is None:
            return
        now = time.monotonic()
        if event.num_running == 0 and event.num_waiting == 0:
            self._draw_later(now)
        elif now >= self._next_draw:
            self._cancel_trailing()
            self.refresh()
        else:
            self._draw_later(self._next_draw)

    def _draw_later(self, due: float) -> None:
        if self._trailing is not None:
            if self._trailing_due <= due:
                return
            self._trailing.cancel()
        self._trailing_due = due
        self._trailing = threading.Timer(max(0.0, due - time.monotonic()), self._draw_trailing)
        self._trailing.daemon = True
        self._trailing.start()

    def _cancel_trailing(self) -> None:
        if self._trailing is not None:
            self._trailing.cancel()
            self._trailing = None

    def _draw_trailing(self) -> None:
        # Copy under the engine's lock (no event is half-applied meanwhile), draw outside it.
        me = threading.current_thread()
        with self._engine._lock:
            if self._trailing is not me:
                return  # cancelled after it had started
            data = self._capture() if self._stale else None
            self._stale = False
        try:
            if data is not None:
                self._show_timed(data)
        finally:
            with self._engine._lock:
                if self._trailing is me:
                    self._trailing = None
                    if self._stale:  # events came while drawing: draw them too
                        self._draw_later(self._next_draw)

    def close(self) -> None:
        """Stop following the engine (the widget keeps its last frame); waits for a draw
        in progress on the timer thread."""
        timer = self._trailing
        self._cancel_trailing()
        if timer is not None and timer is not threading.current_thread():
            timer.join(timeout=10)
        if self._engine is not None and self._on_event in self._engine.observers:
            self._engine.unsubscribe(self._on_event)

    def refresh(self) -> None:
        """Redraw the widget now (throttling aside)."""
        self._stale = False
        if self._widget is not None:
            self._show_timed(self._capture())

    def _show_timed(self, data: Any) -> None:
        start = time.monotonic()
        self._show(data)
        end = time.monotonic()
        self._next_draw = end + max(self.interval, (end - start) / self.draw_budget)

    # -- replay ----------------------------------------------------------------------

    def seek(self, position: int) -> None:
        """Show the state after the first ``position`` events of the recording."""
        if self.recording is None:
            raise ValueError("seek() is for replaying a recording; this view is live")
        if not isinstance(position, int) or not 0 <= position <= len(self._events):
            raise ValueError(
                f"position must be an int in [0, {len(self._events)}], got {position!r}"
            )
        self._seek(position)
        self.position = position
        if self._widget is not None:
            self._show(self._capture())

    def _seek(self, position: int) -> None:
        # Default: rebuild from the snapshot (cheap for series; the KV view checkpoints).
        if position < (self.position or 0):
            self._reset(self._snapshot)
            start = 0
        else:
            start = self.position or 0
        for event in self._events[start:position]:
            self._apply(event)

    # -- display ---------------------------------------------------------------------

    @property
    def widget(self):
        """The ipywidgets widget (built on first use)."""
        if self._widget is None:
            import ipywidgets as w

            body = self._build_widget(w)
            if self.recording is not None:
                play = w.Play(
                    value=self.position, min=0, max=len(self._events), step=1, interval=100
                )
                slider = w.IntSlider(
                    value=self.position,
                    min=0,
                    max=len(self._events),
                    description="step",
                    continuous_update=True,
                    layout=w.Layout(width="420px"),
                )
                w.jslink((play, "value"), (slider, "value"))
                slider.observe(lambda change: self.seek(change["new"]), names="value")
                body = w.VBox([w.HBox([play, slider]), body])
            self._widget = body
            self.refresh()
        return self._widget

    def display(self) -> None:
        """Show the view in a notebook (its widget; a static picture if ipywidgets is
        missing)."""
        from IPython.display import Image, display

        try:
            display(self.widget)
        except ImportError:
            display(Image(_png(self.figure())))

    def _ipython_display_(self) -> None:
        self.display()

    def to_png(self, path: str | os.PathLike, *, dpi: int = 150) -> pathlib.Path:
        """Save :meth:`figure` as a PNG (for papers); returns the path."""
        path = pathlib.Path(path)
        fig = self.figure()
        fig.savefig(path, dpi=dpi)
        return path

    # -- for subclasses --------------------------------------------------------------

    def _reset(self, snapshot: EngineSnapshot) -> None:
        raise NotImplementedError

    def _apply(self, event: StepEvent) -> None:
        raise NotImplementedError

    def _build_widget(self, w):
        raise NotImplementedError

    def _capture(self) -> Any:
        """A copy of what a drawing needs, safe to draw from another thread."""
        raise NotImplementedError

    def _show(self, data: Any) -> None:
        raise NotImplementedError

    def figure(self):
        raise NotImplementedError


# -- the KV cache ----------------------------------------------------------------------


class KVCacheView(_View):
    """The block pool as a grid: one cell per block, colored by the request that owns it.

    Shared blocks (prefix hits, parallel samples) carry a dark outline; a partly written
    block (the last of each request) is washed out beyond its filled part; free blocks
    whose KV is still in the prefix cache are gray, empty ones near-white. Hovering a cell gives
    the block, its owner, tokens stored and ref count. Pools with more than ``max_cells``
    blocks are drawn aggregated: each cell stands for a run of consecutive blocks and shows
    the state most of them are in (and the commonest owner).

    Args:
        source: an ``LLM``, ``Engine`` or ``AsyncEngine`` to watch live, or a
            :class:`~llmlab.engine.recording.Recording` (or its path) to replay.
        max_cells: most cells to draw before aggregating.
        interval: least seconds between two redraws while the engine runs.
        cell_px: cell size in pixels (default: 18 for up to 128 cells, 14 up to 512, else 10).

    ``frame`` is the current :class:`~llmlab.viz.state.Frame`; ``frames`` keeps every
    frame when ``keep_frames=True`` (for tests and analysis).
    """

    _CHECKPOINT_EVERY = 64

    def __init__(
        self,
        source: Any,
        *,
        max_cells: int = 1024,
        interval: float | None = None,
        cell_px: int | None = None,
        keep_frames: bool = False,
    ) -> None:
        for name, value, low in (("max_cells", max_cells, 1), ("cell_px", cell_px, 2)):
            if value is None and name == "cell_px":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.max_cells = max_cells
        self.cell_px = cell_px
        self.frames: list[Frame] | None = [] if keep_frames else None
        self._checkpoints: dict[int, KVCacheState] = {}
        super().__init__(source, interval=interval)

    @property
    def frame(self) -> Frame:
        """The pool as last seen."""
        return self._state.frame()

    def _reset(self, snapshot: EngineSnapshot) -> None:
        self._state = KVCacheState(snapshot)
        if self.frames is not None and self.recording is None:
            self.frames.append(self._state.frame())

    def _apply(self, event: StepEvent) -> None:
        self._state.apply(event)
        if self.frames is not None and self.recording is None:
            self.frames.append(self._state.frame())

    def _seek(self, position: int) -> None:
        current = self.position or 0
        # Restart from the latest checkpoint at or before ``position`` when going back, or
        # when it lies ahead of where we are.
        base = max((p for p in self._checkpoints if p <= position), default=0)
        if position < current or base > current:
            self._state = self._checkpoints[base].copy() if base else KVCacheState(self._snapshot)
            current = base
        for i in range(current, position):
            self._state.apply(self._events[i])
            if (i + 1) % self._CHECKPOINT_EVERY == 0 and i + 1 not in self._checkpoints:
                self._checkpoints[i + 1] = self._state.copy()

    def frame_at(self, position: int) -> Frame:
        """The frame after the first ``position`` events of the recording."""
        self.seek(position)
        return self.frame

    # -- drawing ---------------------------------------------------------------------

    def _build_widget(self, w):
        self._html = w.HTML()
        return w.VBox([self._html])

    def _capture(self) -> Frame:
        return self.frame

    def _show(self, frame: Frame) -> None:
        self._html.value = self.html(frame)

    def html(self, frame: Frame | None = None) -> str:
        """The grid, legend and summary as HTML (what the widget shows)."""
        frame = self.frame if frame is None else frame
        cells = _cells(frame, self.max_cells)
        columns = max(1, min(64, int(np.ceil(np.sqrt(len(cells.color) * 2)))))
        n = len(cells.color)
        px = self.cell_px or (18 if n <= 128 else 14 if n <= 512 else 10)
        out = [
            '<div class="llmlab-kv" style="font-family:sans-serif;font-size:12px">',
            (
                f'<div class="llmlab-kv-grid" style="display:grid;width:max-content;'
                f"grid-template-columns:repeat({columns},{px}px);grid-auto-rows:{px}px;"
                f'gap:1px;margin:4px 0">'
            ),
        ]
        cells_iter = zip(cells.color, cells.shared, cells.title, cells.fill, strict=True)
        for color, shared, title, fill in cells_iter:
            mark = f";box-shadow:{SHARED_MARK}" if shared else ""
            if fill < 1.0:
                # The unfilled part of a partly written block, washed out: the slack
                # (internal fragmentation) of the last block of each request.
                pct = round(100 * fill)
                mark += (
                    f";background-image:linear-gradient(to right,transparent {pct}%,"
                    f"{PARTIAL_WASH} {pct}%)"
                )
            out.append(
                f'<div class="llmlab-kv-cell" style="background:{color}{mark}" '
                f'title="{html.escape(title)}"></div>'
            )
        out.append("</div>")
        out.append(self._legend_html(frame, cells.blocks_per_cell))
        out.append("</div>")
        return "".join(out)

    def _legend_html(self, frame: Frame, per_cell: int) -> str:
        counts = frame.counts()
        held = np.bincount(frame.owner[frame.owner >= 0], minlength=len(frame.requests))
        top = np.argsort(-held, kind="stable")[:12]
        top = [int(i) for i in top if held[i] > 0]

        def swatch(color: str, mark: str = "") -> str:
            style = f"background:{color}" + (f";box-shadow:{mark}" if mark else "")
            return (
                f'<span style="display:inline-block;width:10px;height:10px;{style};'
                f'margin:0 3px 0 8px;vertical-align:middle"></span>'
            )

        half_written = (
            f"{PALETTE[0]};background-image:linear-gradient(to right,transparent 50%,"
            f"{PARTIAL_WASH} 50%)"
        )
        parts = [
            f"<div>step {frame.step_index} · {frame.num_in_use}/{frame.num_blocks} blocks in "
            f"use ({counts['shared']} shared) · {counts['cached']} cached free · "
            f"{counts['empty']} empty · {frame.num_running} running, {frame.num_waiting} "
            "waiting"
            + (f" · {per_cell} blocks per cell" if per_cell > 1 else "")
            + "</div><div>"
        ]
        for i in top:
            rid = html.escape(frame.requests[i])
            parts.append(f"{swatch(request_color(i))}{rid}: {int(held[i])}")
        if len(top) < int(np.count_nonzero(held)):
            parts.append(f" … {int(np.count_nonzero(held)) - len(top)} more")
        parts.append(
            f"</div><div>{swatch('#ffffff', SHARED_MARK)}shared"
            f"{swatch(half_written)}partly written"
            f"{swatch(CACHED_COLOR)}cached free (a prefix hit can revive it)"
            f"{swatch(EMPTY_COLOR)}empty</div>"
        )
        return "".join(parts)

    def figure(self, frame: Frame | None = None):
        """The grid as a matplotlib ``Figure`` (same colors and outline as the widget)."""
        from matplotlib.colors import to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        frame = self.frame if frame is None else frame
        cells = _cells(frame, self.max_cells)
        n = len(cells.color)
        columns = max(1, min(64, int(np.ceil(np.sqrt(n * 2)))))
        rows = -(-n // columns)
        rgb = np.ones((rows * columns, 3))
        fill = np.asarray(cells.fill)[:, None]
        # A partly written block is drawn paler, in proportion to its empty slots.
        rgb[:n] = np.asarray([to_rgb(c) for c in cells.color]) * (0.4 + 0.6 * fill) + (
            0.6 * (1 - fill)
        )
        rgb = rgb.reshape(rows, columns, 3)
        width = min(14.0, 3.5 + columns * 0.2)
        fig = Figure(figsize=(max(7.0, width), 1.4 + rows * 0.2), layout="constrained")
        ax = fig.subplots()
        ax.imshow(rgb, interpolation="nearest", aspect="equal")
        shared = np.flatnonzero(cells.shared)
        if shared.size:
            ax.scatter(
                shared % columns, shared // columns, marker="s", s=40,
                facecolors="none", edgecolors="#111111", linewidths=1.2,
            )  # fmt: skip
        # Thin white lines between cells, as in the widget.
        ax.set_xticks(np.arange(-0.5, columns, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
        counts = frame.counts()
        ax.set_title(
            f"KV cache after step {frame.step_index}\n{frame.num_in_use}/{frame.num_blocks} "
            f"blocks in use, {counts['shared']} shared, {counts['cached']} cached free"
            + (f", {cells.blocks_per_cell} blocks per cell" if cells.blocks_per_cell > 1 else ""),
            fontsize="small",
            loc="left",
        )
        held = np.bincount(frame.owner[frame.owner >= 0], minlength=len(frame.requests))
        top = [int(i) for i in np.argsort(-held, kind="stable")[:10] if held[i] > 0]
        handles = [Patch(color=request_color(i), label=frame.requests[i]) for i in top]
        handles += [
            Patch(facecolor="white", edgecolor="#111111", label="shared"),
            Patch(color=CACHED_COLOR, label="cached free"),
            Patch(color=EMPTY_COLOR, label="empty"),
        ]
        fig.legend(handles=handles, loc="outside right upper", fontsize="small", frameon=False)
        return fig


class _Cells:
    __slots__ = ("blocks_per_cell", "color", "fill", "shared", "title")

    def __init__(self, color, shared, title, blocks_per_cell, fill=None) -> None:
        self.color, self.shared, self.title = color, shared, title
        self.blocks_per_cell = blocks_per_cell
        # Fraction of a held block's slots that hold tokens (1.0 when aggregated or free).
        self.fill = [1.0] * len(color) if fill is None else fill


def _cells(frame: Frame, max_cells: int) -> _Cells:
    """What each drawn cell shows: one block per cell, or runs of blocks aggregated."""
    n = frame.num_blocks
    per_cell = max(1, -(-n // max_cells))
    if per_cell == 1:
        colors = [
            request_color(o) if o >= 0 else (CACHED_COLOR if s == CACHED else EMPTY_COLOR)
            for o, s in zip(frame.owner.tolist(), frame.state.tolist(), strict=True)
        ]
        shared = (frame.state == SHARED).tolist()
        titles = [frame.describe(b) for b in range(n)]
        held = frame.refs > 0
        fill = np.where(held, frame.tokens / frame.block_size, 1.0).tolist()
        return _Cells(colors, shared, titles, 1, fill)
    colors, shared, titles = [], [], []
    for start in range(0, n, per_cell):
        stop = min(n, start + per_cell)
        states = frame.state[start:stop]
        counts = np.bincount(states, minlength=4)
        owners = frame.owner[start:stop]
        held = owners[owners >= 0]
        used = int(counts[2] + counts[3])
        if used * 2 >= len(states) and held.size:
            top = int(np.bincount(held).argmax())
            colors.append(request_color(top))
        elif counts[CACHED] >= counts[EMPTY]:
            colors.append(CACHED_COLOR)
        else:
            colors.append(EMPTY_COLOR)
        shared.append(bool(counts[SHARED]))
        names = sorted({frame.requests[o] for o in held.tolist()})
        who = f"; {', '.join(names[:4])}" + (" …" if len(names) > 4 else "") if names else ""
        titles.append(
            f"blocks {start}–{stop - 1}: {used} in use ({int(counts[SHARED])} shared), "
            f"{int(counts[CACHED])} cached, {int(counts[EMPTY])} empty{who}"
        )
    return _Cells(colors, shared, titles, per_cell)


# -- plots over time -------------------------------------------------------------------


class _PlotView(_View):
    """A view drawn as a matplotlib figure, shown as a PNG image widget."""

    interval = 1.0
    draw_budget = 0.01

    def _build_widget(self, w):
        self._image = w.Image(format="png")
        return w.VBox([self._image])

    def _show(self, data: Any) -> None:
        self._image.value = _png(self.figure(data))


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


# -- comparing configurations ----------------------------------------------------------


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


__all__ = [
    "KVCacheView",
    "MetricsPanel",
    "PolicyComparison",
    "SchedulerTimeline",
]
