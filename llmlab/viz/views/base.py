"""What every view shares: the live-or-replay plumbing (``_View``, and ``_PlotView`` for
views drawn as a matplotlib figure), request colors and PNG rendering.
"""

from __future__ import annotations

import io
import os
import pathlib
import threading
import time
from typing import Any

from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.observe.recording import Recording, load

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
# A block whose KV a KV press compacted: a dashed outline inside the cell (CSS ``outline``).
COMPACTED_MARK = "1px dashed #111"
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


class _PlotView(_View):
    """A view drawn as a matplotlib figure, shown as a PNG image widget."""

    interval = 1.0
    draw_budget = 0.01

    def _build_widget(self, w):
        self._image = w.Image(format="png")
        return w.VBox([self._image])

    def _show(self, data: Any) -> None:
        self._image.value = _png(self.figure(data))
