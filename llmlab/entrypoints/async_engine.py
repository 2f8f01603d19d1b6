"""``AsyncEngine``: the engine loop in a background thread, asyncio streams in front.

The shape of vLLM's ``AsyncLLMEngine``: ``generate(prompt, params, request_id)`` is an async
generator of :class:`~llmlab.engine.outputs.RequestOutput`; ``abort(request_id)`` stops a
request; ``check_health()`` raises when the loop cannot serve.

Threads. Exactly one thread touches the :class:`~llmlab.engine.engine.Engine`: the loop
thread, which steps it. Callers never wait for a step:

* ``add_request`` checks and tokenizes the request in a worker thread
  (:meth:`Engine.prepare_request` reads no state a step changes), so bad input raises in the
  caller at once, then hands the prepared request to the loop through an inbox;
* ``abort`` only records the id and wakes the loop;
* the loop, between steps, applies aborts, then queues new requests, then steps, and hands
  each step's outputs to the streams' event loops (one ``call_soon_threadsafe`` per step).

Failures. A request the engine fails (it can never fit the cache) ends its stream with
:class:`~llmlab.errors.RequestFailedError`. Any other error in a step (a user component, the
model) aborts every request in flight and ends each stream with :class:`EngineError`: none
hangs. The engine's own state is consistent after such an error, so the loop goes on
serving new requests; :meth:`AsyncEngine.check_health` reports the failure until a step
succeeds again. If the loop thread itself dies or is shut down, every stream ends with
:class:`EngineDeadError` and new requests are refused.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

from llmlab.engine.client import EngineClient
from llmlab.engine.engine import Engine, PreparedRequest, PromptType
from llmlab.engine.outputs import PoolingRequestOutput, RequestOutput
from llmlab.errors import RequestFailedError
from llmlab.pooling_params import PoolingParams
from llmlab.sampling.params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_END = object()  # a stream's end-of-outputs marker

# The members of an EngineClient the loop calls (an engine needs no more to be served).
_ENGINE_METHODS = ("prepare_request", "add_prepared_request", "abort_request", "step",
                   "has_unfinished_requests", "get_tokenizer")


class EngineError(RuntimeError):
    """A step failed; the requests in flight were aborted. The engine keeps serving."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or it crashed)."""


class RequestStream:
    """The outputs of one request, as an async iterator.

    Iterating yields each :class:`RequestOutput` as the engine produces it and stops after
    the finished one. It raises :class:`~llmlab.errors.RequestFailedError`,
    :class:`EngineError` or :class:`EngineDeadError` when the request could not complete.
    :meth:`abort` (or leaving an ``async with`` block) stops the request if it is still
    running and frees its KV blocks; the stream then ends at once (outputs delivered but
    not read yet are dropped).

    With ``delta`` (the request's ``output_kind`` is DELTA), outputs that arrive while the
    reader has not taken the previous one are merged into it, as vLLM's
    ``RequestOutputCollector`` does: a reader slower than the engine's steps (a client
    reading slowly, a busy event loop) gets one output with everything new since its last
    read, never a backlog of one per step.
    """

    def __init__(self, request_id: str, engine: AsyncEngine, loop: asyncio.AbstractEventLoop,
                 delta: bool = False):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = _Outputs(merge_deltas=delta)
        self.finished = False  # the engine will send nothing more
        self._ended = False  # the reader has seen the end marker
        self._aborted = False  # aborted by the caller: outputs still queued are dropped
        self._done_lock = threading.Lock()
        self._done_callbacks: list[Callable[[], Any]] | None = []

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        # ``finished`` is set by the loop thread before its last items arrive here, so the
        # end is known only from the end marker itself.
        if self._ended or self._aborted:
            self._ended = True
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        """Stop the request (a no-op once it has finished)."""
        if not self.finished:
            self._engine.abort_nowait(self.request_id)

    def add_done_callback(self, callback: Callable[[], Any]) -> None:
        """Call ``callback()`` once, when the engine is done with the request (finished,
        failed or aborted; at once if it already is). It runs on whichever thread ends
        the stream (usually the engine loop's): keep it short and thread-safe; an error
        in it is logged, never raised."""
        with self._done_lock:
            if self._done_callbacks is not None:
                self._done_callbacks.append(callback)
                return
        _call_logged(callback)

    def _mark_finished(self) -> None:
        """The engine will send nothing more: run the done callbacks (once)."""
        self.finished = True
        with self._done_lock:
            callbacks, self._done_callbacks = self._done_callbacks, None
        for callback in callbacks or ():
            _call_logged(callback)

    async def __aenter__(self) -> RequestStream:  # noqa: PYI034
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()

    # -- fed by the loop thread, through the stream's event loop -------------------------

    def _put(self, item: Any) -> None:
        self._queue.put_nowait(item)


