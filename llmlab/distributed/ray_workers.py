"""Tensor-parallel ranks 1..N-1 as Ray actors (``distributed_executor_backend="ray"``).

:func:`start_ray_workers` is :func:`~llmlab.distributed.tp_executor.start_workers`'s
launcher for Ray: it joins the Ray cluster there is (``ray.init()``'s rules: an already
initialised Ray, ``RAY_ADDRESS``, the latest cluster started on this machine) or starts a
local instance, reserves the ranks' resources in one placement group (``PACK``: one node
when the ranks fit on one, else spread), and starts one actor per rank whose long-running
task is :func:`~llmlab.distributed.tp_worker.worker_main`. Rank 0 stays the engine's own
process; the actors meet it at its ``TCPStore``, at an address of rank 0's node that other
nodes can reach (never loopback). Each :class:`RayWorker` answers the questions the
executor asks of a worker process (alive? why did it stop? stop it), so failures are
reported and handled exactly as with the ``"mp"`` backend.

Actors fate-share with the process that created them: if the engine's process dies, Ray
ends its actors (what the ``"mp"`` workers' parent watch does for processes).

Resources: each rank asks for the CPUs it computes with (``cpu_threads``, or its share of
rank 0's machine) on CPU, or one GPU (and one CPU) on CUDA. When the engine runs in a Ray
driver on a node of the cluster, the group also reserves rank 0's share on that node, so
that Ray neither gives rank 0's GPU to a worker nor over-commits its CPUs.

CUDA: Ray sets ``CUDA_VISIBLE_DEVICES`` per actor, so a worker sees only its own GPU and
runs on ``cuda:0`` (``worker_main(..., cuda_index=0)``), not ``cuda:<rank>`` as a worker
process on one machine does. Rank 0 is not an actor: it uses its process's ``cuda:0``,
which Ray does not track; should Ray give that very GPU to a worker on rank 0's node, the
worker takes the GPU reserved for rank 0 instead (:func:`_cuda_devices`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import attrs

logger = logging.getLogger(__name__)

_INSTALL_HINT = 'distributed_executor_backend="ray" needs Ray: pip install "llmlab[ray]"'
# How long to wait for a placement group before saying what it waits for (it then keeps
# waiting, up to distributed_timeout_s: an autoscaling cluster may still add nodes).
_RESERVE_WARN_S = 10.0
# A killed actor's pending task fails once Ray notices the death (milliseconds locally).
_KILL_WAIT_S = 5.0


def _import_ray():
    try:
        import ray
    except ImportError as err:
        raise ImportError(_INSTALL_HINT) from err
    return ray


def _connect(ray) -> None:
    """Use the Ray the process is connected to; else ``ray.init()``, which joins an
    existing cluster (``RAY_ADDRESS``, or the latest one started on this machine) or
    starts a local instance."""
    if ray.is_initialized():
        return
    # No dashboard: nothing here uses it, and it is the slowest part of a local start.
    ray.init(include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)


class _RankActor:
    """One tensor-parallel rank (wrapped with ``ray.remote`` by :func:`start_ray_workers`)."""

    def placement(self) -> tuple[str, list[str]]:
        """``(node id, GPU ids)`` Ray gave this actor."""
        import ray

        context = ray.get_runtime_context()
        gpus = context.get_accelerator_ids().get("GPU", [])
        return context.get_node_id(), [str(gpu) for gpu in gpus]

    def run(self, rank: int, size: int, host: str, port: int, plan: Any,
            cuda_visible: str | None) -> None:
        """Be rank ``rank`` until rank 0 says stop (:func:`worker_main`)."""
        from llmlab.distributed.tp_worker import worker_main

        if cuda_visible is not None:
            # Before CUDA starts in this process, so that it sees just this GPU, as cuda:0.
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible
        # parent_pid=None: Ray ends the actor when its owner (the engine's process) dies.
        worker_main(rank, size, host, port, plan, parent_pid=None, cuda_index=0)


def _bundle_gpus() -> list[str]:
    """The GPU ids of the placement-group bundle this task runs in."""
    import ray

    return [str(gpu) for gpu in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


class _Reservation:
    """The placement group of one engine's actors: removed when its last worker is killed."""

    def __init__(self, ray, group: Any, holders: int) -> None:
        self._ray = ray
        self.group = group
        self._holders = holders
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self.remove()

    def remove(self) -> None:
        if not self._ray.is_initialized():
            return  # Ray is shut down: the group went with it
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.group)
        except Exception:  # noqa: BLE001 - already removed, or the cluster is gone
            logger.debug("could not remove placement group %s", self.group.id, exc_info=True)


