"""``SpeculationView``: how often speculative decoding's drafts are accepted, per position
and over time, for one run or several side by side."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.observe.recording import Recording, load
from llmlab.speculative.stats import SpecDecodeStats, SpecStep
from llmlab.viz.views.base import _engine_of, _PlotView

UNCONDITIONAL_TITLE = (
    "per-position acceptance rate (unconditional)\naccepted_per_pos / drafted_per_pos"
)
CONDITIONAL_TITLE = "per-position conditional rate\naccepted_per_pos / reached_per_pos"


def _window_sums(values: Sequence[int], window_steps: int) -> np.ndarray:
    """Per index ``i``, the sum of ``values[i - window_steps + 1 .. i]``."""
    sums = np.cumsum([0, *values])
    end = np.arange(1, len(values) + 1)
    return sums[end] - sums[np.maximum(end - window_steps, 0)]


def rolling_acceptance_rate(series: Sequence[SpecStep], window_steps: int) -> list[float]:
    """Per step that drafted, the acceptance rate (accepted / drafted tokens) of it and the
    ``window_steps - 1`` drafting steps before it."""
    accepted = _window_sums([step.totals.num_accepted_tokens for step in series], window_steps)
    drafted = _window_sums([step.totals.num_draft_tokens for step in series], window_steps)
    return (accepted / drafted).tolist()  # a step in ``series`` drafted: never 0 / 0


def rolling_mean_acceptance_length(series: Sequence[SpecStep], window_steps: int) -> list[float]:
    """Per step that drafted, the mean acceptance length (``1 + accepted / drafts``) of it
    and the ``window_steps - 1`` drafting steps before it."""
    accepted = _window_sums([step.totals.num_accepted_tokens for step in series], window_steps)
    drafts = _window_sums([step.totals.num_drafts for step in series], window_steps)
    return (1.0 + accepted / drafts).tolist()


class SpeculationView(_PlotView):
    """Speculative decoding's acceptance: per position as bars (the unconditional and the
    conditional rate), and per step that drafted, the acceptance rate and a rolling mean
    acceptance length. Every number is a :class:`~llmlab.speculative.stats.SpecDecodeStats`
    fed the view's step events, so the definitions are that class's (``docs/speculative.md``).

    One run: ``SpeculationView(llm)`` follows an ``LLM``, ``Engine`` or ``AsyncEngine`` from
    now on; ``SpeculationView(recording)`` (or its path) replays one with a slider.
    ``stats`` holds the counts.

    Several runs side by side: ``SpeculationView({"ngram": llm_a, "suffix": llm_b})``. Each
    label's source is an engine as above (followed from now on), a recording or its path,
    or a sequence of ``StepEvent``\\ s (so ``SpeculationView(comparison.events)`` draws a
    :func:`llmlab.experiments.compare` result). ``runs`` maps each label to its stats; this
    view draws when shown, and :meth:`refresh` redraws it.

    Steps are counted from where the view (or each run) started: the step after the
    engine's snapshot or the recording's, or a sequence's first event.

    Args:
        window_steps: how many drafting steps the rolling acceptance rate and mean
            acceptance length span.
        interval: for one engine followed live, the least seconds between redraws.
    """

    def __init__(self, source: Any, *, window_steps: int = 16,
                 interval: float | None = None) -> None:  # fmt: skip
        if not isinstance(window_steps, int) or isinstance(window_steps, bool) or window_steps < 1:
            raise ValueError(f"window_steps must be an int >= 1, got {window_steps!r}")
        self.window_steps = window_steps
        self._followed: list[tuple[Any, Any]] = []  # (engine, observer), several runs only
        self._several = isinstance(source, Mapping)
        if not self._several:
            super().__init__(source, interval=interval)
            return
        if interval is not None:
            raise ValueError(
                "interval is for following one engine; a view of several runs draws when "
                "shown (refresh() redraws it)"
            )
        self._engine = self._widget = self._trailing = self.recording = self.position = None
        self._next_draw, self._stale, self._events = 0.0, False, ()
        if not source:
            raise ValueError("runs is empty; give at least one {label: source}")
        self.runs: dict[str, SpecDecodeStats] = {}
        self._first_steps: dict[str, int] = {}
        for label, run in source.items():
            self._add_run(label, run)

    def _add_run(self, label: Any, source: Any) -> None:
        if not isinstance(label, str) or not label:
            raise ValueError(f"run labels must be non-empty strs, got {label!r}")
        stats = self.runs[label] = SpecDecodeStats()
        if isinstance(source, (str, os.PathLike)):
            source = load(source)
        if isinstance(source, Recording):
            self._first_steps[label] = source.snapshot.step_index
            source = source.events
        if isinstance(source, Sequence) and all(isinstance(e, StepEvent) for e in source):
            self._first_steps.setdefault(label, source[0].step_index if source else 0)
            for event in source:
                stats(event)
            return
        try:
            engine = _engine_of(source)
        except TypeError:
            raise TypeError(
                f"run {label!r}: a run is an LLM, Engine or AsyncEngine, a Recording (or the "
                f"path of one) or a sequence of StepEvents; got {type(source).__name__}"
            ) from None
        # A partial compares by identity: unsubscribing it can never remove another
        # observer that happens to compare equal (an LLM's own SpecDecodeStats, say).
        observer = functools.partial(stats)
        self._first_steps[label] = engine.observe(observer).step_index
        self._followed.append((engine, observer))

    @property
    def stats(self) -> SpecDecodeStats:
        """The counts of the one run this view draws (several runs: ``runs[label]``)."""
        if self._several:
            raise AttributeError(
                f"this view draws several runs: use runs[label], label in {list(self.runs)}"
            )
        return self.runs[""]

    @property
    def live(self) -> bool:
        return bool(self._followed) if self._several else super().live

    def seek(self, position: int) -> None:
        if self._several:
            raise ValueError(
                "seek() replays one recording; this view draws several runs (give it one "
                "recording to replay it step by step)"
            )
        super().seek(position)

    def close(self) -> None:
        """Stop following the engine(s); the widget keeps its last picture."""
        for engine, observer in self._followed:
            if observer in engine.observers:
                engine.unsubscribe(observer)
        self._followed.clear()
        if not self._several:
            super().close()

    # -- one run: the live/replay plumbing's hooks -------------------------------------

    def _reset(self, snapshot: EngineSnapshot) -> None:
        self.runs = {"": SpecDecodeStats()}
        self._first_steps = {"": snapshot.step_index}

    def _apply(self, event: StepEvent) -> None:
        self.runs[""](event)

    def _capture(self) -> dict[str, SpecDecodeStats]:
        with contextlib.ExitStack() as locks:
            for engine in {id(engine): engine for engine, _ in self._followed}.values():
                locks.enter_context(engine._lock)  # no event half-applied while copying
            return copy.deepcopy(self.runs)

    # -- drawing -----------------------------------------------------------------------

    def figure(self, runs: Mapping[str, SpecDecodeStats] | None = None):
        """The four panels as a matplotlib ``Figure`` (of ``runs``, label -> stats; default
        the view's): per-position unconditional and conditional rates as bars (one bar per
        run at each position), then per drafting step the acceptance rate (and its rolling
        value) and the rolling mean acceptance length."""
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        runs = self.runs if runs is None else runs
        window = self.window_steps
        fig = Figure(figsize=(11, 6.5), layout="constrained")
        (unconditional, conditional), (rate, length) = fig.subplots(2, 2)
        width = 0.8 / max(1, len(runs))
        for i, (label, stats) in enumerate(runs.items()):
            color, name = f"C{i % 10}", label or None
            offset = (i - (len(runs) - 1) / 2) * width
            for ax, rates in ((unconditional, stats.per_position_acceptance_rate),
                              (conditional, stats.per_position_conditional_rate)):  # fmt: skip
                positions = np.arange(1, len(rates) + 1)
                ax.bar(positions + offset, rates, width, color=color, label=name)
            first = self._first_steps.get(label, 0)
            steps = [step.step_index - first for step in stats.series]
            rate.plot(steps, [step.totals.acceptance_rate for step in stats.series], ".",
                      color=color, markersize=3, alpha=0.4)  # fmt: skip
            rate.plot(steps, rolling_acceptance_rate(stats.series, window), color=color,
                      label=name)  # fmt: skip
            length.plot(steps, rolling_mean_acceptance_length(stats.series, window),
                        color=color, label=name)  # fmt: skip
        num_positions = max((len(s.drafted_per_pos) for s in runs.values()), default=0)
        for ax, title in ((unconditional, UNCONDITIONAL_TITLE), (conditional, CONDITIONAL_TITLE)):
            ax.set_title(title, fontsize="medium")
            ax.set_xticks(range(1, num_positions + 1))
            ax.set_xlabel("draft position j")
            ax.set_ylim(0, 1.02)
        rate.set_title(
            f"acceptance rate: per step (dots), last {window} drafting steps (line)\n"
            "accepted / drafted tokens",
            fontsize="medium",
        )
        rate.set_ylim(0, 1.02)
        length.set_title(
            f"mean acceptance length, last {window} drafting steps\n"
            "1 + accepted tokens / drafts (the bonus token included)",
            fontsize="medium",
        )
        length.set_ylim(bottom=0)
        for ax in (rate, length):
            ax.set_xlabel("steps since the view started" if "" in runs
                          else "steps since each run started")  # fmt: skip
        if not any(s.num_drafts for s in runs.values()):
            for ax in (unconditional, conditional, rate, length):
                ax.text(0.5, 0.5, "no drafts", transform=ax.transAxes, ha="center",
                        va="center", color="0.5")  # fmt: skip
                ax.set_xticks([])
        elif set(runs) != {""}:
            fig.legend(
                [Patch(color=f"C{i % 10}") for i in range(len(runs))],
                [f"{label}: acceptance rate {s.acceptance_rate:.2f}, mean acceptance length "
                 f"{s.mean_acceptance_length:.2f}" for label, s in runs.items()],
                loc="outside lower center", ncols=min(2, len(runs)), fontsize="small",
            )  # fmt: skip
        fig.suptitle(_headline(runs), fontsize="medium")
        return fig


def _headline(runs: Mapping[str, SpecDecodeStats]) -> str:
    if set(runs) != {""}:
        return f"speculative decoding: {len(runs)} run{'s' if len(runs) != 1 else ''}"
    stats = runs[""]
    if not stats.num_drafts:
        return "speculative decoding: no drafts"
    return (
        f"speculative decoding: {stats.num_drafts} drafts, acceptance rate "
        f"{stats.acceptance_rate:.2f}, mean acceptance length {stats.mean_acceptance_length:.2f}"
    )
