"""Observation of an engine: subscribing to its step events, snapshots, recording (a mixin
of :class:`~llmlab.engine.engine.Engine`; the events themselves are built in
:mod:`llmlab.observe.events`)."""

from __future__ import annotations

import os

from llmlab.cache.kv_cache_manager import BlockEvents
from llmlab.observe.events import EngineSnapshot, StepEvent, StepObserver, step_event


class Observable:
    """Step observers, snapshots and recording of an engine (see the module docstring)."""

    def subscribe(self, observer: StepObserver) -> StepObserver:
        """Call ``observer(event)`` after every step; returns it (usable as a decorator).

        An observer that raises is logged (with its name) and skipped for that event; the
        step's outputs and the other observers are unaffected.
        """
        self.observers.append(observer)
        return observer

    def unsubscribe(self, observer: StepObserver) -> None:
        self.observers.remove(observer)

    def observe(self, observer: StepObserver) -> EngineSnapshot:
        """Subscribe ``observer`` and return the state it starts from, atomically.

        Applying every later event to the snapshot follows the engine exactly (no step can
        fall between the two), which is how a view attached mid-run stays right.
        """
        with self._lock:
            snapshot = self.snapshot()
            self.subscribe(observer)
        return snapshot

    def record(self, path: str | os.PathLike):
        """Record the run from now on to a JSON Lines file; returns the ``Recorder``.

        The file starts with the engine's config and an :class:`EngineSnapshot`, then has
        one line per step event (request arrivals included). Stop with ``close()`` or a
        ``with`` block; read it back with :func:`llmlab.viz.load` (``llmlab.observe.recording``).
        """
        from llmlab.observe.recording import Recorder

        return Recorder(self, path)

    def snapshot(self) -> EngineSnapshot:
        """The KV pool, block tables and queue lengths now (see :class:`EngineSnapshot`)."""
        with self._lock:
            return EngineSnapshot.take(
                self._step_index, self.scheduler.kv, self._requests,
                self.scheduler.num_waiting, len(self.scheduler.running), self.clock(),
            )

    def _step_event(self, batch, output, batch_requests, finished, progressed, failed: bool,
                    start: float, model_time: float) -> StepEvent | None:
        """The step's event (None when nothing happened: no entries, arrivals, aborts,
        failures, block events or plugin reports)."""
        sampled = tuple(
            (r.request_id, r.num_output_tokens - before)
            for r, before in progressed
            if r.num_output_tokens > before
        )
        speculated = ()
        if output is not None and output.num_drafted is not None:
            speculated = tuple(
                (e.request_id, drafted, len(tokens) - 1)
                for e, drafted, tokens in zip(
                    batch.entries, output.num_drafted, output.token_ids, strict=True
                )
                if drafted and tokens
            )
        # What each plugged-in feature did this step (a KV press's compactions), by name.
        reports = {p.name: p.report() for p in self.scheduler.plugins}
        blocks = self.scheduler.kv.drain_events()
        event = None
        if (
            batch.entries
            or self._aborted_since_step
            or self._arrived_since_step
            or failed
            or blocks != BlockEvents()
            or any(reports.values())
        ):
            event = step_event(
                self._step_index, batch, batch_requests,
                finished=finished, aborted=self._aborted_since_step,
                arrived=self._arrived_since_step, sampled=sampled, blocks=blocks,
                kv=self.scheduler.kv, num_waiting=self.scheduler.num_waiting,
                num_running=len(self.scheduler.running), start=start, end=self.clock(),
                model_time=model_time, speculated=speculated, reports=reports,
            )
            self._aborted_since_step = []
            self._arrived_since_step = []
            if batch.entries:
                self._step_index += 1
        return event