@attrs.define(eq=False)
class RayWorker:
    """A worker rank in a Ray actor: the interface of
    :class:`~llmlab.distributed.tp_executor.ProcessWorker`.

    Attributes:
        rank: the tensor-parallel rank (1 .. size - 1).
        actor: the Ray actor handle.
        ref: the ObjectRef of the actor's long-running ``run`` task (it resolves when the
            rank leaves, or fails when the actor dies).
        host: the address of rank 0's store the rank was given.
    """

    rank: int
    actor: Any
    ref: Any
    host: str
    _reservation: _Reservation = attrs.field(repr=False)
    _ray: Any = attrs.field(repr=False)
    _killed: bool = attrs.field(default=False, repr=False)

    @property
    def placement_group(self) -> Any:
        """The Ray placement group of the engine's workers (removed with the last one)."""
        return self._reservation.group

    def is_alive(self) -> bool:
        if self._killed or not self._ray.is_initialized():
            return False
        ready, _ = self._ray.wait([self.ref], timeout=0)
        return not ready

    def describe_exit(self) -> str:
        ray = self._ray
        if not ray.is_initialized():
            return "Ray was shut down"
        ready, _ = ray.wait([self.ref], timeout=0)
        if not ready:
            return "killed by llmlab" if self._killed else "still running"
        try:
            ray.get(self.ref, timeout=0)
        except ray.exceptions.RayActorError as err:
            return f"Ray actor died: {_death_reason(err)}"
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None) or err
            return f"Ray actor failed: {type(cause).__name__}: {cause}"
        except Exception as err:  # noqa: BLE001 - any other Ray error, as it is
            return f"Ray error: {type(err).__name__}: {err}"
        return "left the group"

    def join(self, timeout: float) -> None:
        if self._ray.is_initialized():
            self._ray.wait([self.ref], timeout=max(0.0, timeout))

    def kill(self) -> None:
        """End the actor (whatever it is doing) and, with the engine's last worker, remove
        the placement group. Safe to call twice."""
        if self._killed:
            return
        self._killed = True
        ray = self._ray
        try:
            if ray.is_initialized():
                ray.kill(self.actor, no_restart=True)
                # Return once the actor is gone, as ProcessWorker.kill joins its process.
                ray.wait([self.ref], timeout=_KILL_WAIT_S)
        except Exception:  # noqa: BLE001 - already dead, or the cluster is gone
            logger.debug("killing the actor of rank %d", self.rank, exc_info=True)
        finally:
            self._reservation.release()


def _death_reason(err: Exception) -> str:
    """One line from a ``RayActorError``: why the actor died, and its pid and node."""
    message = getattr(err, "error_msg", None) or str(err)
    base = getattr(err, "BASE_ERROR_MSG", None)
    details = {}
    reasons = []
    for line in message.splitlines():
        if line.startswith("\t") and ":" in line:
            key, _, value = line.strip().partition(":")
            details[key] = value.strip()
        elif line.strip() and line.strip() != base:
            reasons.append(line.strip())
    reason = " ".join(reasons) or (base or "no reason given")
    where = [f"pid {details['pid']}"] if "pid" in details else []
    if "ip" in details:
        where.append(f"on {details['ip']}")
    return f"{reason} ({' '.join(where)})" if where else reason


def _rank_resources(plan: Any) -> dict[str, float]:
    """What one rank asks Ray for."""
    if plan.device.type == "cuda":
        return {"CPU": 1.0, "GPU": 1.0}
    from llmlab.runner.build import rank_threads

    return {"CPU": float(rank_threads(plan.config) or 1)}


def _reserves_rank0(ray, host: str) -> bool:
    """Whether rank 0's share belongs in the placement group: when this process is a Ray
    driver on a node of the cluster. A task or actor already holds its own resources, and a
    client off the cluster holds none of it."""
    mode = getattr(getattr(ray.get_runtime_context(), "worker", None), "mode", None)
    return mode == ray.SCRIPT_MODE and f"node:{host}" in ray.cluster_resources()


def _await_reservation(ray, group: Any, bundles: list[dict], timeout_s: float) -> None:
    """Wait until the placement group is reserved; ``TimeoutError`` after ``timeout_s``."""
    needed: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            if not key.startswith("node:"):
                needed[key] = needed.get(key, 0.0) + amount
    start = time.monotonic()
    warned = False
    while True:
        waited = time.monotonic() - start
        step = timeout_s - waited if warned else min(_RESERVE_WARN_S, timeout_s) - waited
        ready, _ = ray.wait([group.ready()], timeout=max(0.0, step))
        if ready:
            return
        if time.monotonic() - start >= timeout_s:
            raise TimeoutError(
                f"Ray could not reserve the tensor-parallel ranks' resources ({needed}, "
                f"{len(bundles)} bundles) within distributed_timeout_s={timeout_s:g} s; the "
                f"cluster has {ray.available_resources()} free of {ray.cluster_resources()}"
            )
        if not warned:
            warned = True
            logger.warning(
                "waiting for Ray to reserve %s for the tensor-parallel ranks (the cluster "
                "has %s free); giving up after distributed_timeout_s=%g s",
                needed, ray.available_resources(), timeout_s,
            )


