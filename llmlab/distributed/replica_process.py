"""One data-parallel replica: a whole :class:`~llmlab.engine.engine.Engine` in a process
of its own, driven by messages from the front end (:mod:`llmlab.distributed.data_parallel`).

The messages are small frozen attrs classes, pickled over one duplex
``multiprocessing`` connection:

* front end -> replica: :class:`AddRequest` (a request the front end already checked and
  tokenized), :class:`AbortRequests`, :class:`Query` (a question for the engine: a
  snapshot, a KV cache reading, a recording to start or stop), :class:`Shutdown`;
* replica -> front end: :class:`ReplicaReady` (the engine's facts, once built) or
  :class:`ReplicaStartFailed`, then one :class:`StepReport` per step that did anything,
  a :class:`QueryReply` per query, and a :class:`Heartbeat` every
  ``heartbeat_interval_s``.

The replica runs on its own clock, not in lock-step with the others: it drains whatever
commands have arrived, steps while it has work, and reports each step's outputs and
``StepEvent`` with the chained hash of every block that entered its prefix index, so the
front end can mirror the index as ``{block id: hash}`` (dropping ``blocks_evicted``) and
answer a router's ``cached_prefix_tokens`` without asking.

Heartbeats: a thread of the replica's own sends a :class:`Heartbeat` at a fixed interval,
idle or busy, so the front end can tell a replica that is merely quiet from one that does
not run (stopped, starved) and one whose loop is stuck in a step (the heartbeat says how
long the loop has been in its current pass). The front end judges them
(:mod:`llmlab.distributed.liveness`).

Nothing is orphaned: the replica exits when its connection reaches EOF (the front end
closed it or died) and a watchdog thread ends it when its parent process changes, even in
the middle of a step. It leads a process group of its own, so the front end can take down
whatever the replica started (tensor-parallel workers) along with it.

This module imports nothing heavy at the top: a spawned child sets ``CUDA_VISIBLE_DEVICES``
before anything initialises CUDA.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import attrs

logger = logging.getLogger(__name__)

# How often an idle replica, and the watchdog, look for a vanished parent.
PARENT_CHECK_S = 0.5


# -- messages ------------------------------------------------------------------------------


@attrs.frozen
class ReplicaSpec:
    """What a replica process needs to build its engine.

    Attributes:
        index: the replica's index among the front end's replicas.
        model / tokenizer: as given to ``LLM``.
        settings: ``EngineConfig`` fields and components (instances are pickled copies:
            each replica gets its own).
        cuda_visible_devices: set in the child before CUDA starts (None: leave it).
        parent_pid: the front end's process; the replica ends when it goes.
        heartbeat_interval_s: how often it sends a :class:`Heartbeat`.
    """

    index: int
    model: str
    tokenizer: str | None
    settings: dict[str, Any]
    cuda_visible_devices: str | None
    parent_pid: int
    heartbeat_interval_s: float = 1.0


@attrs.frozen
class AddRequest:
    """Queue a request (a ``PreparedRequest`` without its compiled grammar, which the
    replica's engine compiles again from the parameters, from its own cache)."""

    prepared: Any


@attrs.frozen
class AbortRequests:
    request_ids: tuple[str, ...]


@attrs.frozen
class Shutdown:
    """Stop after the current step and exit."""


# What a Query may read of the replica's KV cache manager (a read-only subset: the manager
# itself lives here, and its block pool cannot be pickled).
KV_CACHE_READS = ("num_free_blocks", "usage", "block_table", "snapshot", "check")


@attrs.frozen
class Query:
    """A question for the replica's engine, answered between two of its steps by one
    :class:`QueryReply` with the same ``query_id``.

    Attributes:
        query_id: the front end's id for the answer.
        kind: ``"snapshot"`` (``Engine.snapshot()``); ``"kv_cache"`` (``argument`` is
            ``(name, args)``: ``getattr(engine.kv_cache, name)``, called with ``args`` when
            it is a method; ``name`` one of :data:`KV_CACHE_READS`); ``"record"``
            (``Engine.record(argument)``; the answer is the recording's id) or
            ``"stop_recording"`` (close recording ``argument``; the answer is its number
            of steps).
        argument: what the kind needs, else None.
    """

    query_id: int
    kind: str
    argument: Any = None


@attrs.frozen
class QueryReply:
    """The answer to :class:`Query` ``query_id``: ``value``, or ``error`` (the exception's
    type and message) when answering raised."""

    query_id: int
    value: Any = None
    error: str | None = None


@attrs.frozen
class ReplicaInfo:
    """The facts of a replica's built engine that the front end checks requests against."""

    pid: int
    config: Any
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    default_sampling_params: Any
    max_logprobs: int
    max_num_seqs: int
    block_size: int
    num_kv_blocks: int
    enable_prefix_caching: bool
    # Its components by name (llmlab.observe.components): they live in its process.
    components: Mapping[str, str] = attrs.field(factory=dict)
    # Objects its process froze out of the garbage collector's full passes when its engine
    # was built (llmlab.utils.gc_heap): the process serves that engine for its life.
    gc_frozen: int = 0


@attrs.frozen
class ReplicaReady:
    info: ReplicaInfo


@attrs.frozen
class ReplicaStartFailed:
    """Building the engine raised: the error's type name, message and traceback."""

    error_type: str
    message: str
    traceback: str


@attrs.frozen
class StepReport:
    """What one step of the replica did.

    Attributes:
        commands_done: how many commands the replica has consumed in all, so far (the
            front end has work while the count of commands it sent is higher).
        outputs: the step's ``RequestOutput``s.
        events: ``(StepEvent, ((block id, chained hash), ...))`` for each event, the
            hashes of the event's ``blocks_cached``.
        failures: ``(request id, reason)`` for each request the replica had to end (its
            step failed, or it could not queue the request).
        refused: ``(request id, reason)`` for each request its engine ended with a
            ``RequestFailedError`` (one that can never fit the KV cache, say).
    """

    commands_done: int
    outputs: list
    events: tuple
    failures: tuple[tuple[str, str], ...] = ()
    refused: tuple[tuple[str, str], ...] = ()


@attrs.frozen
class Heartbeat:
    """The replica's process runs (sent by a thread of its own, idle or busy).

    Attributes:
        stuck_s: how long the engine loop has been in its current pass (applying
            commands, or a step), counting only time the process ran: near 0 while the
            loop goes round, growing while a step does not end.
        in_step: whether that pass is an engine step.
    """

    stuck_s: float
    in_step: bool


# -- the child process -----------------------------------------------------------------


def replica_main(spec: ReplicaSpec, conn) -> None:
    """The replica process's entry point (``multiprocessing`` spawn target)."""
    if spec.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    try:
        os.setpgrp()  # a group of its own: the front end can end what this replica starts
    except OSError:
        pass
    # Ctrl-C in a terminal goes to the front end, which shuts replicas down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _watch_parent(spec.parent_pid)
    run_replica(spec, conn)


def run_replica(spec: ReplicaSpec, conn) -> None:
    """Build the replica's engine (a failure is reported to the front end, which raises)
    and run its loop over ``conn`` until told to stop or the front end goes. A replica
    process and a Ray actor replica both run exactly this."""
    try:
        engine = _build(spec)
    except BaseException as err:  # noqa: BLE001 - reported to the front end, which raises
        _send_quietly(conn, ReplicaStartFailed(
            type(err).__name__, str(err), traceback.format_exc()
        ))
        return
    try:
        _ReplicaLoop(spec.index, engine, conn, spec.heartbeat_interval_s).run()
    finally:
        _close_engine(engine)


def _build(spec: ReplicaSpec):
    from llmlab.engine.builder import EngineBuilder

    return EngineBuilder.from_settings(spec.model, spec.tokenizer, **spec.settings).build()


def _close_engine(engine: Any) -> None:
    """Stop what the engine started (a tensor-parallel executor's workers), if anything."""
    for owner in (engine, getattr(engine, "executor", None)):
        for name in ("shutdown", "close"):
            close = getattr(owner, name, None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - exiting anyway
                    logger.exception("closing the replica's engine failed")
                return


def _watch_parent(parent_pid: int) -> None:
    """End this process (and its group) as soon as the front end is gone, even while a
    step runs: an orphaned replica would hold its device forever."""

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                try:
                    os.killpg(os.getpgrp(), signal.SIGKILL)
                finally:
                    os._exit(1)

    threading.Thread(target=watch, name="llmlab-dp-parent-watch", daemon=True).start()


def _send_quietly(conn, message: Any) -> None:
    try:
        conn.send(message)
    except (OSError, ValueError):
        pass  # the front end is gone


def cached_block_hashes(engine: Any, event: Any) -> tuple[tuple[int, int], ...]:
    """``(block id, chained hash)`` of each block of ``event.blocks_cached``: what the
    front end needs to mirror the engine's prefix index. Call it from an observer (inside
    the step, after its commit), when the index holds every one of those blocks."""
    index = engine.kv_cache.index
    return tuple((block_id, index.hash_of(block_id)) for block_id in event.blocks_cached)


class PipeWriter:
    """Writes byte messages to a connection, in order, from a thread of its own: ``send``
    never waits for the other side to read. Both directions use one: a replica's reports
    (a front end slow to read, or itself blocked sending commands, never stops the replica
    from reading its commands) and the front end's commands (a stopped replica's full pipe
    blocks only this thread; it reads them all, in order, once it runs again).

    After a write fails (the other side is gone) the rest are dropped, ``error`` holds why,
    and ``send`` raises ``OSError``; the reader learns of it from EOF.
    """

    def __init__(self, connection: Any, name: str) -> None:
        self._connection = connection
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, payload: bytes) -> None:
        if self.error is not None:
            raise OSError(f"the connection is gone ({type(self.error).__name__}: {self.error})")
        self._queue.put(payload)

    def close(self, timeout: float = 5.0) -> None:
        """Stop after the messages queued so far (waiting up to ``timeout`` for them)."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            try:
                self._connection.send_bytes(payload)
            except Exception as err:  # noqa: BLE001 - gone (or closed under us): stop writing
                self.error = err
                return


def _report(writer: PipeWriter, message: Any) -> None:
    """Send a message to the front end; once it is gone, nothing (the loop sees EOF and
    exits). Pickled here, in the loop thread, while the objects in it cannot change."""
    if writer.error is None:
        writer.send(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class _Heartbeat:
    """Sends a :class:`Heartbeat` every ``interval`` seconds from a thread of its own.

    A thread proves the process is scheduled, not that the engine makes progress, so each
    beat also says how long the loop has been in its current pass (``loop.pass_started``,
    ``loop.in_step``). Time the process did not run (SIGSTOP, a starved machine: the
    beat came late) does not count as the loop being stuck: the stall is measured from
    whichever is later, the pass's start or the process's return.
    """

    def __init__(self, loop: _ReplicaLoop, interval: float) -> None:
        self._loop = loop
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmlab-dp-heartbeat",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        loop = self._loop
        last = resumed = time.monotonic()
        while not self._stop.wait(self._interval):
            now = time.monotonic()
            if now - last > 2 * self._interval + 0.5:
                resumed = now  # this process did not run for a while: it is back now
            last = now
            stuck = now - max(loop.pass_started, resumed)
            _report(loop.sender, Heartbeat(round(max(stuck, 0.0), 3), loop.in_step))


class _ReplicaLoop:
    """Drain commands, step while there is work, report each step."""

    def __init__(self, index: int, engine: Any, conn,
                 heartbeat_interval_s: float = 1.0) -> None:
        self.index = index
        self.engine = engine
        self.conn = conn
        self.heartbeat_interval_s = heartbeat_interval_s
        # When the loop began its current pass, and whether that pass is a step (read by
        # the heartbeat thread).
        self.pass_started = time.monotonic()
        self.in_step = False
        self.commands_done = 0
        self.commands_reported = 0
        self.live: set[str] = set()  # caller request ids queued here, not yet finished
        self.failures: list[tuple[str, str]] = []
        self.refused: list[tuple[str, str]] = []
        self.events: list = []
        self.step_again = False
        self.recordings: dict[int, Any] = {}  # Engine.record's recorders, by query id
        engine.subscribe(self._observe)
        self.sender = PipeWriter(conn, "llmlab-dp-sender")

    def run(self) -> None:
        from llmlab.observe.components import component_names
        from llmlab.utils.gc_heap import freeze_heap

        frozen = freeze_heap()
        kv = self.engine.kv_cache
        _report(self.sender, ReplicaReady(ReplicaInfo(
            pid=os.getpid(),
            config=self.engine.config,
            vocab_size=self.engine.vocab_size,
            max_model_len=self.engine.max_model_len,
            eos_token_ids=frozenset(self.engine.eos_token_ids),
            default_sampling_params=self.engine.default_sampling_params,
            max_logprobs=self.engine.max_logprobs,
            max_num_seqs=self.engine.scheduler.max_num_seqs,
            block_size=kv.block_size,
            num_kv_blocks=kv.num_blocks,
            enable_prefix_caching=kv.enable_prefix_caching,
            components=component_names(self.engine),
            gc_frozen=frozen,
        )))
        heartbeat = _Heartbeat(self, self.heartbeat_interval_s)
        try:
            while True:
                busy = self.step_again or self.engine.has_unfinished_requests()
                consumed = self._drain(0.0 if busy else PARENT_CHECK_S)
                if consumed is None or self.sender.error is not None:
                    return  # shutdown, or the front end is gone
                if busy or consumed or self.engine.has_unfinished_requests():
                    self.pass_started, self.in_step = time.monotonic(), True
                    try:
                        self._step()
                    finally:
                        self.in_step = False
                self.pass_started = time.monotonic()
        finally:
            heartbeat.stop()
            self._close_recordings()
            self.sender.close()

    def _drain(self, timeout: float) -> int | None:
        """Apply every command that has arrived (waiting up to ``timeout`` for the first);
        how many, or None to stop."""
        consumed = 0
        try:
            ready = self.conn.poll(timeout)
            while ready:
                command = self.conn.recv()
                consumed += 1
                self.commands_done += 1
                if isinstance(command, Shutdown):
                    return None
                self._apply(command)
                ready = self.conn.poll(0)
        except (EOFError, OSError):
            return None  # the front end closed the connection or died
        return consumed

    def _apply(self, command: Any) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            request_id = command.prepared.request_id
            try:
                engine.add_prepared_request(command.prepared)
            except Exception as err:  # noqa: BLE001 - that request fails, nothing else
                self.failures.append((request_id, self._reason(
                    f"the request could not be queued: {type(err).__name__}: {err}"
                )))
                return
            self.live.add(request_id)
        elif isinstance(command, AbortRequests):
            self.live.difference_update(command.request_ids)
            try:
                engine.abort_request(command.request_ids)
            except Exception:  # noqa: BLE001 - a policy failed in remove(); state is consistent
                logger.exception("replica %d: aborting %d request(s) raised", self.index,
                                 len(command.request_ids))
            self.step_again = True  # the next step reports the abort and frees blocks
        elif isinstance(command, Query):
            self._answer(command)
        else:
            logger.error("replica %d: ignoring an unknown command %r", self.index, command)

    def _answer(self, query: Query) -> None:
        """Answer a query now, between steps (so a snapshot is followed exactly by the
        events reported after it); an error in answering is the reply, never the loop's."""
        try:
            value = self._query_value(query)
            payload = pickle.dumps(QueryReply(query.query_id, value),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - the asker raises it
            payload = pickle.dumps(QueryReply(query.query_id, None,
                                              f"{type(err).__name__}: {err}"))
        if self.sender.error is None:
            self.sender.send(payload)

    def _query_value(self, query: Query) -> Any:
        engine = self.engine
        if query.kind == "snapshot":
            return engine.snapshot()
        if query.kind == "kv_cache":
            name, args = query.argument
            if name not in KV_CACHE_READS:
                raise ValueError(f"kv_cache.{name} is not readable from the front end; "
                                 f"readable: {', '.join(KV_CACHE_READS)}")
            value = getattr(engine.kv_cache, name)
            return value(*args) if callable(value) else value
        if query.kind == "record":
            self.recordings[query.query_id] = engine.record(query.argument)
            return query.query_id
        if query.kind == "stop_recording":
            recorder = self.recordings.pop(query.argument, None)
            if recorder is None:
                return None  # closed already
            recorder.close()
            return recorder.num_steps
        raise ValueError(f"unknown query kind {query.kind!r}")

    def _close_recordings(self) -> None:
        """The replica is exiting: finish every recording it still writes (footers)."""
        for recorder in self.recordings.values():
            try:
                recorder.close()
            except Exception:  # noqa: BLE001 - exiting anyway
                logger.exception("replica %d: closing a recording failed", self.index)
        self.recordings.clear()

    def _step(self) -> None:
        from llmlab.errors import RequestFailedError

        self.step_again = False
        outputs: list = []
        try:
            outputs = self.engine.step()
        except RequestFailedError as err:
            # The engine ended that request; its final output comes with the next step.
            self.refused.append((err.request_id, str(err)))
            self.step_again = True
        except Exception as err:  # noqa: BLE001 - any other step error fails this replica's work
            logger.exception("replica %d: a step failed; failing its requests", self.index)
            reason = self._reason(f"the engine step failed: {type(err).__name__}: {err}")
            failed = sorted(self.live)
            self.failures.extend((rid, reason) for rid in failed)
            self.live.clear()
            try:
                self.engine.abort_request(failed)
            except Exception:  # noqa: BLE001
                logger.exception("replica %d: aborting after a failed step also failed",
                                 self.index)
            self.step_again = True
        for output in outputs:
            if output.finished:
                self.live.discard(output.request_id)
        unreported = self.commands_done != self.commands_reported
        if outputs or self.events or self.failures or self.refused or unreported:
            report = StepReport(self.commands_done, outputs, tuple(self.events),
                                tuple(self.failures), tuple(self.refused))
            self.events, self.failures, self.refused = [], [], []
            self.commands_reported = self.commands_done
            _report(self.sender, report)

    def _observe(self, event: Any) -> None:
        self.events.append((event, cached_block_hashes(self.engine, event)))

    def _reason(self, detail: str) -> str:
        return f"replica {self.index} (pid {os.getpid()}): {detail}"
