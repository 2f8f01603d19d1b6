"""Data-parallel replicas as Ray actors (``data_parallel_size > 1`` with
``distributed_executor_backend="ray"``).

:class:`RayReplicaHandle` is the :class:`~llmlab.distributed.replica_handle.ReplicaHandle`
of a replica that runs in a Ray actor instead of a process started by llmlab. The actor
runs the same replica loop as a replica process
(:func:`~llmlab.distributed.replica_process.run_replica`: build the engine, then the
loop), over the same kind of connection: a ``multiprocessing.connection.Connection``,
here over TCP rather than a pipe.

Design:

* **The connection.** Each handle listens on a fresh TCP port of its node's address (the
  one Ray gives this node, reachable from the other nodes, never loopback) and starts its
  actor with that address and a random key. The actor connects back with
  ``multiprocessing.connection.Client`` and both sides authenticate with the key
  (``multiprocessing``'s HMAC challenge, in both directions); the handle then stops
  listening. From there everything is as with a process: pickled commands one way, pickled
  reports the other, ``multiprocessing.connection.wait`` on the connection, and EOF on it
  the moment the actor's process is gone (``ray.kill``, a crash: the kernel closes the
  socket). The port is accepted lazily, the first time ``connection`` is read (in
  :func:`~llmlab.distributed.replica_handle.wait_ready`), so every replica's actor starts
  and imports torch at once rather than one after another.
* **Death detection.** EOF on the connection covers a dead process. The handle also
  follows the actor's long-running ``run`` task (``ObjectRef.future()``: Ray calls back
  when it resolves, as the loop returns, or fails, as Ray declares the actor dead, e.g.
  when its node is lost without the socket closing) and then makes ``sentinel`` (the read
  end of a pipe) ready, so the front end learns within Ray's own failure-detection time in
  every case. ``is_alive()`` reads what that callback saw (no Ray call per request
  routed); ``exit_code`` is always None (Ray has none to give):
  :meth:`RayReplicaHandle.describe_exit` says why the actor ended.
* **Resources.** No placement group: one actor per replica, asking for ``num_gpus =
  tensor_parallel_size`` (and one CPU) on CUDA, or ``num_cpus = cpu_threads x
  tensor_parallel_size`` on CPU (1 per rank when ``cpu_threads`` is unset). An actor's
  resources are always on one node, so a replica never spans nodes. Ray sets each actor's
  ``CUDA_VISIBLE_DEVICES`` to its own GPUs: the replica runs on ``"cuda"`` and the front
  end does not plan devices (``device="cuda:N"`` means "on a GPU"; ``"auto"`` means on
  GPUs when the cluster has them).
* **Tensor parallelism inside a replica** uses the ``"mp"`` backend: ranks 1.. are
  processes the actor starts on its own node, on the GPUs Ray gave the actor (they die
  with it: they watch their parent). So one replica is one actor and one resource request;
  Ray never has to co-schedule a replica's ranks.
* **Stopping.** ``stop()`` asks the loop to exit, waits for it, then ``ray.kill``s the
  actor (a finished actor would otherwise hold its resources until the front end exits).
  Actors fate-share with the process that created them: if the front end dies, Ray ends
  them (and their loops see EOF).

Ray is joined as :mod:`~llmlab.distributed.ray_workers` joins it (an initialised Ray,
``RAY_ADDRESS``, the latest local cluster, else a new local instance). The front end must
be a Ray driver on a node the actors can reach over TCP (not a Ray Client ``ray://``
connection from outside the cluster).
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing.connection
import os
import pickle
import secrets
import socket
import struct
import threading
import time
from typing import Any

import attrs

from llmlab.distributed.ray_workers import _connect, _death_reason, _import_ray
from llmlab.distributed.replica_process import PipeWriter
from llmlab.distributed.replica_process import ReplicaSpec, Shutdown, run_replica

logger = logging.getLogger(__name__)

# How long the authentication exchange with a peer that connected may take (a peer that
# connects and says nothing is dropped after this).
_HANDSHAKE_S = 10.0
# How long to wait for a killed actor's task to fail (milliseconds locally).
_KILL_WAIT_S = 5.0


def replica_resources(settings: dict[str, Any], model: str, tokenizer: str | None,
                      cluster_gpus: float) -> tuple[dict[str, float], dict[str, Any]]:
    """``(Ray resources, the replica's settings)`` for one replica built from ``settings``.

    GPU replicas (``device`` ``"cuda[:N]"``, or ``"auto"`` on a cluster with enough GPUs)
    ask for ``tensor_parallel_size`` GPUs and one CPU and run on ``"cuda"`` (Ray's GPUs are
    the only ones they see); CPU replicas ask for ``cpu_threads`` CPUs per rank (1 when
    unset). Tensor parallelism inside the replica uses ``"mp"``.
    """
    from llmlab.engine.builder import EngineBuilder

    cfg = EngineBuilder.from_settings(model, tokenizer, **settings).config
    tp = cfg.tensor_parallel_size
    if cfg.device.startswith("cuda") or (cfg.device == "auto" and cluster_gpus >= tp):
        resources = {"CPU": 1.0, "GPU": float(tp)}
        device = "cuda"
    else:
        resources = {"CPU": float((cfg.cpu_threads or 1) * tp), "GPU": 0.0}
        device = "cpu"
    own = dict(settings, device=device, data_parallel_size=1,
               distributed_executor_backend="mp" if tp > 1 else None)
    return resources, own


def _set_nodelay(conn: Any) -> None:
    """No Nagle delay on a connection's socket (reports are small and latency matters).
    Options belong to the socket, so setting them through a duplicate of its fd is enough."""
    try:
        dup = socket.socket(fileno=os.dup(conn.fileno()))
    except OSError:
        return
    try:
        dup.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    finally:
        dup.close()


def _set_recv_timeout(conn: Any, seconds: float) -> None:
    """Make a blocking read on ``conn`` fail (``OSError``) after ``seconds`` (0: never)."""
    dup = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        whole = int(seconds)
        dup.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                       struct.pack("ll", whole, int((seconds - whole) * 1e6)))
    finally:
        dup.close()


# -- the actor ---------------------------------------------------------------------------


class _ReplicaActor:
    """One data-parallel replica (wrapped with ``ray.remote`` by :class:`RayReplicaHandle`;
    two concurrent calls, so ``ping`` answers while ``run`` runs)."""

    def ping(self) -> int:
        """This actor's pid."""
        return os.getpid()

    def run(self, spec: ReplicaSpec, address: tuple[str, int], authkey: bytes) -> None:
        """Connect to the front end at ``address`` and be the replica until it says stop
        (or goes)."""
        conn = multiprocessing.connection.Client(address, authkey=authkey)
        try:
            _set_nodelay(conn)
            conn.send_bytes(str(os.getpid()).encode())
            run_replica(spec, conn)
        finally:
            conn.close()


# -- the front end's handle --------------------------------------------------------------


@attrs.define(eq=False)
class RayReplicaHandle:
    """A replica in a Ray actor: a
    :class:`~llmlab.distributed.replica_handle.ReplicaHandle` (see the module docstring).

    Attributes:
        spec: what the replica builds (its settings are adapted to Ray by
            :func:`replica_resources` when it starts).
        actor: the Ray actor handle (None before ``start()``).
        ref: the ObjectRef of the actor's long-running ``run`` task.
        resources: what the actor asked Ray for.
        node_ip: the address the handle listens on for the actor's connection.
    """

    spec: ReplicaSpec
    actor: Any = None
    ref: Any = None
    resources: dict[str, float] = attrs.field(factory=dict)
    node_ip: str | None = None
    pid: int | None = None
    _ray: Any = attrs.field(default=None, repr=False)
    _conn: Any = attrs.field(default=None, repr=False)
    _writer: PipeWriter | None = attrs.field(default=None, repr=False)
    _server: Any = attrs.field(default=None, repr=False)
    _authkey: bytes = attrs.field(default=b"", repr=False)
    _deadline: float = attrs.field(default=0.0, repr=False)
    _timeout_s: float = attrs.field(default=0.0, repr=False)
    _accept_error: BaseException | None = attrs.field(default=None, repr=False)
    _sentinel_r: int | None = attrs.field(default=None, repr=False)
    _sentinel_w: int | None = attrs.field(default=None, repr=False)
    _ended: threading.Event = attrs.field(factory=threading.Event, repr=False)
    _future: Any = attrs.field(default=None, repr=False)
    _fd_lock: threading.Lock = attrs.field(factory=threading.Lock, repr=False)
    _exit_reason: str | None = attrs.field(default=None, repr=False)
    _stop_requested: bool = attrs.field(default=False, repr=False)
    _stopped: bool = attrs.field(default=False, repr=False)

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def sentinel(self) -> int | None:
        """Ready once the actor's task has ended (the actor died, or its loop returned)."""
        return self._sentinel_r

    @property
    def exit_code(self) -> int | None:
        return None  # a Ray actor has none; describe_exit() says how it ended

    @property
    def connection(self) -> Any:
        """The connection to the actor; the first read waits for the actor to connect
        (``TimeoutError`` after ``distributed_timeout_s``, ``RuntimeError`` if it dies
        first, both naming the replica)."""
        if self._conn is None:
            if self._accept_error is not None:
                raise self._accept_error
            if self._server is None:
                return None  # not started, or stopped before it connected
            try:
                self._conn = self._accept()
            except BaseException as err:
                self._accept_error = err
                raise
            finally:
                self._close_server()
        return self._conn

    # -- starting ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the actor (it connects back later: see ``connection``)."""
        ray = _import_ray()
        _connect(ray)
        self._ray = ray
        cluster_gpus = float(ray.cluster_resources().get("GPU", 0.0))
        spec = self.spec
        self.resources, settings = replica_resources(spec.settings, spec.model, spec.tokenizer,
                                                     cluster_gpus)
        from llmlab.engine.builder import EngineBuilder

        cfg = EngineBuilder.from_settings(spec.model, spec.tokenizer, **settings).config
        self._timeout_s = cfg.distributed_timeout_s
        # Ray sets the actor's CUDA_VISIBLE_DEVICES; the front end's plan does not apply.
        actor_spec = attrs.evolve(spec, settings=settings, cuda_visible_devices=None)
        _warn_if_unfit(ray, self.index, self.resources, self._timeout_s)
        self.node_ip = ray.util.get_node_ip_address()
        server = socket.create_server((self.node_ip, 0))
        self._server = server
        self._authkey = secrets.token_bytes(32)
        self._sentinel_r, self._sentinel_w = os.pipe()
        try:
            actor_class = ray.remote(_ReplicaActor)
            self.actor = actor_class.options(
                num_cpus=self.resources["CPU"], num_gpus=self.resources["GPU"],
                max_restarts=0, max_concurrency=2,
            ).remote()
            self.ref = self.actor.run.remote(actor_spec, server.getsockname()[:2],
                                             self._authkey)
        except BaseException:
            self._close_server()
            raise
        self._deadline = time.monotonic() + self._timeout_s
        # Called by Ray (in a thread of its own) once the task ends: no polling, and no Ray
        # call from here that could start a new Ray instance after ray.shutdown().
        self._future = self.ref.future()
        self._future.add_done_callback(self._on_task_end)
        logger.info("replica %d: started a Ray actor (%s), waiting for it at %s:%d",
                    self.index, _describe_resources(self.resources), *server.getsockname()[:2])

    def _accept(self) -> Any:
        """Wait for the actor to connect and authenticate (a peer that fails is dropped)."""
        ray = self._ray
        while True:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"replica {self.index}: its Ray actor did not start within "
                    f"distributed_timeout_s={self._timeout_s:g} s (it asks for "
                    f"{_describe_resources(self.resources)}; the cluster has "
                    f"{ray.available_resources()} free of {ray.cluster_resources()})"
                )
            ready = multiprocessing.connection.wait([self._server, self._sentinel_r], left)
            if self._server in ready:
                conn = self._authenticate()
                if conn is not None:
                    return conn
            elif self._sentinel_r in ready:
                raise RuntimeError(
                    f"replica {self.index}: its Ray actor ended before it connected "
                    f"({self.describe_exit()})"
                )

    def _authenticate(self) -> Any | None:
        sock, peer = self._server.accept()
        sock.setblocking(True)
        conn = multiprocessing.connection.Connection(sock.detach())
        try:
            _set_recv_timeout(conn, _HANDSHAKE_S)  # a silent peer cannot hold us
            multiprocessing.connection.deliver_challenge(conn, self._authkey)
            multiprocessing.connection.answer_challenge(conn, self._authkey)
            self.pid = int(conn.recv_bytes(64))
            _set_recv_timeout(conn, 0)
        except (OSError, EOFError, ValueError, multiprocessing.AuthenticationError) as err:
            logger.warning("replica %d: dropped a connection from %s that did not "
                           "authenticate (%s: %s)", self.index, peer, type(err).__name__, err)
            conn.close()
            return None
        _set_nodelay(conn)
        return conn

    def _close_server(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

    # -- watching ----------------------------------------------------------------------

    def _on_task_end(self, future: Any) -> None:
        """The actor's ``run`` task ended: record how, and make ``sentinel`` ready."""
        with self._fd_lock:
            if self._exit_reason is None:
                self._exit_reason = _outcome(self._ray, future)
            self._ended.set()
            if self._sentinel_w is not None:
                try:
                    os.write(self._sentinel_w, b"\0")
                except OSError:
                    pass

    def is_alive(self) -> bool:
        return (self.ref is not None and not self._ended.is_set() and not self._stopped
                and self._ray.is_initialized())

    def describe_exit(self) -> str:
        """Why the actor ended (``"still running"`` while it runs)."""
        if self._exit_reason is not None:
            return self._exit_reason
        if self.ref is None:
            return "never started"
        if self._stopped:
            return "stopped by llmlab"
        return "still running" if self._ray.is_initialized() else "Ray was shut down"

    # -- commands and stopping ---------------------------------------------------------

    def send_bytes(self, payload: bytes) -> None:
        """Queue a command for the actor (written by a thread of its own, so a replica
        that stopped reading never blocks the front end)."""
        if self._writer is None:
            conn = self.connection
            if conn is None:
                raise OSError(f"replica {self.index} is not connected")
            self._writer = PipeWriter(conn, f"llmlab-dp-commands-{self.index}")
        self._writer.send(payload)

    def request_stop(self) -> None:
        if self._stop_requested or self._conn is None:
            return
        self._stop_requested = True
        try:
            self.send_bytes(pickle.dumps(Shutdown()))
        except OSError:
            pass  # already gone

    def stop(self, timeout: float) -> None:
        """Ask the loop to exit, wait up to ``timeout`` for it, then kill the actor (which
        frees its resources) and return once Ray says it is dead. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        ray = self._ray
        self._close_server()
        if self.ref is not None and ray.is_initialized():
            try:
                if not self._ended.is_set() and self._conn is not None:
                    self.request_stop()
                    concurrent.futures.wait([self._future], timeout=max(0.0, timeout))
                with self._fd_lock:
                    if not self._ended.is_set() and self._exit_reason is None:
                        if self._conn is None:
                            self._exit_reason = "killed by llmlab before it connected"
                        else:
                            logger.warning("replica %d (Ray actor, pid %s) did not stop in "
                                           "%.0f s; killing it", self.index, self.pid, timeout)
                            self._exit_reason = "killed by llmlab: it did not stop in time"
                ray.kill(self.actor, no_restart=True)
                _await_death(ray, self.actor, _KILL_WAIT_S)
            except Exception:  # noqa: BLE001 - already dead, or the cluster is gone
                logger.debug("stopping the actor of replica %d", self.index, exc_info=True)
        if self._writer is not None:  # the actor is gone: a pending write fails at once
            self._writer.close(1.0)
        if self._conn is not None:
            self._conn.close()
        # The sentinel's read end stays open (the front end may still hold its number);
        # the write end is closed under the lock the callback writes under.
        with self._fd_lock:
            self._ended.set()
            if self._sentinel_w is not None:
                os.close(self._sentinel_w)
                self._sentinel_w = None

    def __del__(self) -> None:
        for fd in (self._sentinel_r, self._sentinel_w):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass


def _outcome(ray, future: Any) -> str:
    """How the actor's finished ``run`` task ended, in words."""
    err = future.exception()
    if err is None:
        return "its loop returned"
    if isinstance(err, ray.exceptions.RayActorError):
        return f"Ray actor died: {_death_reason(err)}"
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None) or err
        return f"Ray actor failed: {type(cause).__name__}: {cause}"
    return f"Ray error: {type(err).__name__}: {err}"


def _await_death(ray, actor: Any, timeout_s: float) -> None:
    """Return once Ray says ``actor`` (just killed) is dead: ``ray.kill`` only sends the
    kill, and an actor whose ``run`` already returned may still answer for a moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            break
        time.sleep(0.01)
    logger.warning("Ray has not confirmed that the killed actor %s is dead after %g s", actor,
                   timeout_s)


def _warn_if_unfit(ray, index: int, resources: dict[str, float], timeout_s: float) -> None:
    """Say so when the cluster, as it is now, has too little for one replica (an
    autoscaling cluster may still add nodes: the start waits up to its timeout)."""
    total = ray.cluster_resources()
    short = {k: v for k, v in resources.items() if v and total.get(k, 0.0) < v}
    if short:
        logger.warning(
            "replica %d asks Ray for %s, but the cluster has only %s in all; waiting up to "
            "distributed_timeout_s=%g s for it", index, _describe_resources(resources),
            {k: total.get(k, 0.0) for k in short}, timeout_s,
        )


def _describe_resources(resources: dict[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items() if amount)
