"""Grammar compiles for a server: fair, bounded, and killable.

A grammar can take minutes to compile (a ``guided_choice`` of 300,000 options, a deeply
nested schema), and xgrammar 0.2.8 cannot cancel a compile. Compiled on threads, one such
request kept its thread after its caller gave up, and every other client's compile queued
behind it. So here no compile runs in the server's process:

* :class:`CompilePool` sends each compile to a fork server
  (:mod:`llmlab.sampling.compile_worker`, started at the first compile), which forks one
  child per compile. At most ``workers`` children run at once. The child sends the grammar
  back serialized; the caller's thread turns it into xgrammar's object.
* A caller waits at most ``timeout_s``, counted from its submit (time in the queue
  counts). When the last caller waiting for a compile gives up, the compile is dropped
  from the queue, or its child is killed (``SIGKILL``): its worker is free for the next
  compile within milliseconds, and nothing of it runs on.
* The queue is fair across clients: one FIFO per client key (the request's ``user``, say;
  ``None`` is one shared client), and the next compile is the oldest of the client served
  least recently (:class:`FairQueue`), so a client with a long backlog delays another
  client's compile by at most the compiles already running. A client may have at most
  ``max_pending_per_client`` compiles queued or running; one more is a ``ValueError`` at
  once. Two callers asking for the same constraint share one compile.
* :meth:`CompilePool.close` kills the fork server and its children (one process group)
  and fails every waiting caller; it never waits for a compile. The pool's threads are
  daemons, and the fork server ends when this process does, so nothing delays an exit.

Cache hits never come here: :class:`~llmlab.sampling.metadata.GrammarFactory` looks in the
backend's cache on the caller's thread first.

Why processes, and why a fork server: a thread cannot be stopped, so an abandoned compile
ran on to its end, holding its worker, a core and its memory, and the interpreter's exit
waited for it. Long-lived worker processes can be killed, but each replacement would
import xgrammar and torch again (seconds). The fork server pays that once, at the first
compile (not counted in any timeout); after that a compile costs a fork (milliseconds) and
the round trip of the compiled grammar as xgrammar's JSON, its only serialization. Measured
with a 128k-token vocabulary: a five-tool calling schema compiles in 0.06 s, serializes in
0.09 s and loads in 0.04 s; a schema of 50 length-limited strings 1.2 s, 0.5 s and 0.25 s.
Serializing counts toward the timeout; loading runs on the caller's thread, without the GIL.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Hashable
from multiprocessing import Pipe
from typing import Any

# Runs compile_worker.py by path: the fork server imports xgrammar, not llmlab.
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"
_WORKER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_worker.py")


class CompileTimeout(TimeoutError):
    """The compile did not finish within the caller's ``timeout_s`` (it was abandoned)."""


class CompilePoolClosed(RuntimeError):
    """The pool was closed (the engine is shutting down) before the compile finished."""


class CompileJob:
    """One compile in the pool, shared by every caller that asked for its key."""

    __slots__ = ("client", "done", "id", "key", "pid", "result", "state", "waiters")

    def __init__(self, job_id: int, key: tuple, client: Hashable) -> None:
        self.id = job_id
        self.key = key
        self.client = client
        self.state = "queued"  # -> "running" -> "done"
        self.pid: int | None = None  # the child compiling it, once started
        self.waiters = 0
        self.result: tuple | None = None  # ("ok", json) / ("error", message) / ...
        self.done = threading.Event()

    def finish(self, result: tuple) -> None:
        self.state = "done"
        self.result = result
        self.done.set()


class FairQueue:
    """Queued jobs, one FIFO per client; the next job is the oldest of the client served
    least recently (Nagle's fair queuing, RFC 970: one queue per source, served in turn).

    A client whose job is running keeps its place behind the others until it has nothing
    queued or running: so when its compile ends, a client that waited meanwhile goes
    first, even if its own backlog was queued earlier. It also counts each client's jobs
    queued or running (:meth:`pending`), for the per-client limit.
    """

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[CompileJob]] = {}
        self._pending: collections.Counter[Hashable] = collections.Counter()
        self._served: dict[Hashable, int] = {}  # client -> tick of its latest start
        self._ticks = 0

    def __len__(self) -> int:
        return len(self._queues)  # nonzero exactly when some client has a job queued

    def pending(self, client: Hashable) -> int:
        """``client``'s jobs queued or running."""
        return self._pending[client]

    def num_queued(self, client: Hashable) -> int:
        return len(self._queues.get(client, ()))

    def push(self, job: CompileJob) -> None:
        self._queues.setdefault(job.client, collections.deque()).append(job)
        self._pending[job.client] += 1

    def pop(self) -> CompileJob:
        """The next job to run (it counts as running until :meth:`release`)."""
        # min() keeps the first of equals: among clients never served (or served equally
        # long ago), the one that queued first.
        client = min(self._queues, key=lambda c: self._served.get(c, -1))
        queue = self._queues[client]
        job = queue.popleft()
        if not queue:
            del self._queues[client]
        self._ticks += 1
        self._served[client] = self._ticks
        return job

    def remove(self, job: CompileJob) -> None:
        """Take a queued job out (its caller gave up); :meth:`release` it too."""
        queue = self._queues[job.client]
        queue.remove(job)
        if not queue:
            del self._queues[job.client]

    def release(self, job: CompileJob) -> None:
        """``job`` ended (or left the queue): once a client has nothing queued or running,
        it is forgotten (and starts again as never served)."""
        self._pending[job.client] -= 1
        if self._pending[job.client] <= 0:
            del self._pending[job.client]
            self._served.pop(job.client, None)