def _driver_gpu() -> str:
    """The id (as Ray names GPUs) of the GPU rank 0 computes on: its process's cuda:0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[0].strip() if visible else "0"


def _cuda_devices(placements: list[tuple[str, list[str]]], rank0: tuple[str, str] | None,
                  spare: Callable[[], str]) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` of each worker actor.

    Args:
        placements: ``(node id, GPU ids)`` of the actors of ranks 1.. in order.
        rank0: ``(node id, GPU id)`` of rank 0 when its GPU is reserved in the placement
            group (None otherwise: Ray then already keeps workers off the caller's GPU).
        spare: returns the GPU Ray reserved for rank 0. A worker Ray put on rank 0's own
            GPU takes that one instead (Ray does not know which GPU rank 0's process uses,
            so the two need not agree); at most one worker can be in that case.
    """
    devices = []
    for rank, (node, gpus) in enumerate(placements, start=1):
        if not gpus:
            raise RuntimeError(f"Ray gave the actor of tensor-parallel rank {rank} no GPU")
        gpu = gpus[0]
        if rank0 is not None and (node, gpu) == rank0:
            gpu = spare()
        devices.append(gpu)
    return devices


def _assign_gpus(ray, actors: list, group: Any, reserves_rank0: bool,
                 timeout_s: float) -> list[str]:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    deadline = time.monotonic() + timeout_s
    placements = []
    for rank, actor in enumerate(actors, start=1):
        try:
            placements.append(ray.get(
                actor.placement.remote(), timeout=max(0.0, deadline - time.monotonic())
            ))
        except ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(
                f"the Ray actor of tensor-parallel rank {rank} did not start within "
                f"distributed_timeout_s={timeout_s:g} s"
            ) from err
        except ray.exceptions.RayActorError as err:
            raise RuntimeError(
                f"tensor-parallel worker rank {rank} died while starting "
                f"(Ray actor died: {_death_reason(err)})"
            ) from err
    rank0 = None
    if reserves_rank0:
        rank0 = (ray.get_runtime_context().get_node_id(), _driver_gpu())

    def spare() -> str:
        probe = ray.remote(_bundle_gpus).options(
            num_cpus=0, num_gpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0
            ),
        )
        return ray.get(probe.remote(), timeout=max(1.0, deadline - time.monotonic()))[0]

    return _cuda_devices(placements, rank0, spare)


def start_ray_workers(size: int, port: int, plan: Any) -> list[RayWorker]:
    """Start tensor-parallel ranks 1..``size``-1 of ``plan`` as Ray actors that meet rank 0
    at its ``TCPStore`` on ``port`` (of this node's address).

    Returns one :class:`RayWorker` per rank, in rank order; the caller waits for them to
    check in. Raises ``ImportError`` when Ray is not installed, ``TimeoutError`` when the
    cluster cannot hold the ranks within ``distributed_timeout_s``, and ``RuntimeError``
    naming the rank when an actor dies before its rank starts; nothing is left reserved
    or running then.
    """
    ray = _import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    _connect(ray)
    timeout_s = plan.config.distributed_timeout_s
    cuda = plan.device.type == "cuda"
    # The workers connect to rank 0's store: an address other nodes reach, not loopback.
    host = ray.util.get_node_ip_address()
    share = _rank_resources(plan)
    reserves_rank0 = _reserves_rank0(ray, host)
    bundles = [dict(share) for _ in range(1, size)]
    if reserves_rank0:
        # Pinned to this node by its node resource (every node has 1 of "node:<ip>").
        bundles.insert(0, {**share, f"node:{host}": 0.001})
    first_bundle = 1 if reserves_rank0 else 0
    group = placement_group(
        bundles, strategy="PACK", name=f"llmlab-tp-{uuid.uuid4().hex[:8]}"
    )
    reservation = _Reservation(ray, group, size - 1)
    actors: list = []
    try:
        _await_reservation(ray, group, bundles, timeout_s)
        actor_class = ray.remote(_RankActor)
        for rank in range(1, size):
            actors.append(actor_class.options(
                num_cpus=share["CPU"], num_gpus=share.get("GPU", 0.0), max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=first_bundle + rank - 1
                ),
            ).remote())
        visible: list[str | None] = [None] * len(actors)
        if cuda:
            visible = _assign_gpus(ray, actors, group, reserves_rank0, timeout_s)
        plan_ref = ray.put(plan)  # one copy in the object store for every rank
        refs = [
            actor.run.remote(rank, size, host, port, plan_ref, devices)
            for rank, actor, devices in zip(range(1, size), actors, visible, strict=True)
        ]
    except BaseException:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        reservation.remove()
        raise
    logger.info(
        "started tensor-parallel ranks 1..%d as Ray actors (placement group %s); rank 0 "
        "at %s:%d", size - 1, group.id.hex(), host, port,
    )
    return [
        RayWorker(rank, actor, ref, host, reservation, ray)
        for rank, actor, ref in zip(range(1, size), actors, refs, strict=True)
    ]