class _Outputs(asyncio.Queue):
    """A stream's queue. With ``merge_deltas``, a :class:`RequestOutput` put behind another
    still unread is folded into it (:meth:`RequestOutput.add`); errors and the end marker
    queue as they come. (``_put`` is asyncio.Queue's hook for subclasses, as LifoQueue's.)"""

    def __init__(self, merge_deltas: bool) -> None:
        super().__init__()
        self._merge_deltas = merge_deltas

    def _put(self, item: Any) -> None:
        if self._merge_deltas and isinstance(item, RequestOutput) and self._queue:
            last = self._queue[-1]
            if isinstance(last, RequestOutput):
                last.add(item, aggregate=True)
                return
        super()._put(item)


class AsyncEngine:
    """Serve an :class:`~llmlab.engine.client.EngineClient` to asyncio code (vLLM's
    ``AsyncLLMEngine``); an :class:`~llmlab.engine.client.AsyncEngineClient` itself.

    Build one around an engine (``AsyncEngine(engine)``: an :class:`Engine`, a
    :class:`~llmlab.distributed.data_parallel.DataParallelEngine`) or from ``LLM``'s
    arguments (:meth:`from_settings`). The loop thread starts at construction
    (``start=False`` to start it later with :meth:`start`); :meth:`shutdown` stops it.
    The engine's state (``snapshot``, ``observe``, ``subscribe``, ``kv_cache``,
    ``record``) is read on ``engine``, which is thread-safe for them.

    The loop calls only the request members of the engine (``prepare_request``,
    ``add_prepared_request``, ``abort_request``, ``step``, ``has_unfinished_requests``,
    ``get_tokenizer``), plus, when present, ``wake()`` (called when new work arrives, to
    end a step that waits for it), ``is_alive`` / ``dead_reason()`` (an engine that
    cannot serve: requests are refused, ``check_health`` raises) and ``shutdown()``
    (called by :meth:`shutdown`); a stand-in with just those is served too.
    """

    def __init__(self, engine: EngineClient, *, start: bool = True) -> None:
        if not isinstance(engine, Engine) and not all(
            callable(getattr(engine, name, None)) for name in _ENGINE_METHODS
        ):
            raise TypeError(
                f"engine must be an EngineClient (an Engine, a DataParallelEngine; at least "
                f"its methods {', '.join(_ENGINE_METHODS)}), got {type(engine).__name__}"
            )
        self.engine: EngineClient = engine
        self._cond = threading.Condition()
        self._inbox: list[tuple[PreparedRequest, RequestStream]] = []
        self._aborts: set[str] = set()
        self._streams: dict[str, RequestStream] = {}  # guarded by _cond
        self._stopping = False
        self._dead: BaseException | None = None
        self._last_error: BaseException | None = None  # the latest failed step, until one works
        # When the step now running began (None between steps): a step that never ends
        # (a wedged kernel, a hung component) shows in check_health.
        self._step_started: float | None = None
        self.wedged_after_s = 60.0
        # Request preparation (tokenizing, waiting for a grammar to compile) on threads of
        # its own: requests that wait long (a schema that compiles for seconds) cannot take
        # every thread of asyncio's default pool, which everything else shares.
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=32, thread_name_prefix="llmlab-prepare"
        )
        self._step_again = False  # a failed step may still hold outputs to deliver
        self._failures: dict[str, RequestFailedError] = {}  # request id -> the engine's error
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    @classmethod
    def from_settings(cls, model: str, tokenizer: str | None = None, **kwargs: Any) -> AsyncEngine:
        """Build the engine exactly as ``LLM(model, tokenizer, **kwargs)`` would
        (:func:`~llmlab.entrypoints.engines.build_engine`: ``data_parallel_size`` and
        ``router`` included)."""
        from llmlab.entrypoints.engines import build_engine

        return cls(build_engine(model, tokenizer, **kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: Any, **kwargs: Any) -> AsyncEngine:
        """vLLM's ``AsyncLLMEngine.from_engine_args``: the engine an
        :class:`~llmlab.entrypoints.arg_utils.AsyncEngineArgs` (or ``EngineArgs``) describes;
        ``kwargs`` are ``LLM``'s component keywords (``scheduling_policy``, ``router``, ...)."""
        settings = engine_args.config_kwargs()
        return cls.from_settings(settings.pop("model"), settings.pop("tokenizer"),
                                 **settings, **kwargs)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="llmlab-engine-loop", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after its current step; end every open stream with
        :class:`EngineDeadError` and abort their requests. Safe to call twice."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._wake_engine()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._cond:
            streams = list(self._streams.values()) + [s for _, s in self._inbox]
            self._streams.clear()
            self._inbox.clear()
        if streams:
            try:
                self.engine.abort_request([s.request_id for s in streams])
            except Exception:
                logger.exception("aborting the open requests at shutdown failed")
            self._end(streams, EngineDeadError("the engine was shut down"))
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.engine, "shutdown", None)
        if callable(close):  # an engine with processes of its own (data parallelism)
            close()

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and getattr(self.engine, "is_alive", True))

    @property
    def errored(self) -> bool:
        """True when the loop is dead or the latest step failed."""
        return self._dead is not None or self._last_error is not None

    async def check_health(self) -> None:
        """Raise :class:`EngineDeadError` if the loop is not running, :class:`EngineError`
        if the latest step failed (until a step succeeds again)."""
        if not self.is_running:
            raise EngineDeadError(self._dead_reason())
        if self._last_error is not None:
            raise EngineError(f"the latest engine step failed: {_describe(self._last_error)}")
        started = self._step_started
        if started is not None and time.monotonic() - started > self.wedged_after_s:
            raise EngineError(
                f"the engine is wedged: its current step has run for "
                f"{time.monotonic() - started:.0f} s (more than {self.wedged_after_s:g} s)"
            )

    # -- requests ------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str | int | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        client: Hashable = None,
    ) -> RequestStream:
        """Check and queue a request; returns its :class:`RequestStream`.

        Raises ``TypeError``/``ValueError`` (queueing nothing) on bad input, exactly as
        :meth:`Engine.add_request` does, and :class:`EngineDeadError` when not running.
        ``request_id=None`` picks a fresh one; an int (vLLM's examples pass one) is taken as
        its str. ``lora_request``: a :class:`~llmlab.lora.request.LoRARequest` (its
        adapter is loaded and checked off the loop, with the prompt), or None. ``client``:
        who sent it, as the caller knows (the server passes the peer's address); grammar
        compiles queue fairly per client (default: ``user``).
        """
        if not self.is_running:
            raise EngineDeadError(self._dead_reason())
        if request_id is None:
            request_id = f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        elif isinstance(request_id, int) and not isinstance(request_id, bool):
            request_id = str(int(request_id))
        with self._cond:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
        prepared = await asyncio.get_running_loop().run_in_executor(
            self._prepare_pool, functools.partial(
                self.engine.prepare_request, request_id, prompt, params, arrival_time,
                priority, user, lora_request=lora_request, client=client,
            ),
        )
        delta = getattr(params, "output_kind", None) is RequestOutputKind.DELTA
        stream = RequestStream(request_id, self, asyncio.get_running_loop(), delta=delta)
        with self._cond:
            if not self.is_running:
                raise EngineDeadError(self._dead_reason())
            if request_id in self._streams:  # the same id, added meanwhile
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._inbox.append((prepared, stream))
            self._cond.notify()
        self._wake_engine()
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | int | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they are produced (vLLM's ``generate``).

        What each output holds follows ``sampling_params.output_kind``: everything so far
        (``CUMULATIVE``, the default), only what is new (``DELTA``), or just the final one
        (``FINAL_ONLY``). Closing the generator early (a client that went away) aborts the
        request and frees its blocks. ``lora_request``: run it with that LoRA adapter
        (the engine needs ``enable_lora=True``).
        """
        stream = await self.add_request(
            request_id, prompt, sampling_params, priority=priority, user=user,
            lora_request=lora_request,
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | int | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Yield a pooling request's output (vLLM's ``encode``; ``runner="pooling"``): one
        :class:`~llmlab.engine.outputs.PoolingRequestOutput`, when its prompt is pooled.
        Closing the generator early aborts the request and frees its blocks."""
        stream = await self.add_request(
            request_id, prompt, pooling_params or PoolingParams(), priority=priority, user=user
        )
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends. Unknown ids are ignored."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """:meth:`abort` for synchronous code (any thread): the loop applies it before
        its next step."""
        with self._cond:
            stream = self._streams.pop(request_id, None)
            self._aborts.add(request_id)
            self._cond.notify()
        self._wake_engine()
        if stream is not None:
            # Whatever the loop delivered before the abort is not read any more: after
            # abort() the stream ends, however far the engine had got.
            stream._aborted = True
            self._end([stream], None)

    @property
    def num_open_requests(self) -> int:
        """Requests whose streams are open (queued, running, or not yet picked up)."""
        with self._cond:
            return len(self._streams)

    def get_tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def _wake_engine(self) -> None:
        wake = getattr(self.engine, "wake", None)
        if wake is not None:  # its step() may be waiting for work: new work came
            wake()

    # -- the loop thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._stopping or self._inbox or self._aborts or self._step_again
                        or self.engine.has_unfinished_requests()
                    ):
                        self._cond.wait()
                    if self._stopping:
                        return
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, set()
                    self._step_again = False
                self._apply(aborts, inbox)
                self._step_started = time.monotonic()
                try:
                    self._step()
                finally:
                    self._step_started = None
        except BaseException as err:  # a bug in this loop: never leave a stream hanging
            self._dead = err
            logger.exception("the engine loop died")
            with self._cond:
                self._stopping = True
                streams = list(self._streams.values()) + [s for _, s in self._inbox]
                self._streams.clear()
                self._inbox.clear()
            self._end(streams, EngineDeadError(f"the engine loop died: {_describe(err)}"))

    def _apply(self, aborts: set[str], inbox: list[tuple[PreparedRequest, RequestStream]]):
        if aborts:
            try:
                self.engine.abort_request(aborts)
            except Exception:  # a policy failed in remove(); the engine stays consistent
                logger.exception("aborting %d request(s) raised", len(aborts))
            self._step_again = True  # the step after an abort reports it (and frees blocks)
        for prepared, stream in inbox:
            if stream.finished:
                continue  # aborted or failed before it reached the engine
            try:
                self.engine.add_prepared_request(prepared)
            except Exception as err:  # noqa: BLE001 - it goes to that request's caller
                with self._cond:
                    self._streams.pop(stream.request_id, None)
                self._end([stream], err)

    def _step(self) -> None:
        # Only a step with work proves the engine healthy again (not an empty one that
        # merely reports aborts).
        had_work = self.engine.has_unfinished_requests()
        try:
            outputs = self.engine.step()
        except RequestFailedError as err:
            # The engine ended that request itself; its final output comes with the next
            # step, which then ends the stream with this error.
            self._failures[err.request_id] = err
            self._step_again = True
            return
        except Exception as err:
            self._last_error = err
            logger.exception("an engine step failed; aborting the requests in flight")
            self._fail_all(err)
            return
        if had_work:
            self._last_error = None
        if outputs:
            self._deliver(outputs)

    def _fail_all(self, err: BaseException) -> None:
        """Fail the streams whose requests the engine holds; those still in the inbox
        (added while the failed step ran) never met it and go on."""
        with self._cond:
            queued = {stream.request_id for _, stream in self._inbox}
            streams = [s for rid, s in self._streams.items() if rid not in queued]
            for stream in streams:
                del self._streams[stream.request_id]
        ids = [s.request_id for s in streams]
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the requests of a failed step also failed")
        self._step_again = True
        self._end(streams, EngineError(f"the engine step failed: {_describe(err)}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        finished: list[RequestStream] = []
        with self._cond:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # aborted by its caller meanwhile
                item: Any = output
                failure = None
                if output.finished:
                    # Only the final output takes the request's failure: a partial one
                    # reported just before its replica died comes first in the same batch.
                    failure = self._failures.pop(output.request_id, None)
                    del self._streams[output.request_id]
                    finished.append(stream)
                    if failure is None and _engine_aborted(output):
                        failure = RequestFailedError(
                            output.request_id, "the engine aborted the request (see the server log)"
                        )
                    if failure is not None:
                        item = failure
                by_loop.setdefault(stream._loop, []).append((stream, item))
                if output.finished:
                    by_loop[stream._loop].append((stream, _END))
        for stream in finished:  # outside the lock: callbacks may take locks of their own
            stream._mark_finished()
        for loop, items in by_loop.items():
            self._call_soon(loop, items)

    def _end(self, streams: list[RequestStream], error: BaseException | None) -> None:
        """Finish streams (with ``error`` raised to their readers, if given)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}
        for stream in streams:
            stream._mark_finished()
            items = by_loop.setdefault(stream._loop, [])
            if error is not None:
                items.append((stream, error))
            items.append((stream, _END))
        for loop, items in by_loop.items():
            self._call_soon(loop, items)

    def _call_soon(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that event loop is closed: nobody is reading these streams
            ids = [s.request_id for s, _ in items if not s.finished]
            for request_id in ids:
                self.abort_nowait(request_id)

    def _dead_reason(self) -> str:
        if not getattr(self.engine, "is_alive", True):
            return self.engine.dead_reason()
        if self._dead is not None:
            return f"the engine loop died: {_describe(self._dead)}"
        if self._thread is None:
            return "the engine loop was not started (call start())"
        return "the engine was shut down"


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)


def _call_logged(callback: Callable[[], Any]) -> None:
    try:
        callback()
    except Exception:  # an observer's bug must not end the loop or another stream
        logger.exception("a request stream's done callback raised")


def _engine_aborted(output: RequestOutput | PoolingRequestOutput) -> bool:
    if isinstance(output, PoolingRequestOutput):
        return output.outputs is None  # ended without a pooled output
    return any(c.finish_reason == "abort" for c in output.outputs)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