class CompilePool:
    """Compiles in killable processes; see the module docstring.

    Args:
        tokenizer_info_json: the backend's ``TokenizerInfo.serialize_json()``.
        vocab_size: the model's vocabulary (the logits' width).
        workers: compiles that may run at once (each a process of one xgrammar thread).
        max_pending_per_client: compiles one client may have queued or running.
        max_grammar_bytes: a compiled grammar larger than this is refused (None: no limit).
        startup_timeout_s: how long the first compile waits for the fork server to start
            (importing xgrammar); not counted in any compile's ``timeout_s``.
    """

    def __init__(self, tokenizer_info_json: str, vocab_size: int, *, workers: int = 1,
                 max_pending_per_client: int = 8, max_grammar_bytes: int | None = None,
                 startup_timeout_s: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if max_pending_per_client < 1:
            raise ValueError(f"max_pending_per_client must be >= 1, got {max_pending_per_client}")
        self.workers = workers
        self.max_pending_per_client = max_pending_per_client
        self.startup_timeout_s = startup_timeout_s
        self._init = ("init", tokenizer_info_json, int(vocab_size), 1, max_grammar_bytes)
        self._cond = threading.Condition()
        self._start_lock = threading.Lock()
        self._queue = FairQueue()
        self._in_flight: dict[tuple, CompileJob] = {}  # key -> its queued or running job
        self._running: dict[int, CompileJob] = {}  # job id -> job
        self._kills: list[int] = []  # job ids whose children the writer must kill
        self._ids = 0
        self._process: subprocess.Popen | None = None
        self._starting: subprocess.Popen | None = None
        self._closed = False

    # ------------------------------------------------------------------ callers

    def compile(self, key: tuple, client: Hashable = None, *, timeout_s: float) -> str:
        """The serialized xgrammar grammar of cache key ``key``.

        Raises:
            ValueError: the constraint does not compile (the message names the field), or
                ``client`` already has ``max_pending_per_client`` compiles pending.
            CompileTimeout: not done within ``timeout_s`` of this call (it was abandoned).
            CompilePoolClosed: the pool was closed meanwhile.
        """
        self._start()
        job = self._submit(key, client)
        result = job.result if job.done.wait(timeout_s) else self._give_up(job)
        kind, value = result
        if kind == "ok":
            return value
        if kind == "error":
            raise ValueError(value)
        if kind == "closed":
            raise CompilePoolClosed(value)
        raise CompileTimeout(value)

    def _submit(self, key: tuple, client: Hashable) -> CompileJob:
        with self._cond:
            if self._closed:
                raise CompilePoolClosed("grammar compiles are shut down")
            job = self._in_flight.get(key)
            if job is None:
                if self._queue.pending(client) >= self.max_pending_per_client:
                    raise ValueError(
                        f"structured_outputs: client {client!r} already has "
                        f"{self._queue.pending(client)} grammars compiling or queued, the "
                        f"most one client may have ({self.max_pending_per_client}); wait "
                        "for them to finish"
                    )
                self._ids += 1
                job = CompileJob(self._ids, key, client)
                self._in_flight[key] = job
                self._queue.push(job)
                self._cond.notify_all()
            job.waiters += 1
            return job

    def _give_up(self, job: CompileJob) -> tuple:
        """A caller's time ran out: abandon ``job`` unless another caller still waits for
        it. The result this caller reports (the job's own if it finished just now)."""
        with self._cond:
            job.waiters -= 1
            if job.state == "done":
                return job.result
            if job.waiters == 0:
                self._forget(job)
                if job.state == "queued":
                    self._queue.remove(job)
                    job.finish(("timeout", "it waited in the queue"))
                else:  # its child dies now; its worker is free once the kill is reported
                    self._kills.append(job.id)
                self._cond.notify_all()
            return ("timeout", "it was still compiling" if job.state == "running"
                    else "it waited in the queue")

    def _forget(self, job: CompileJob) -> None:
        """Drop ``job`` from what callers can join and from its client's count, once
        (locked)."""
        if self._in_flight.get(job.key) is job:
            del self._in_flight[job.key]
            self._queue.release(job)

    # ------------------------------------------------------------------ what tests read

    def running_pids(self) -> list[int]:
        """The pids of the children compiling now."""
        with self._cond:
            return [job.pid for job in self._running.values() if job.pid is not None]

    def num_queued(self, client: Hashable = None) -> int:
        with self._cond:
            return self._queue.num_queued(client)

    @property
    def server_pid(self) -> int | None:
        """The fork server's pid (None before the first compile and after close)."""
        process = self._process
        return None if process is None else process.pid

    # ------------------------------------------------------------------ the fork server

    def _start(self) -> None:
        """Start the fork server unless it runs (the first compile waits for it)."""
        with self._start_lock:
            if self._closed:
                raise CompilePoolClosed("grammar compiles are shut down")
            if self._process is not None and self._process.poll() is None:
                return
            process, conn = self._spawn()
            users = [2]  # the socket is closed by the last of the two threads to stop

            def stopped() -> None:
                with self._cond:
                    users[0] -= 1
                    last = users[0] == 0
                if last:
                    conn.close()

            for target, name in ((self._read, "reader"), (self._write, "writer")):
                threading.Thread(target=target, args=(process, conn, stopped), daemon=True,
                                 name=f"llmlab-grammar-{name}").start()

    def _spawn(self) -> tuple[subprocess.Popen, Any]:
        """A fork server, started and ready, and the server's end of its socket."""
        ours, theirs = Pipe(duplex=True)
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, _WORKER_PATH, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: close() kills it whole
        )
        theirs.close()
        with self._cond:
            self._starting = process  # close() kills it too
        try:
            ours.send(self._init)
            if not ours.poll(self.startup_timeout_s):
                raise RuntimeError(
                    f"the grammar compile process did not start within "
                    f"{self.startup_timeout_s:g} s"
                )
            ready = ours.recv()
            if ready[0] != "ready":  # pragma: no cover - the protocol's first answer
                raise RuntimeError(f"the grammar compile process answered {ready!r}")
            with self._cond:
                self._starting = None
                if self._closed:
                    raise CompilePoolClosed("grammar compiles are shut down")
                self._process = process
            return process, ours
        except BaseException as err:
            _kill_group(process)
            ours.close()
            if self._closed:
                raise CompilePoolClosed("grammar compiles are shut down") from None
            if isinstance(err, (EOFError, OSError)):
                raise RuntimeError(
                    "the grammar compile process exited while starting (is xgrammar "
                    "importable by this Python?)"
                ) from err
            raise

    def _write(self, process: subprocess.Popen, conn: Any, stopped: Callable[[], None]
               ) -> None:
        """Send kills and the next fair job whenever a worker is free (one thread)."""
        try:
            while True:
                with self._cond:
                    while self._process is process and not self._kills and not (
                            self._queue and len(self._running) < self.workers):
                        self._cond.wait()
                    if self._process is not process:
                        return
                    kills, self._kills = self._kills, []
                    job = None
                    if self._queue and len(self._running) < self.workers:
                        job = self._queue.pop()
                        job.state = "running"
                        self._running[job.id] = job
                for job_id in kills:
                    conn.send(("kill", job_id))
                if job is not None:
                    conn.send(("compile", job.id, job.key))
        except OSError:
            return  # the fork server is gone; the reader fails what was in flight
        finally:
            stopped()

    def _read(self, process: subprocess.Popen, conn: Any, stopped: Callable[[], None]
              ) -> None:
        """Hand results to their jobs and free their workers (one thread)."""
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError, pickle.UnpicklingError):
                    self._lost(process)
                    return
                with self._cond:
                    self._handle(message)
                    self._cond.notify_all()
        finally:
            stopped()

    def _handle(self, message: tuple) -> None:
        """One message of the fork server's (locked)."""
        if message[0] == "started":
            job = self._running.get(message[1])
            if job is not None:
                job.pid = message[2]
        elif message[0] == "done":
            job = self._running.pop(message[1], None)
            if job is not None:
                self._forget(job)
                data = message[2]
                job.finish(pickle.loads(data) if data is not None else (
                    "error", f"structured_outputs.{job.key[0]} could not be compiled: its "
                    "compile process died (out of memory?)"))

    def _lost(self, process: subprocess.Popen) -> None:
        """The fork server died (or was closed): fail every job, running or queued; the
        next compile starts a new one."""
        with self._cond:
            if self._process is not process:
                return
            self._process = None
            jobs = list(self._running.values())
            self._running.clear()
            while self._queue:
                jobs.append(self._queue.pop())
            for job in jobs:
                self._forget(job)
                if not job.done.is_set():
                    job.finish(("error", f"structured_outputs.{job.key[0]} could not be "
                                         "compiled: the compile process exited"))
            self._cond.notify_all()
        _kill_group(process)

    # ------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Kill every compile (running or queued) and the fork server; fail their callers.
        Returns at once; safe to call twice."""
        with self._cond:
            self._closed = True
            process, self._process = self._process, None
            starting, self._starting = self._starting, None
            jobs = list(self._running.values())
            while self._queue:
                jobs.append(self._queue.pop())
            self._running.clear()
            self._in_flight.clear()
            self._queue = FairQueue()
            for job in jobs:
                if not job.done.is_set():
                    job.finish(("closed", "grammar compiles were shut down"))
            self._cond.notify_all()
        for running in (process, starting):
            if running is not None:
                _kill_group(running)  # its threads see the socket end, and stop


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the fork server's process group (it and its children), then reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refused
        pass
