"""The multi-process executor: one engine, its model split over ``tensor_parallel_size`` ranks.

Rank 0 is the engine's own process: it schedules, and for each step broadcasts the
data-only :class:`~llmlab.scheduler.batch.ScheduledBatch` to the other ranks; then every
rank runs the same :class:`~llmlab.runner.model_runner.ModelRunner` on it, its model
shard joining the others through the collectives inside the model (two all-reduces per
block, one all-gather for the logits). Every rank also samples: after the all-gather each
holds the same full logits and the same seeded generator, so each draws the same tokens
and keeps its per-row state (penalty counts, grammars, drafts) identical to rank 0's, with
no second message per step. Only rank 0's result is returned (vLLM's workers do the same).

Workers are started and stopped by llmlab: ``torch.multiprocessing`` processes (spawned,
daemonic, and watching their parent) or Ray actors (:mod:`llmlab.distributed.ray_workers`);
either way each runs :func:`~llmlab.distributed.tp_worker.worker_main`.
The ranks meet at a ``TCPStore`` that rank 0 opens on a free port, and talk over two
``torch.distributed`` process groups of their own (never the default group, so several
engines, and a user's own ``torch.distributed`` work, coexist in one process): NCCL (CUDA) or
gloo (CPU) for the model's collectives, and gloo for the batches.

Failure is total, and fast: a worker that dies closes its connections, so the collective
rank 0 is in raises at once; any exception during a step leaves the ranks out of step with
each other. Either way the executor shuts every worker down and raises
:class:`~llmlab.errors.ExecutorDeadError` naming the rank (and its exit code) from this step
and every later one; the engine fails the requests in flight (``docs/distributed.md``).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import threading
import time
import weakref
from typing import Any

import attrs
import torch
import torch.distributed as dist

from llmlab.distributed.parallel_state import TensorParallel
from llmlab.distributed.tp_worker import (
    broadcast_object,
    collective_backend,
    process_groups,
    worker_main,
)
from llmlab.errors import ExecutorDeadError
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch

logger = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"


@attrs.define(eq=False)
class ProcessWorker:
    """A worker rank in a ``torch.multiprocessing`` process."""

    rank: int
    process: Any

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def describe_exit(self) -> str:
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def join(self, timeout: float) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)


def _start_process_workers(size: int, port: int, plan: Any) -> list[ProcessWorker]:
    context = torch.multiprocessing.get_context("spawn")
    workers = []
    for rank in range(1, size):
        process = context.Process(
            target=worker_main, args=(rank, size, _LOOPBACK, port, plan, os.getpid()),
            name=f"llmlab-tp-rank{rank}", daemon=True,
        )
        process.start()
        workers.append(ProcessWorker(rank, process))
    return workers


class WorkerGroup:
    """Rank 0's handle on the other ranks: the batch broadcast, liveness, shutdown."""

    def __init__(self, workers: list, control, store) -> None:
        self.workers = workers
        self.control = control
        self.store = store
        self._closed = False
        self._lock = threading.Lock()
        self.broadcast_seconds = 0.0  # spent sending batches (benchmarks.distributed)

    def broadcast(self, batch: ScheduledBatch | None) -> None:
        started = time.perf_counter()
        broadcast_object(self.control, batch, send=True)
        self.broadcast_seconds += time.perf_counter() - started

    def dead(self, wait_s: float = 0.0) -> list:
        """Workers that are not alive, waiting up to ``wait_s`` for one to be (a peer's
        closed connection is seen a moment before its process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [w for w in self.workers if not w.is_alive()]
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(0.02)

    def shutdown(self, graceful: bool = True, timeout: float = 10.0) -> None:
        """Stop every worker: a None batch asks them to leave (``graceful``); whoever is
        still there after ``timeout`` is killed. Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if graceful and not self.dead():
            try:
                self.broadcast(None)
            except Exception:  # noqa: BLE001 - a worker died meanwhile: kill the rest
                graceful = False
        deadline = time.monotonic() + (timeout if graceful else 0.0)
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            worker.kill()


