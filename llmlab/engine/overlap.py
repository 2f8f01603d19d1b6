"""Overlapped (async) scheduling: the next batch is planned while the current one runs.

A synchronous step is schedule -> execute -> commit, and the device waits while the host
schedules and commits. Here the executor runs each batch on a worker thread (on CUDA the
forward is asynchronous anyway and the thread mostly waits for the sampled tokens; on a CPU
torch releases the GIL inside its kernels) and :meth:`Overlap.step` is::

    plan batch N+1 while batch N runs  (its spans count as computed; each token it samples
                                        is a PLACEHOLDER the runner fills from its row)
    queue N+1 behind N on the worker   (it starts as soon as N's tokens are in)
    wait for batch N and N+1's start
    commit batch N                     (while N+1 runs)

so the host's scheduling and commit hide behind the forward. What it costs: a request
that batch N finishes (EOS, a length limit, a stop string, an abort) was also planned into
N+1; that slot is wasted and its output dropped, never reported. Tokens are the ones the
synchronous engine samples: a row's seeded stream and penalties live with the row.

The engine plans ahead only of a batch whose successor cannot depend on its outputs beyond
the placeholder: none of its entries drafts speculative tokens, scores prompt logprobs or
follows a grammar, and every plugin agrees (:meth:`~llmlab.plugin.SchedulerPlugin.plans_ahead`,
default no: a KV press or speculation decides from committed state). Otherwise that step
runs synchronously, so every feature keeps working with ``async_scheduling`` on.

If a batch fails, the one planned after it never runs: its row releases, KV transfers and
block copies are applied, every row's state is re-sent, and the error is raised as from a
synchronous step.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import attrs

from llmlab.engine.interrupts import deferred_interrupts
from llmlab.scheduler.batch import ScheduledBatch


def overlap_for(engine: Any) -> Overlap | None:
    """The engine's :class:`Overlap`, or None for synchronous steps: as its config's
    ``async_scheduling`` says (None: on for a CUDA model runner, unless a plugin never lets
    a batch be planned ahead, e.g. speculation or a KV press: then the thread would only
    cost). Raises ``ValueError`` when asked of an executor that cannot fill placeholders
    (``plans_ahead``)."""
    executor = engine.executor
    supported = getattr(executor, "plans_ahead", False)
    wanted = engine.config.async_scheduling
    if wanted is None:
        device = getattr(executor, "device", None)
        wanted = (supported and getattr(device, "type", None) == "cuda"
                  and all(p.overrides("plans_ahead") for p in engine.scheduler.plugins))
    if not wanted:
        return None
    if not supported:
        raise ValueError(
            f"async_scheduling=True: the executor {type(executor).__name__} cannot run a "
            "batch planned ahead of the one in flight (one model runner on one device can)"
        )
    return Overlap(engine)


@attrs.define(eq=False)
class _Flight:
    """A batch the executor is running: when it was scheduled, its future output, and
    when its forward began (or it ended)."""

    batch: ScheduledBatch
    start: float
    future: concurrent.futures.Future
    began: threading.Event


@attrs.define(eq=False)
class Overlap:
    """Drives an :class:`~llmlab.engine.engine.Engine`'s steps with one batch in flight
    (see the module). ``engine.step()`` calls :meth:`step`."""

    engine: Any = attrs.field(repr=False)
    _pool: concurrent.futures.ThreadPoolExecutor = attrs.field(init=False, default=None)
    _flight: _Flight | None = attrs.field(init=False, default=None)
    # Batches planned since the last step event (it reports their admissions and
    # preemptions: its block events cover the same window).
    _planned: list = attrs.field(init=False, factory=list)

    def __attrs_post_init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="llmlab-executor"
        )

    @property
    def in_flight(self) -> bool:
        """A batch is running whose outputs the next :meth:`step` commits."""
        return self._flight is not None

    def step(self) -> list:
        return self._whole(self._step)

    def _whole(self, run) -> list:
        """``run()`` under the engine's lock, with Ctrl-C delivered after it: a batch
        cannot be stopped mid-forward on its thread, and one left uncommitted would leave
        the runner's rows ahead of the scheduler's. The outputs of a step interrupted so
        come with the next call."""
        outputs: list = []
        with self.engine._lock:
            try:
                with deferred_interrupts():
                    outputs = run()
            except KeyboardInterrupt:
                self.engine._undelivered[:0] = outputs
                raise
        return outputs

    def _step(self) -> list:
        engine = self.engine
        flight = self._flight
        if flight is None:
            start = engine.clock()
            batch = self._schedule(start)
            if batch.is_empty:
                return self._commit(batch, None, start)
            flight = self._launch(batch, start)
        following = queued = None
        if self._may_plan_ahead(flight.batch):
            now = engine.clock()
            following = self._schedule(now, ahead_of=flight.batch)
            if not following.is_empty:
                # Queued behind batch N on the worker, which starts it the moment N's tokens
                # are in (no hand-off through this thread while the device waits); skipped
                # there if N fails.
                queued = self._launch(following, now, after=flight.future)
        self._flight = None
        try:
            output = flight.future.result()
        except Exception:
            if queued is not None:
                concurrent.futures.wait([queued.future])
            self._abandon(following)
            raise
        if queued is not None:
            self._flight = queued
            # The worker prepares that batch's inputs in Python: let it reach the forward
            # (which leaves the host free) before this thread takes the GIL to commit.
            queued.began.wait()
        outputs = self._commit(flight.batch, output, flight.start)
        if self._flight is not None and not engine.scheduler.num_unfinished:
            # Every request ended: what was planned ahead is wasted; finish it now, so an
            # idle engine holds nothing in flight.
            outputs += self._drain()
        return outputs

    def _commit(self, batch: ScheduledBatch, output: Any, start: float) -> list:
        """Commit ``batch``. Its step event tells what the engine did since the last one, in
        the order it happened: the batch committed (scheduled, sampled, finished) and the
        batches planned meanwhile (admitted, preempted: the block events of the same window
        hold their allocations and swaps), as a synchronous step's event does for its one
        batch."""
        planned, self._planned = self._planned, []
        told = None
        if not (len(planned) == 1 and planned[0] is batch):
            told = attrs.evolve(
                batch, admitted=tuple(a for b in planned for a in b.admitted),
                preempted=tuple(r for b in planned for r in b.preempted),
            )
        model_time = self.engine.clock() - start if output is not None else 0.0
        return self.engine._deliver(batch, output, start, model_time, told)

    def _schedule(self, now: float, ahead_of: ScheduledBatch | None = None) -> ScheduledBatch:
        batch = self.engine.scheduler.schedule(now, ahead_of=ahead_of)
        self._planned.append(batch)
        return batch

    def _launch(self, batch: ScheduledBatch, start: float,
                after: concurrent.futures.Future | None = None) -> _Flight:
        """Submit ``batch`` to the worker; ``after``: the future of the batch it was planned
        ahead of (done when the single worker reaches this one), whose failure skips it."""
        began = threading.Event()
        executor = self.engine.executor

        def run():
            if after is not None and after.exception() is not None:
                began.set()
                return None  # never read: the failure of ``after`` abandons this batch
            executor.forward_began = began.set
            try:
                return executor.execute(batch)
            finally:
                began.set()

        return _Flight(batch, start, self._pool.submit(run), began)

    def _may_plan_ahead(self, batch: ScheduledBatch) -> bool:
        """Whether the batch after ``batch`` may be planned before its outputs are known."""
        scheduler = self.engine.scheduler
        if not batch.entries:
            return False
        requests = scheduler.requests_of(batch)
        for entry in batch.entries:
            if entry.num_lookahead or entry.prompt_logprobs_from >= 0:
                return False
            request = requests.get(entry.request_id)
            if request is None or request.sampling_params.structured_outputs is not None:
                return False
        return all(plugin.plans_ahead(batch) for plugin in scheduler.plugins)

    def _abandon(self, following: ScheduledBatch | None) -> None:
        """The batch in flight failed: the one planned after it never runs. Its row
        releases, KV transfers and block copies still apply (the cache manager counted
        them done); every row's state is sent again; nothing is in flight."""
        scheduler = self.engine.scheduler
        scheduler.resend_rows()
        if following is None or not (
            following.freed_rows or following.kv_transfers or following.block_copies
        ):
            return
        residue = ScheduledBatch(
            entries=(), freed_rows=following.freed_rows,
            kv_transfers=following.kv_transfers, block_copies=following.block_copies,
        )
        self.engine.executor.execute(residue)

    def drain(self) -> list:
        """Commit the batch in flight, if any; its outputs (nothing is planned after it)."""
        return self._whole(self._drain)

    def _drain(self) -> list:
        flight, self._flight = self._flight, None
        if flight is None:
            return []
        try:
            output = flight.future.result()
        except Exception:
            self.engine.scheduler.resend_rows()
            raise
        return self._commit(flight.batch, output, flight.start)

    def shutdown(self) -> None:
        """Wait for the batch in flight and stop the worker thread."""
        flight, self._flight = self._flight, None
        if flight is not None:
            concurrent.futures.wait([flight.future])
        self._pool.shutdown(wait=True)
