"""How the data-parallel front end holds a replica: start it, send it commands, wait on it,
see it die, stop it.

:class:`ReplicaHandle` is the seam: :class:`ProcessReplicaHandle` runs the replica in a
process started with ``torch.multiprocessing`` (spawn);
:class:`~llmlab.distributed.ray_replicas.RayReplicaHandle` runs it in a Ray actor that
connects back over an authenticated ``multiprocessing.connection`` socket (and says how
it ended with ``describe_exit()``). :func:`plan_devices` says which
devices each replica gets; :func:`wait_ready` waits for replicas to build their engines and
:func:`stop_replicas` stops them.

Commands go out through a :class:`PipeWriter`, a thread per replica: a replica that
stops reading (SIGSTOP, a wedged loop) fills its pipe, and a plain write would then block
the front end, every other replica's requests with it. Reports come in through a
:class:`MessageReader`, which never waits for the rest of a message: a replica stopped
halfway through writing one cannot block the front end either.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import pickle
import signal
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import attrs

from llmlab.distributed.replica_process import (
    PipeWriter,
    ReplicaInfo,
    ReplicaReady,
    ReplicaSpec,
    ReplicaStartFailed,
    Shutdown,
    replica_main,
)

logger = logging.getLogger(__name__)


class ReplicaHandle(Protocol):
    """One replica as the front end holds it.

    Attributes:
        index: the replica's index.
        connection: what ``multiprocessing.connection.wait`` waits on for its reports;
            ``recv()`` gives the next one and raises ``EOFError`` once it is gone.
        sentinel: ready when the replica has died (a process sentinel), or None.
        pid / exit_code: the process id, and its exit status once it ended (negative: the
            signal that killed it), else None.
    """

    index: int
    connection: Any
    sentinel: Any
    pid: int | None
    exit_code: int | None

    def start(self) -> None: ...

    def send_bytes(self, payload: bytes) -> None:
        """Send a pickled command without waiting for the replica to read it (a
        :class:`PipeWriter`); raises ``OSError`` (or ``EOFError``) if it is known to be
        gone."""
        ...

    def is_alive(self) -> bool: ...

    def request_stop(self) -> None:
        """Ask it to exit after its current step (without waiting)."""
        ...

    def stop(self, timeout: float) -> None:
        """Ask it to exit, then terminate and kill it after ``timeout``; idempotent."""
        ...


class MessageReader:
    """Reads a replica's messages (``multiprocessing`` framing: a 4-byte big-endian
    length, or -1 and an 8-byte one, then the pickle) without ever waiting: it takes the
    bytes that have arrived and unpickles each message once all of it is there.
    ``Connection.recv`` would wait for the rest of a message whose writer was stopped
    halfway (a report longer than one write)."""

    def __init__(self, connection: Any) -> None:
        self._fd = connection.fileno()
        self._buffer = bytearray()

    def read(self) -> tuple[list[Any], bool]:
        """``(every whole message that has arrived, oldest first; whether the replica has
        closed its end)``."""
        closed = False
        try:
            while multiprocessing.connection.wait([self._fd], 0):
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    closed = True
                    break
                self._buffer += chunk
        except OSError:
            closed = True  # reset, or closed under us
        return self._messages(), closed

    def _messages(self) -> list[Any]:
        buffer, start, found = self._buffer, 0, []
        while len(buffer) - start >= 4:
            (size,), head = struct.unpack_from("!i", buffer, start), 4
            if size == -1:
                if len(buffer) - start < 12:
                    break
                (size,), head = struct.unpack_from("!Q", buffer, start + 4), 12
            if len(buffer) - start - head < size:
                break  # the rest has not arrived yet
            body = start + head
            found.append(pickle.loads(buffer[body:body + size]))
            start = body + size
        del buffer[:start]
        return found


@attrs.define(eq=False)
class ProcessReplicaHandle:
    """A replica in a process of its own (spawned: CUDA cannot be forked; not daemonic,
    because a replica may itself start tensor-parallel worker processes)."""

    spec: ReplicaSpec
    connection: Any = None
    _process: Any = None
    _writer: PipeWriter | None = None
    _stop_requested: bool = False
    _stopped: bool = False

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def sentinel(self) -> Any:
        return self._process.sentinel if self._process is not None else None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exit_code(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    def start(self) -> None:
        import torch.multiprocessing

        ctx = torch.multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(
            target=replica_main, args=(self.spec, theirs),
            name=f"llmlab-dp-replica-{self.spec.index}", daemon=False,
        )
        process.start()
        theirs.close()  # only the child holds its end: its death is an EOF here
        self.connection, self._process = ours, process
        self._writer = PipeWriter(ours, f"llmlab-dp-commands-{self.spec.index}")

    def send_bytes(self, payload: bytes) -> None:
        if self._writer is None:
            raise OSError(f"replica {self.index} was not started")
        self._writer.send(payload)

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def request_stop(self) -> None:
        if self._stop_requested or self._process is None:
            return
        self._stop_requested = True
        try:
            self.send_bytes(pickle.dumps(Shutdown()))
        except OSError:
            pass  # already gone

    def stop(self, timeout: float) -> None:
        if self._stopped or self._process is None:
            return
        self._stopped = True
        process = self._process
        if process.is_alive():
            self.request_stop()
            process.join(timeout)
        if process.is_alive():
            logger.warning("replica %d (pid %s) did not stop in %.0f s; terminating it",
                           self.index, process.pid, timeout)
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        # Whatever the replica started (tensor-parallel workers) is in its process group.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        if self._writer is not None:  # its process is gone: a pending write fails at once
            self._writer.close(1.0)
        self.connection.close()


def describe_exit(exit_code: int | None) -> str:
    """``"exit code 1"`` or ``"killed by SIGKILL (exit code -9)"``."""
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        return f"killed by {name} (exit code {exit_code})"
    return f"exit code {exit_code}"


@attrs.frozen
class DevicePlan:
    """Per replica: its ``CUDA_VISIBLE_DEVICES`` (None on CPU), the
    ``gpu_memory_utilization`` it is built with, and its start wave (a replica starts
    once every replica of the waves before it is ready)."""

    visible_devices: tuple[str | None, ...]
    gpu_memory_utilization: tuple[float, ...]
    waves: tuple[int, ...]


def plan_devices(
    device: str, num_replicas: int, tensor_parallel_size: int, gpu_memory_utilization: float,
    *, num_gpus: int | None = None, visible: Sequence[str] | None = None,
) -> DevicePlan:
    """Which devices each replica gets: on CUDA replica ``i`` uses devices ``i * tp`` to
    ``(i + 1) * tp - 1``; with fewer devices than ``replicas x tp`` they wrap around (a
    device given as ``"cuda:k"`` puts every replica on devices from ``k``). On CPU nothing
    is set (``num_gpus``/``visible`` override what this machine reports, for tests).

    Replicas that share a device split its ``gpu_memory_utilization`` ``u`` (with a
    warning): ``k`` sharers get ``u / k`` each. An engine sizes its KV cache as
    ``utilization x device memory`` less what is in use, other processes' memory included
    (:mod:`llmlab.cache.kv_tensors`), so sharers start one after another (``waves``), the
    ``r``-th (0-based) built with ``(r + 1) x u / k``: what the ``r`` before it hold
    counts against it, which leaves it its own ``u / k``.
    """
    unchanged = DevicePlan((None,) * num_replicas, (gpu_memory_utilization,) * num_replicas,
                           (0,) * num_replicas)
    if device == "cpu":
        return unchanged
    if num_gpus is None:
        import torch

        # device_count() does not initialise CUDA in this process.
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if num_gpus == 0:
        return unchanged  # "auto" on a machine without CUDA (or "cuda": the build says why)
    if visible is None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        visible = env.split(",") if env else [str(i) for i in range(num_gpus)]
    visible = list(visible)[:num_gpus]
    first = int(device.split(":", 1)[1]) if device.startswith("cuda:") else None
    starts = [first if first is not None else i * tensor_parallel_size
              for i in range(num_replicas)]
    ordinals = [list(dict.fromkeys((start + j) % num_gpus for j in range(tensor_parallel_size)))
                for start in starts]
    users: dict[int, int] = {}
    waves = []
    for devices in ordinals:  # a replica's wave: how many replicas came before it there
        waves.append(max(users.get(d, 0) for d in devices))
        for d in devices:
            users[d] = users.get(d, 0) + 1
    shares = [gpu_memory_utilization / max(users[d] for d in devices) for devices in ordinals]
    crowded = max(users.values())
    if crowded > 1:
        logger.warning(
            "data parallelism: %d replica(s) x tensor_parallel_size=%d need %d devices but "
            "%d are used, so up to %d replicas share a device; each gets "
            "gpu_memory_utilization=%.3g of it (%.3g / %d), and they start one after another",
            num_replicas, tensor_parallel_size, num_replicas * tensor_parallel_size,
            len(users), crowded, min(shares), gpu_memory_utilization, crowded,
        )
    return DevicePlan(
        tuple(",".join(visible[d] for d in devices) for devices in ordinals),
        tuple(share * (wave + 1) for share, wave in zip(shares, waves, strict=True)),
        tuple(waves),
    )


def stop_replicas(handles: Sequence[ReplicaHandle], timeout: float, fds: Iterable[int]) -> None:
    """Ask every replica to stop, then stop each (the finalizer: no reference to the
    engine)."""
    for handle in handles:
        request = getattr(handle, "request_stop", None)
        if request is not None:
            request()
    deadline = time.monotonic() + timeout
    for handle in handles:
        try:
            handle.stop(max(0.5, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - stop the others anyway
            logger.exception("stopping replica %d failed", handle.index)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def wait_ready(handles: Sequence[ReplicaHandle], timeout_s: float) -> list[ReplicaInfo]:
    """Each replica's facts once its engine is built; raises naming the first replica
    that failed, died or did not report within ``timeout_s`` (``distributed_timeout_s``)."""
    infos: dict[int, ReplicaInfo] = {}
    deadline = time.monotonic() + timeout_s
    while len(infos) < len(handles):
        pending = [h for h in handles if h.index not in infos]
        waitables = [h.connection for h in pending] + [
            h.sentinel for h in pending if h.sentinel is not None
        ]
        left = deadline - time.monotonic()
        ready = multiprocessing.connection.wait(waitables, max(0.0, left)) if left > 0 else []
        if not ready:
            raise TimeoutError(
                f"replica(s) {[h.index for h in pending]} did not start within "
                f"distributed_timeout_s={timeout_s:g} s"
            )
        for handle in pending:
            if handle.connection not in ready and handle.sentinel not in ready:
                continue
            try:
                message = handle.connection.recv() if handle.connection.poll(0) else None
            except (EOFError, OSError):
                message = None
            if isinstance(message, ReplicaReady):
                infos[handle.index] = message.info
            elif isinstance(message, ReplicaStartFailed):
                raise _start_error(handle.index, message)
            elif not handle.is_alive() or message is None and handle.connection in ready:
                handle.stop(1.0)
                how = getattr(handle, "describe_exit", None)  # a Ray actor says how
                raise RuntimeError(
                    f"replica {handle.index} (pid {handle.pid}) died while starting "
                    f"({how() if how else describe_exit(handle.exit_code)}); see its error "
                    "above. Replicas started as processes are spawned: a script that starts "
                    "them must do so under `if __name__ == '__main__':`"
                )
    return [infos[h.index] for h in handles]


def _start_error(index: int, failed: ReplicaStartFailed) -> Exception:
    """The replica's build error, as the same kind of error where it is a common one (so
    a bad setting is still a ``ValueError``), naming the replica."""
    kinds = {k.__name__: k for k in (ValueError, TypeError, OSError, FileNotFoundError,
                                     ImportError, MemoryError, TimeoutError)}
    kind = kinds.get(failed.error_type, RuntimeError)
    message = f"replica {index} failed to start: {failed.error_type}: {failed.message}"
    if kind is RuntimeError:
        message += f"\n{failed.traceback}"
    return kind(message)