def start_workers(plan: Any) -> tuple[TensorParallel, WorkerGroup]:
    """Start ranks 1..N-1 for ``plan`` (its ``distributed_executor_backend``), meet them,
    and return rank 0's :class:`TensorParallel` and the :class:`WorkerGroup`.

    Raises ``RuntimeError`` naming the rank when a worker dies before the group forms, and
    ``TimeoutError`` after ``distributed_timeout_s`` without every worker; nothing is left
    running either way.
    """
    cfg = plan.config
    size = cfg.tensor_parallel_size
    timeout = datetime.timedelta(seconds=cfg.distributed_timeout_s)
    device = plan.device
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    # Port 0: the store picks a free port itself (no race with another process).
    store = dist.TCPStore("0.0.0.0", 0, size, True, timeout=timeout, wait_for_workers=False)
    if cfg.distributed_executor_backend == "ray":
        from llmlab.distributed.ray_workers import start_ray_workers

        workers = start_ray_workers(size, store.port, plan)
    else:
        workers = _start_process_workers(size, store.port, plan)
    group = WorkerGroup(workers, None, store)
    try:
        _await_workers(group, store, size, cfg.distributed_timeout_s)
        data, control = process_groups(
            store, 0, size, collective_backend(cfg, device), timeout, device
        )
    except BaseException:
        group.shutdown(graceful=False)
        raise
    group.control = control
    return TensorParallel(0, size, data), group


def _await_workers(group: WorkerGroup, store, size: int, timeout_s: float) -> None:
    """Wait until every worker checked in at the store, watching that each still lives."""
    keys = [f"ready/{rank}" for rank in range(1, size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        gone = group.dead()
        if gone:
            worker = gone[0]
            raise RuntimeError(
                f"tensor-parallel worker rank {worker.rank} died while starting "
                f"({worker.describe_exit()}); see its log above. Workers are spawned "
                "processes: a script that builds a tensor-parallel engine must do so under "
                "`if __name__ == '__main__':`"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"tensor-parallel workers did not start within distributed_timeout_s="
                f"{timeout_s:g} s"
            )
        time.sleep(0.05)


class TensorParallelExecutor:
    """The :class:`~llmlab.runner.executor.Executor` of a tensor-parallel engine: rank 0's
    model runner plus the other ranks, which execute every batch with it.

    Attributes:
        runner: rank 0's :class:`~llmlab.runner.model_runner.ModelRunner`.
        workers: the :class:`WorkerGroup` of ranks 1..N-1.
        dead: why the group stopped (None while it runs).
    """

    def __init__(self, runner: Any, workers: WorkerGroup) -> None:
        self.runner = runner
        self.workers = workers
        self.dead: str | None = None
        # Workers go when the engine goes, or at exit, whichever comes first.
        self._finalizer = weakref.finalize(self, workers.shutdown)

    @property
    def size(self) -> int:
        return len(self.workers.workers) + 1

    def execute(self, batch: ScheduledBatch) -> BatchOutput:
        if self.dead is not None:
            raise ExecutorDeadError(self.dead)
        try:
            self.workers.broadcast(batch)
            return self.runner.execute(batch)
        except BaseException as err:
            self.dead = self._diagnose(err)
            logger.error("%s", self.dead)
            self.workers.shutdown(graceful=False)
            raise ExecutorDeadError(self.dead) from err

    def _diagnose(self, err: BaseException) -> str:
        gone = self.workers.dead(wait_s=2.0)
        if gone:
            ranks = ", ".join(f"rank {w.rank} ({w.describe_exit()})" for w in gone)
            return (
                f"tensor-parallel worker {ranks} died during a step; the engine's "
                f"{self.size} ranks were shut down and it cannot run again (build a new one)"
            )
        cause = err.__cause__ or err
        return (
            f"a tensor-parallel step failed on rank 0 ({type(cause).__name__}: {cause}); the "
            f"ranks may be out of step, so all {self.size} were shut down and the engine "
            "cannot run again (build a new one)"
        )

    def shutdown(self) -> None:
        """Stop the workers (also done when the executor is garbage-collected)."""
        self._finalizer()

    def __getattr__(self, name: str) -> Any:
        # Read-only views of rank 0's runner (block tables, rows, the model) for tools
        # that inspect an engine's executor.
        if name.startswith("__") or name in ("runner", "workers"):
            raise AttributeError(name)
        return getattr(self.runner, name)
