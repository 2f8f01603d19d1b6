"""Data parallelism: N whole engine replicas in N processes behind one routing front end.

    llm = LLM(model, data_parallel_size=2, router="prefix_aware")
    llm.generate(prompts)                    # outputs in prompt order, as ever

    llmlab serve MODEL --data-parallel-size 2 --router least_loaded

:class:`DataParallelEngine` is an :class:`~llmlab.engine.client.EngineClient`, as
:class:`~llmlab.engine.engine.Engine` is (``tests/engine/test_engine_client.py`` keeps
their surfaces equal), so ``LLM``, ``AsyncEngine`` and the server drive it unchanged. It
loads only the tokenizer: every request is checked and tokenized here, at the edge (a
rejected request never reaches a replica), then a
:class:`~llmlab.routing.policy.RoutingPolicy` picks a live replica for it (a request with
``n > 1`` goes whole to one replica) and it is sent there.

Each replica (:mod:`llmlab.distributed.replica_process`) builds a full engine and runs on
its own, not in lock-step with the others; ``step()`` waits briefly for whatever the
replicas have reported and returns those outputs. The router sees each replica through a
:class:`RemoteReplica`: queue lengths from its latest ``StepEvent`` plus requests sent
but not yet reported, outstanding tokens followed from its events (as
:class:`~llmlab.routing.replica.EngineReplica` does in-process), and
``cached_prefix_tokens`` from a shadow of its prefix index (``{block id: chained hash}``,
fed by each step's cached blocks and evictions).

Observers: ``subscribe(observer)`` hears every replica's ``StepEvent`` (their
``step_index``, clocks and block ids are each replica's own);
``subscribe(observer, replica=True)`` is called as ``observer(replica_index, event)``.
The members that read an engine's state ask each replica, which answers between two of its
steps (:mod:`llmlab.distributed.replica_queries`): ``snapshot()`` and ``observe()`` give
one snapshot per replica, ``kv_cache`` one read-only view per replica, and
``record(path)`` has each replica's engine record its own run to a file of its own.

Failures: a replica that dies (killed, crashed) is noticed by the next ``step()`` (its
process sentinel, or EOF on its connection). Every request in flight there ends: its
final output has ``finish_reason="abort"`` and ``step()`` raises a
:class:`ReplicaFailedError` naming the replica and its exit status, one per request (as
``Engine.step`` raises ``RequestFailedError``: ``AsyncEngine`` ends that stream with it).
Requests are not retried elsewhere (one may have produced output already). New requests
go to the live replicas only; with none left the engine is dead (:class:`ReplicasDeadError`).
:meth:`DataParallelEngine.health` reports each replica.

Hung replicas (:mod:`llmlab.distributed.liveness`): a replica sends a heartbeat from a
thread of its own, idle or busy. One that sends nothing for ``replica_heartbeat_timeout_s``
(stopped, starved), or whose loop has been in one step for ``replica_wedged_after_s``, is
*unresponsive*, noticed by a thread of the front end's own whether or not anything steps:
:meth:`~DataParallelEngine.health` says so (naming it and how long it has been silent),
routers no longer see it, and its requests leave it at once. Those that have produced no
output yet are routed again, to a replica that answers; those that have fail with a
:class:`ReplicaFailedError` naming it. It is told to abort them all (it reads that when it
runs again), and whatever it still reports about them is ignored. When its heartbeats
come back it is responsive again and takes new requests. While no replica answers,
new requests are refused (:class:`ReplicasUnavailableError`). The front end never waits on
a replica: commands go out through a writer thread per replica and reports are read only
as whole messages (:mod:`llmlab.distributed.replica_handle`).

Shutdown: :meth:`DataParallelEngine.shutdown` (also on garbage collection and at
interpreter exit) asks every replica to stop, then terminates and kills what is left,
and its process group with it. A replica exits by itself when the front end dies.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import logging
import multiprocessing.connection
import os
import pathlib
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import attrs

from llmlab import registry
from llmlab.distributed.liveness import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_WEDGED_AFTER_S,
    Liveness,
    Monitor,
    heartbeat_interval,
)
from llmlab.distributed.remote_replica import PromptHashes, RemoteReplica
from llmlab.distributed.replica_handle import (
    MessageReader,
    ProcessReplicaHandle,
    ReplicaHandle,
    describe_exit,
    plan_devices,
    stop_replicas,
    wait_ready,
)
from llmlab.distributed.replica_process import (
    AbortRequests,
    AddRequest,
    Heartbeat,
    Query,
    QueryReply,
    ReplicaInfo,
    ReplicaSpec,
    StepReport,
)
from llmlab.distributed.replica_queries import (
    PendingQuery,
    ReplicaKVCache,
    ReplicaRecordings,
    SnapshotObserver,
    replica_path,
)
from llmlab.engine.builder import EngineBuilder
from llmlab.runner.build import resolve_device
from llmlab.observe.events import EngineSnapshot, StepEvent, StepObserver, notify
from llmlab.engine.inputs import InputProcessor, PreparedRequest, PromptType
from llmlab.engine.outputs import CompletionOutput, RequestOutput
from llmlab.errors import ComponentError, RequestFailedError, component_name
from llmlab.routing.policy import check_choice
from llmlab.sampling.params import SamplingParams
from llmlab.threads import ENV_THREADS, available_cpus
from llmlab.validation import as_real, as_request_ids

logger = logging.getLogger(__name__)

__all__ = [
    "DataParallelEngine",
    "RemoteReplica",
    "ReplicaFailedError",
    "ReplicaStatus",
    "ReplicasDeadError",
    "ReplicasUnavailableError",
    "check_data_parallel_settings",
    "resolve_router",
]

DEFAULT_ROUTER = "round_robin"


class ReplicaFailedError(RequestFailedError):
    """A request ended because its replica died or failed; the message names the replica.

    Attributes:
        replica: the replica's index.
    """

    def __init__(self, request_id: str, reason: str, replica: int) -> None:
        super().__init__(request_id, reason)
        self.replica = replica


class ReplicasDeadError(RuntimeError):
    """Every replica is dead: the data-parallel engine cannot take requests."""


class ReplicasUnavailableError(ReplicasDeadError):
    """No replica answers now (each is dead or unresponsive): a request cannot be placed.
    It may pass: a replica whose heartbeats come back takes requests again."""


@attrs.frozen
class ReplicaStatus:
    """One replica's health (:meth:`DataParallelEngine.health`).

    Attributes:
        index: the replica's index.
        status: ``"ok"``, ``"unresponsive"`` (it runs but does not answer: no heartbeat
            within ``replica_heartbeat_timeout_s``, or a wedged step; it may come back)
            or ``"dead"``.
        pid / exit_code: its process, and how it ended (None while it runs).
        reason: why it is not ok (None when ok), naming the replica.
        num_requests: requests in flight there.
    """

    index: int
    status: str
    pid: int | None
    exit_code: int | None = None
    reason: str | None = None
    num_requests: int = 0

    def to_json(self) -> dict:
        body: dict[str, Any] = {"index": self.index, "status": self.status}
        if self.reason is not None:
            body["reason"] = self.reason
        return body


class _Route(NamedTuple):
    """What a router sees of a request (:class:`~llmlab.routing.policy.RouteRequest`)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    user: str | None
    session: str | None


@attrs.define
class _InFlight:
    """A request sent to a replica, until its final output (or failure)."""

    replica: int
    position: int  # its replica's index in the list the router saw (for on_finish)
    command: int  # the replica's command count once it has this request (1-based)
    prompt: str | None
    prompt_token_ids: list[int]
    member_ids: tuple[str, ...]  # the engine's ids of its samples (itself when n == 1)
    n: int
    payload: bytes  # its AddRequest, pickled: sent again if it must move
    route: _Route  # what the router saw of it
    started: bool = False  # an output of it has come back (it can no longer move)


def resolve_router(router: Any, config: Any = None) -> Any:
    """A router instance from ``router``: None (``"round_robin"``), a registered name,
    ``"module:Class"`` or a class, with ``config`` (``router_config``) as its keyword
    arguments, or an instance: :func:`llmlab.registry.build` (``ValueError`` listing the
    names; ``TypeError`` naming a keyword it does not take, or a missing method)."""
    if router is None and not config:
        router = DEFAULT_ROUTER
    return registry.build("router", router, config)


def check_data_parallel_settings(router: Any = None,
                                 replica_heartbeat_timeout_s: float | None = None,
                                 replica_wedged_after_s: float | None = None,
                                 router_config: Any = None) -> None:
    """Check the data-parallel settings of an engine that has one replica, where they are
    unused: a typo in a router's name or config, or a bad deadline, still fails
    (``ValueError`` / ``TypeError`` naming it), as it would with ``data_parallel_size > 1``."""
    _deadlines(replica_heartbeat_timeout_s, replica_wedged_after_s)
    if router is not None or router_config:
        resolve_router(router, router_config)


def _deadlines(heartbeat_timeout_s: float | None, wedged_after_s: float | None) -> dict:
    """The replica deadlines, checked (None: the default)."""
    return {
        "replica_heartbeat_timeout_s": as_real(
            "replica_heartbeat_timeout_s",
            DEFAULT_HEARTBEAT_TIMEOUT_S if heartbeat_timeout_s is None else heartbeat_timeout_s,
            min=0, min_inclusive=False),
        "replica_wedged_after_s": as_real(
            "replica_wedged_after_s",
            DEFAULT_WEDGED_AFTER_S if wedged_after_s is None else wedged_after_s,
            min=0, min_inclusive=False),
    }


def _refuse_pooling(cfg: Any) -> None:
    """A pooling engine (``runner="pooling"``, vLLM's ``task=``, or ``"auto"`` on a
    classifier checkpoint) behind data parallelism: refused before any replica starts.
    The front end routes and reports generation only (its outputs, its replica views)."""
    runner = cfg.runner_type
    if runner == "auto":
        from transformers import AutoConfig

        from llmlab.runner.pooling_setup import pooling_spec
        from llmlab.models.loader import resolve_model_path

        path = resolve_model_path(cfg.model, cfg.revision, cache_dir=cfg.download_dir)
        if pooling_spec(cfg, AutoConfig.from_pretrained(path), str(path)) is not None:
            runner = "pooling"
    if runner == "pooling" and cfg.data_parallel_size == 1:
        raise ValueError("runner='pooling' (a pooling model) is not supported with "
                         "engine_core_process=True: use False")
    if runner == "pooling":
        raise ValueError(
            f"runner='pooling' (a pooling model) is not supported with data_parallel_size="
            f"{cfg.data_parallel_size}: serve it with data_parallel_size=1, or run one "
            "pooling server per device behind your own load balancer"
        )


# Engines whose replicas still run, stopped at interpreter exit (before multiprocessing's
# own exit handler, registered earlier, would wait for the non-daemonic replicas forever).
_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()
_ATEXIT_REGISTERED = False


def _shutdown_live_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        engine.shutdown()


def _finalize(monitor: Monitor, handles: list, timeout: float, fds: tuple[int, int]) -> None:
    monitor.stop()
    stop_replicas(handles, timeout, fds)


class DataParallelEngine:
    """N engine replicas in N processes behind one front end (see the module docstring).

    Build one with :meth:`from_settings` (or ``LLM(..., data_parallel_size=N)``,
    :func:`build_engine`). Attributes: ``config`` (replica 0's, with
    ``data_parallel_size=N``), ``tokenizer``, ``vocab_size``, ``max_model_len``,
    ``eos_token_ids``, ``default_sampling_params``, ``max_logprobs``, ``inputs`` (the
    :class:`~llmlab.engine.inputs.InputProcessor` every request passes here), ``router``,
    ``replicas`` (a :class:`RemoteReplica` each).

    ``step_timeout_s``: how long ``step()`` waits for a replica's report when none is
    ready (``wake()`` ends the wait early: ``AsyncEngine`` calls it on new work).
    ``heartbeat_timeout_s`` / ``wedged_after_s``: a replica silent for longer, or whose
    step has run for longer, is unresponsive (the module docstring); its heartbeats must
    come every :func:`~llmlab.distributed.liveness.heartbeat_interval` of the first.
    """

    def __init__(
        self,
        handles: Sequence[ReplicaHandle],
        infos: Sequence[ReplicaInfo],
        router: Any,
        tokenizer: Any | None,
        *,
        step_timeout_s: float = 0.05,
        stop_timeout_s: float = 10.0,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        wedged_after_s: float = DEFAULT_WEDGED_AFTER_S,
    ) -> None:
        first = infos[0]
        self.num_replicas = len(handles)
        self.config = attrs.evolve(first.config, data_parallel_size=self.num_replicas)
        self.tokenizer = tokenizer
        self.vocab_size = first.vocab_size
        self.max_model_len = min(i.max_model_len for i in infos)
        self.eos_token_ids = first.eos_token_ids
        self.default_sampling_params: SamplingParams = first.default_sampling_params
        self.max_logprobs = first.max_logprobs
        self.clock: Callable[[], float] = time.monotonic  # the replicas' clock too
        self.grammars = None
        if tokenizer is not None:
            from llmlab.sampling.metadata import GrammarFactory

            self.grammars = GrammarFactory(tokenizer, self.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(
            tokenizer, self.vocab_size, self.max_model_len, self.eos_token_ids,
            min(i.max_num_seqs for i in infos), first.block_size,
            min(i.num_kv_blocks for i in infos), self.max_logprobs, self.grammars,
            kv_press=self.config.kv_press is not None,
        )
        self.router = router
        self.step_timeout_s = step_timeout_s
        deadlines = _deadlines(heartbeat_timeout_s, wedged_after_s)
        self.heartbeat_timeout_s = deadlines["replica_heartbeat_timeout_s"]
        self.wedged_after_s = deadlines["replica_wedged_after_s"]
        self._prompt_hashes = PromptHashes()
        now = self.clock()
        self.replicas = [
            RemoteReplica(i, h, info, self._prompt_hashes,
                          Liveness(self.heartbeat_timeout_s, self.wedged_after_s, now))
            for i, (h, info) in enumerate(zip(handles, infos, strict=True))
        ]
        self._readers = [MessageReader(h.connection) for h in handles]
        self._last_read = now  # when step() or the monitor last read every replica
        self.observers: list[StepObserver] = []
        self.replica_observers: list[Callable[[int, StepEvent], None]] = []
        self._requests: dict[str, _InFlight] = {}
        self._undelivered: list[RequestOutput] = []
        self._failures: collections.deque[RequestFailedError] = collections.deque()
        # Questions sent to replicas (snapshot, kv_cache, record), by query id, until the
        # answer is read (replica_queries).
        self._queries: dict[int, PendingQuery] = {}
        self._query_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._closed = False
        # A pipe whose read end step() also waits on: wake() ends the wait at once.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._beat_s = heartbeat_interval(self.heartbeat_timeout_s)
        self._monitor = Monitor(self, DataParallelEngine._check_replicas, self._beat_s)
        self._finalizer = weakref.finalize(
            self, _finalize, self._monitor, list(handles), stop_timeout_s,
            (self._wake_r, self._wake_w),
        )
        global _ATEXIT_REGISTERED
        _LIVE_ENGINES.add(self)
        if not _ATEXIT_REGISTERED:
            atexit.register(_shutdown_live_engines)
            _ATEXIT_REGISTERED = True

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_settings(
        cls,
        model: str,
        tokenizer: str | None = None,
        *,
        router: Any = None,
        router_config: Any = None,
        step_timeout_s: float = 0.05,
        replica_heartbeat_timeout_s: float | None = None,
        replica_wedged_after_s: float | None = None,
        **settings: Any,
    ) -> DataParallelEngine:
        """Start ``data_parallel_size`` replicas, each built as ``LLM(model, tokenizer,
        **settings)`` would build one engine, and return their front end once all are
        ready (within ``distributed_timeout_s``). ``router`` / ``router_config``: the
        router (:func:`resolve_router`), which the front end keeps (replicas never route).

        ``replica_heartbeat_timeout_s`` (default 10): a replica that sends no heartbeat
        for this long is unresponsive (it beats every quarter of it, at most once a
        second). ``replica_wedged_after_s`` (default 60, as ``AsyncEngine``'s
        ``wedged_after_s``): so is one whose current step has run for this long; raise it
        where one step may legitimately take longer (a first step that compiles kernels).

        Settings are checked here first (``ValueError``/``TypeError`` naming the field).
        Components given as instances are pickled to each replica (each gets its own
        copy), so they must be picklable: one that is not is a ``ValueError`` naming it.
        On CUDA replica ``i`` gets devices ``i * tp`` to ``(i + 1) * tp - 1``
        (:func:`~llmlab.distributed.replica_handle.plan_devices`: replicas sharing a
        device split its ``gpu_memory_utilization`` and start in turn); on CPU each replica
        uses ``cpu_threads`` threads (unset: an equal share of the cores). Replica ``i``
        is seeded with ``seed + i``, so replicas do not draw the same random numbers.
        """
        cfg = EngineBuilder.from_settings(model, tokenizer, **settings).config
        deadlines = _deadlines(replica_heartbeat_timeout_s, replica_wedged_after_s)
        beat_s = heartbeat_interval(deadlines["replica_heartbeat_timeout_s"])
        _refuse_pooling(cfg)
        if cfg.enable_lora:
            from llmlab.lora.attach import check_lora_settings

            check_lora_settings(cfg, pooling=False, model_class=None)  # refuses DP
        n = cfg.data_parallel_size
        # The name and config the front end's config keeps (replicas never route).
        named = (router if isinstance(router, str) else None,
                 registry.config_dict("router", router_config))
        given_router = [("router", router)]
        registry.check_unclaimed(given_router)  # a router keeps its replicas' loads
        router = resolve_router(router, router_config)
        resolve_device(cfg.device)  # "cuda" without CUDA fails here, before any process
        _check_picklable(settings, n)
        from llmlab.models.loader import resolve_model_path

        # Once here (downloading if needed), so the replicas find it cached.
        model_path = resolve_model_path(cfg.model, cfg.revision, cache_dir=cfg.download_dir)
        on_ray = cfg.distributed_executor_backend == "ray"  # replicas as Ray actors
        plan = plan_devices(cfg.device, n, cfg.tensor_parallel_size,
                            cfg.gpu_memory_utilization, num_gpus=0 if on_ray else None)
        handle_class: Any = ProcessReplicaHandle
        if on_ray:  # Ray places each replica's GPUs (llmlab.distributed.ray_replicas)
            from llmlab.distributed.ray_replicas import RayReplicaHandle as handle_class
        threads = cfg.cpu_threads
        if (threads is None and plan.visible_devices[0] is None
                and not os.environ.get(ENV_THREADS) and not os.environ.get("OMP_NUM_THREADS")):
            threads = max(1, available_cpus() // n)  # n replicas share this machine's cores
        handles = []
        for i in range(n):
            own = dict(settings, data_parallel_size=1, engine_core_process=False,
                       cpu_threads=threads,
                       gpu_memory_utilization=plan.gpu_memory_utilization[i])
            if cfg.seed is not None:
                own["seed"] = cfg.seed + i
            if plan.visible_devices[i] is not None:
                own["device"] = "cuda"  # its own devices are the only ones it sees
            spec = ReplicaSpec(i, model, tokenizer, own, plan.visible_devices[i], os.getpid(),
                               heartbeat_interval_s=beat_s)
            handles.append(handle_class(spec))
        try:
            text_tokenizer = None
            ready: dict[int, ReplicaInfo] = {}
            for wave in range(max(plan.waves) + 1):  # replicas sharing a device: in turn
                group = [h for h, w in zip(handles, plan.waves, strict=True) if w == wave]
                for handle in group:
                    handle.start()
                if wave == 0 and not cfg.skip_tokenizer_init:  # while the replicas build
                    from llmlab.models.loader import load_tokenizer

                    text_tokenizer = load_tokenizer(
                        cfg.tokenizer or str(model_path),
                        cfg.tokenizer_revision or cfg.revision,
                        use_fast=cfg.tokenizer_mode != "slow", cache_dir=cfg.download_dir,
                    )
                infos = wait_ready(group, cfg.distributed_timeout_s)
                ready.update((h.index, info) for h, info in zip(group, infos, strict=True))
            infos = [ready[h.index] for h in handles]
        except BaseException:
            stop_replicas(handles, 5.0, ())
            raise
        engine = cls(handles, infos, router, text_tokenizer, step_timeout_s=step_timeout_s,
                     heartbeat_timeout_s=deadlines["replica_heartbeat_timeout_s"],
                     wedged_after_s=deadlines["replica_wedged_after_s"])
        registry.claim(given_router)
        engine.config = attrs.evolve(
            engine.config, device=cfg.device, cpu_threads=cfg.cpu_threads,
            gpu_memory_utilization=cfg.gpu_memory_utilization, router=named[0],
            router_config=named[1],
        )
        if cfg.kv_press is None and settings.get("kv_press") is not None:
            # A press instance: the replicas' configs hold names only, so say it here (a
            # request's kv_budget needs a press).
            engine.inputs = attrs.evolve(engine.inputs, kv_press=True)
        logger.info("data parallelism: %d replicas ready (pids %s), router %s", n,
                    [i.pid for i in infos], component_name(router))
        return engine

    # -- requests ------------------------------------------------------------------------

    def get_tokenizer(self) -> Any | None:
        return self.tokenizer

    def prepare_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
        client: Hashable = None,
    ) -> PreparedRequest:
        """Check and tokenize a request here, without sending it anywhere (as
        :meth:`Engine.prepare_request`); raises :class:`ReplicasDeadError` when no
        replica is alive (:class:`ReplicasUnavailableError` when none answers now).

        ``lora_request`` is checked here and travels with the request to its replica,
        whose engine runs it with that adapter; LoRA needs ``enable_lora``, which data
        parallelism does not support yet (replicas do not share adapters), so a
        :class:`~llmlab.lora.request.LoRARequest` is refused here (``ValueError``)."""
        if not self.is_alive:
            raise self._no_replica()
        return self.inputs.prepare(
            request_id, prompt, params, arrival_time, priority, user, self.clock(),
            lora_request=lora_request, client=client,
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
    ) -> None:
        """Check, route and send a request (:meth:`Engine.add_request`'s arguments and
        errors: on bad input nothing is sent; ``lora_request``: :meth:`prepare_request`)."""
        self.add_prepared_request(self.prepare_request(
            request_id, prompt, params, arrival_time, priority, user, lora_request=lora_request
        ))

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Route a request checked by :meth:`prepare_request` to a live replica that
        answers and send it. Raises ``ValueError`` when its id is in use or it cannot be
        pickled (a custom logits processor, say), :class:`ReplicasDeadError` when no
        replica lives (:class:`ReplicasUnavailableError` when none answers now)."""
        if not isinstance(prepared, PreparedRequest):
            raise TypeError(
                f"expected a PreparedRequest (from prepare_request), got {type(prepared).__name__}"
            )
        request_id = prepared.request_id
        # The compiled grammar stays here: the replica compiles it again from the params.
        try:
            payload = pickle.dumps(AddRequest(attrs.evolve(prepared, grammar=None)),
                                   protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - whatever pickling raises
            raise ValueError(
                f"request {request_id!r} cannot be sent to a replica process (data "
                f"parallelism pickles each request; custom logits_processors must be "
                f"picklable): {type(err).__name__}: {err}"
            ) from err
        params = prepared.params
        num = params.num_samples
        members = (request_id,) if num == 1 else tuple(f"{i}_{request_id}" for i in range(num))
        prompt_ids = prepared.prompt_token_ids
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
        route = _Route(request_id, tuple(prompt_ids), max_tokens, prepared.user, None)
        with self._lock:
            if self._closed:
                raise ReplicasDeadError("the data-parallel engine was shut down")
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            record = _InFlight(-1, -1, 0, prepared.prompt, list(prompt_ids), members,
                               params.n, payload, route)
            self._place(record)
            self._requests[request_id] = record

    def _place(self, record: _InFlight) -> None:
        """Route a request among the replicas that answer, send it to the one chosen and
        note where it went (in ``record`` and that replica's view). Raises
        :class:`ReplicasDeadError` (:class:`ReplicasUnavailableError` while some live
        replica does not answer) when none can take it."""
        request_id = record.route.request_id
        refused: set[int] = set()
        while True:
            candidates = [r for r in self.replicas
                          if r.is_responsive and r.replica_index not in refused]
            if not candidates:
                raise self._no_replica()
            position = self._route(record.route, candidates)
            replica = candidates[position]
            try:
                replica.handle.send_bytes(record.payload)
                break
            except (OSError, EOFError, ValueError):
                # It died just now (step() will say so): nothing reached it, so another
                # replica may take the request.
                refused.add(replica.replica_index)
        replica.commands_sent += 1
        replica.requests.add(request_id)
        replica.unreported.add(request_id)
        for i, member in enumerate(record.member_ids):
            replica.routed(member, len(record.prompt_token_ids) if i == 0 else 0,
                           record.route.max_tokens)
        record.replica, record.position = replica.replica_index, position
        record.command = replica.commands_sent

    def _route(self, request: _Route, live: list[RemoteReplica]) -> int:
        for position, replica in enumerate(live):
            replica.index = position  # a router sees positions in the list it is given
        try:
            answer = self.router.route(request, live)
        except Exception as err:
            raise ComponentError.wrap("router", self.router, "route", err) from err
        return check_choice(self.router, answer, len(live))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are; no output of theirs is returned after this.
        Unknown ids are ignored."""
        ids = as_request_ids(request_id)
        with self._lock:
            by_replica: dict[int, list[str]] = {}
            for rid in ids:
                record = self._requests.pop(rid, None)
                if record is None:
                    continue
                by_replica.setdefault(record.replica, []).append(rid)
                self._finished(rid, record)
            for index, rids in by_replica.items():
                replica = self.replicas[index]
                if not replica.is_live:
                    continue
                try:
                    replica.handle.send_bytes(pickle.dumps(AbortRequests(tuple(rids))))
                    replica.commands_sent += 1
                except (OSError, EOFError, ValueError):
                    pass  # it died: nothing of it is left to stop

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is in flight (so it cannot be reused yet)."""
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, outputs not yet returned, or commands a replica that
        answers has not answered yet (an abort's report, say)."""
        if self._requests or self._undelivered or self._failures:
            return True
        return any(r.commands_sent > r.commands_done for r in self.replicas
                   if r.is_responsive)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- observation ---------------------------------------------------------------------

    def subscribe(self, observer: Callable, *, replica: bool = False) -> Callable:
        """Call ``observer(event)`` for every replica's ``StepEvent`` (``step_index``,
        clocks and block ids are per replica), or with ``replica=True``
        ``observer(replica_index, event)``. Returns the observer; one that raises is
        logged and skipped."""
        (self.replica_observers if replica else self.observers).append(observer)
        return observer

    def unsubscribe(self, observer: Callable) -> None:
        """Stop calling ``observer`` (however it was attached: :meth:`subscribe`, with or
        without ``replica``, or :meth:`observe`); ``ValueError`` if it is not attached."""
        with self._lock:
            for attached in self.replica_observers:
                if attached == observer or (isinstance(attached, SnapshotObserver)
                                            and attached.observer == observer):
                    self.replica_observers.remove(attached)
                    return
            self.observers.remove(observer)

    def snapshot(self) -> tuple[EngineSnapshot | None, ...]:
        """Every replica's :class:`~llmlab.observe.events.EngineSnapshot` now, in replica
        order: each taken by the replica between two of its steps (block ids and
        ``step_index`` are that replica's own). None for a replica that is dead, or does
        not answer (unresponsive, or gone while asked)."""
        return tuple(self._answers(self._ask("snapshot"), "snapshot"))

    def observe(self, observer: StepObserver) -> tuple[EngineSnapshot | None, ...]:
        """Subscribe ``observer`` to every replica's events and return each replica's
        snapshot (:meth:`snapshot`), atomically per replica: it hears replica ``i``'s
        events from the moment snapshot ``i`` was taken, none from before, so applying
        them to it follows replica ``i`` exactly. A replica whose snapshot is None is
        not heard at all. :meth:`unsubscribe` detaches it."""
        attached = SnapshotObserver(observer)
        with self._lock:
            self.replica_observers.append(attached)
        try:
            return tuple(self._answers(self._ask("snapshot", on_answer=attached.start),
                                       "snapshot"))
        except BaseException:
            self.unsubscribe(observer)
            raise

    def record(self, path: str | os.PathLike) -> ReplicaRecordings:
        """Record every replica's run from now on, each by its own engine
        (:meth:`Engine.record <llmlab.engine.engine.Engine.record>`: the same JSON Lines)
        to a file of its own: ``run.jsonl`` -> ``run.replica0.jsonl``,
        ``run.replica1.jsonl``, ... (``.gz`` stays compressed). A relative path is taken
        from this process's working directory; Ray replicas on other nodes write theirs
        there. A replica that is dead or does not answer is not recorded (its path is
        None). Returns a :class:`~llmlab.distributed.replica_queries.ReplicaRecordings`:
        stop with ``close()`` or a ``with`` block; read each file with
        :func:`llmlab.viz.load`. Raises what a replica's ``record`` raised (a directory
        that does not exist, say), after stopping the recordings that did start."""
        if self._closed:
            raise ReplicasDeadError("the data-parallel engine was shut down")
        base = pathlib.Path(os.path.abspath(path))
        paths = {r.replica_index: replica_path(base, r.replica_index) for r in self.replicas}
        asked = self._ask("record", {i: str(p) for i, p in paths.items()})
        started = {q.replica: q.value for q in asked if q is not None and q.answered
                   and q.error is None}
        try:
            self._answers(asked, "record")
        except BaseException:
            self._stop_recordings(started)
            raise
        return ReplicaRecordings(
            self._stop_recordings,
            tuple(paths[i] if i in started else None for i in range(self.num_replicas)),
            started,
        )

    @property
    def kv_cache(self) -> tuple[ReplicaKVCache, ...]:
        """Each replica's KV cache manager as the front end can read it: a
        :class:`~llmlab.distributed.replica_queries.ReplicaKVCache` per replica, in
        replica order (its shape known here; its state asked of the replica when read)."""
        return tuple(
            ReplicaKVCache(functools.partial(self._read_kv_cache, r.replica_index),
                           r.replica_index, r.info)
            for r in self.replicas
        )

    def _read_kv_cache(self, index: int, name: str, args: tuple) -> Any:
        query = self._ask("kv_cache", {index: (name, args)})[index]
        if query is None or not query.answered:
            replica = self.replicas[index]
            why = (replica.dead_reason or replica.unresponsive or
                   ("the engine was shut down" if self._closed else "it did not answer"))
            raise RuntimeError(f"kv_cache[{index}].{name}: replica {index} cannot answer ({why})")
        return self._answers([query], f"kv_cache.{name}")[0]

    def _stop_recordings(self, recording_ids: dict[int, int]) -> list[int | None]:
        """Close recordings started by :meth:`record`; each one's step count (None: its
        replica did not answer)."""
        asked = self._ask("stop_recording", recording_ids)
        return [None if q is None or not q.answered or q.error is not None else q.value
                for q in asked]

    def _ask(self, kind: str, arguments: dict[int, Any] | None = None,
             on_answer: Callable[[int, Any], None] | None = None) -> list[PendingQuery | None]:
        """Ask the replicas a :class:`~llmlab.distributed.replica_process.Query` (those in
        ``arguments``, each with its own argument; else every replica, with none) and wait
        for the answers. One entry per replica: None for one not asked (not in
        ``arguments``, dead or unresponsive), else its :class:`PendingQuery`, unanswered
        if the replica died or stopped answering meanwhile. Reports read while waiting
        are applied as ``step()`` applies them (their outputs wait for the next step)."""
        asked: list[PendingQuery | None] = [None] * self.num_replicas
        with self._lock:
            if self._closed:
                return asked
            for replica in self.replicas:
                index = replica.replica_index
                if (arguments is not None and index not in arguments) or not replica.is_responsive:
                    continue
                query_id = next(self._query_ids)
                query = PendingQuery(index, on_answer)
                payload = pickle.dumps(Query(query_id, kind, (arguments or {}).get(index)))
                try:
                    replica.handle.send_bytes(payload)
                except (OSError, EOFError, ValueError):
                    continue  # it died just now (step() will say so)
                self._queries[query_id] = query
                replica.commands_sent += 1
                asked[index] = query
        try:
            self._await_answers(asked)
        finally:
            with self._lock:  # answers that come later are ignored
                for query_id in [i for i, q in self._queries.items() if q in asked]:
                    del self._queries[query_id]
        self.wake()  # a step() waiting for reports returns what was read here
        return asked

    def _await_answers(self, asked: list[PendingQuery | None]) -> None:
        """Read the asked replicas until each answered, died or stopped answering (the
        monitor thread judges that; another thread's step() may read an answer too)."""
        deadline = time.monotonic() + self.heartbeat_timeout_s + self.wedged_after_s
        while time.monotonic() < deadline:
            with self._lock:
                waiting = [self.replicas[q.replica] for q in asked
                           if q is not None and not q.answered]
                waiting = [r for r in waiting if r.is_responsive and not self._closed]
            if not waiting:
                return
            waitables: list[Any] = []
            for r in waiting:
                waitables.append(r.handle.connection)
                if r.handle.sentinel is not None:
                    waitables.append(r.handle.sentinel)
            # A short wait: another thread may take the bytes this one waits for.
            ready = multiprocessing.connection.wait(waitables, 0.05)
            with self._lock:
                for r in waiting:
                    handle = r.handle
                    if handle.connection in ready or (handle.sentinel is not None
                                                      and handle.sentinel in ready):
                        self._read(r)

    @staticmethod
    def _answers(asked: list[PendingQuery | None], what: str) -> list[Any]:
        """The answers' values (None where there is none); raises the first replica's
        error as a ``RuntimeError`` naming the replica."""
        for query in asked:
            if query is not None and query.error is not None:
                raise RuntimeError(f"replica {query.replica}: {what} failed: {query.error}")
        return [q.value if q is not None and q.answered else None for q in asked]

    def health(self) -> list[ReplicaStatus]:
        """Each replica's status now: ``"ok"``, ``"unresponsive"`` (with how long it has
        been silent, or its step has run) or ``"dead"`` (a replica whose process ended is
        dead even before a step has noticed)."""
        statuses = []
        with self._lock:
            now = self.clock()
            for r in self.replicas:
                handle = r.handle
                reason = r.dead_reason
                if reason is None and not handle.is_alive():
                    reason = self._death_reason(r)
                status = "ok" if reason is None else "dead"
                if reason is None and r.unresponsive is not None:
                    status, reason = "unresponsive", self._unresponsive_reason(r, now)
                statuses.append(ReplicaStatus(
                    r.replica_index, status, handle.pid, handle.exit_code, reason,
                    len(r.requests),
                ))
        return statuses

    @property
    def is_alive(self) -> bool:
        """Whether at least one replica can take requests now (False while none answers:
        it turns True again when one does)."""
        return not self._closed and any(r.is_responsive for r in self.replicas)

    def _no_replica(self) -> ReplicasDeadError:
        """The error for a request no replica can take now."""
        if not self._closed and any(r.is_live for r in self.replicas):
            return ReplicasUnavailableError(self.dead_reason())
        return ReplicasDeadError(self.dead_reason())

    def dead_reason(self) -> str:
        if self._closed:
            return "the data-parallel engine was shut down"
        statuses = self.health()
        reasons = [s.reason for s in statuses if s.reason is not None]
        if all(s.status == "dead" for s in statuses):
            return "every replica is dead: " + "; ".join(reasons)
        return "no replica answers (each is dead or unresponsive): " + "; ".join(reasons)

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas reported since the last call, waiting up to
        ``step_timeout_s`` when none has reported yet.

        A request that failed (its replica died or failed it) raises
        :class:`ReplicaFailedError`, one per call; its final output (``"abort"``) and the
        call's other outputs come with the next call.
        """
        if self._failures:
            raise self._failures.popleft()
        timeout = 0.0 if self._undelivered else self.step_timeout_s
        with self._lock:
            if self._closed:
                return []
            replicas = [r for r in self.replicas if r.dead_reason is None]
        waitables: list[Any] = [self._wake_r]
        for r in replicas:
            waitables.append(r.handle.connection)
            if r.handle.sentinel is not None:
                waitables.append(r.handle.sentinel)
        ready = set(multiprocessing.connection.wait(waitables, timeout))
        if self._wake_r in ready:
            self._drain_wakeups()
        with self._lock:
            for r in replicas:
                handle = r.handle
                if handle.connection in ready or handle.sentinel in ready:
                    self._read(r)
            self._last_read = self.clock()
            if self._failures:
                raise self._failures.popleft()
            outputs, self._undelivered = self._undelivered, []
        return outputs

    def wake(self) -> None:
        """End a ``step()`` that is waiting for reports (from any thread): new work came."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken, or closed

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _read(self, replica: RemoteReplica) -> None:
        """Apply every whole message the replica has sent; its death if it is gone."""
        messages, closed = self._readers[replica.replica_index].read()
        now = self.clock()
        for message in messages:
            if replica.liveness is not None:
                replica.liveness.heard(now, message)
            if isinstance(message, StepReport):
                self._apply(replica, message)
            elif isinstance(message, QueryReply):
                query = self._queries.pop(message.query_id, None)
                if query is not None:  # else its asker stopped waiting: ignored
                    query.answer(message)
            elif not isinstance(message, Heartbeat):
                logger.error("replica %d sent an unexpected %r", replica.replica_index,
                             type(message).__name__)
        if closed or not replica.handle.is_alive():
            self._died(replica)

    def _apply(self, replica: RemoteReplica, report: StepReport) -> None:
        replica.commands_done = report.commands_done
        index = replica.replica_index
        for event, cached in report.events:
            replica.follow(event, cached)
            notify(self.observers, event)
            for observer in list(self.replica_observers):
                try:
                    observer(index, event)
                except Exception:
                    logger.exception("step observer %r raised on replica %d's step %d; it is "
                                     "skipped for this event", observer, index, event.step_index)
        for output in report.outputs:
            record = self._current(output.request_id, replica, report)
            if record is None:
                continue  # aborted or moved meanwhile, or an earlier request of the same id
            record.started = True
            if output.finished:
                del self._requests[output.request_id]
                self._finished(output.request_id, record)
            self._undelivered.append(output)
        for failures, error in ((report.refused, RequestFailedError),
                                (report.failures, ReplicaFailedError)):
            for request_id, reason in failures:
                caller_id = self._caller_id(request_id)
                record = self._current(caller_id, replica, report)
                if record is not None:
                    self._fail(caller_id, record, reason, error)

    def _current(self, request_id: str, replica: RemoteReplica,
                 report: StepReport) -> _InFlight | None:
        """The request's record if this report is about it (sent to this replica, and
        reported after the replica took it)."""
        record = self._requests.get(request_id)
        if (record is None or record.replica != replica.replica_index
                or report.commands_done < record.command):
            return None
        return record

    def _caller_id(self, request_id: str) -> str:
        """The caller's id of a parallel sample's id ``"{i}_{request_id}"``."""
        if request_id in self._requests:
            return request_id
        head, _, rest = request_id.partition("_")
        return rest if head.isdigit() and rest in self._requests else request_id

    def _finished(self, request_id: str, record: _InFlight) -> None:
        """A request left (finished, aborted or failed): tell its replica view and the
        router."""
        replica = self.replicas[record.replica]
        replica.requests.discard(request_id)
        replica.unreported.discard(request_id)
        on_finish = getattr(self.router, "on_finish", None)
        if on_finish is not None:
            try:
                on_finish(request_id, record.position)
            except Exception:
                logger.exception("router %s raised in on_finish(%r)",
                                 component_name(self.router), request_id)

    def _fail(self, request_id: str, record: _InFlight, reason: str,
              error: type[RequestFailedError] = None) -> None:
        """End a request the replica (or its death) ended: a final ``"abort"`` output,
        and the error ``step()`` raises for it (a :class:`ReplicaFailedError` unless the
        engine itself refused the request: a plain ``RequestFailedError``, as one engine
        raises it)."""
        self.replicas[record.replica].forget(record.member_ids)
        self._finished(request_id, record)
        self._end_failed(request_id, record, reason, error)

    def _end_failed(self, request_id: str, record: _InFlight, reason: str,
                    error: type[RequestFailedError] = None) -> None:
        """:meth:`_fail` once the request's replica view and router have let it go."""
        del self._requests[request_id]
        self._undelivered.append(RequestOutput(
            request_id, record.prompt, record.prompt_token_ids,
            [CompletionOutput(i, "", [], None, finish_reason="abort") for i in range(record.n)],
            finished=True,
        ))
        if error is RequestFailedError:
            self._failures.append(RequestFailedError(request_id, reason))
        else:
            self._failures.append(ReplicaFailedError(request_id, reason, record.replica))

    def _death_reason(self, replica: RemoteReplica) -> str:
        handle = replica.handle
        how = getattr(handle, "describe_exit", None)  # a Ray actor says how it ended
        return (f"replica {replica.replica_index} (pid {handle.pid}) died "
                f"({how() if how else describe_exit(handle.exit_code)})")

    def _died(self, replica: RemoteReplica) -> None:
        """The replica is gone: fail what it held, route around it."""
        if replica.dead_reason is not None:
            return
        replica.handle.stop(1.0)  # reaps it, and whatever it started
        reason = self._death_reason(replica)
        logger.error("%s; failing its %d request(s) in flight (requests are not retried)",
                     reason, len(replica.requests))
        for request_id in sorted(replica.requests):
            record = self._requests.get(request_id)
            if record is not None:
                self._fail(request_id, record,
                           f"{reason}; the request was lost with it (requests are not retried)")
        replica.requests.clear()
        replica.died(reason)

    # -- hung replicas -------------------------------------------------------------------

    def _check_replicas(self) -> None:
        """Judge every live replica by its heartbeats (the monitor thread, every heartbeat
        interval). What a replica sent is read first (all of them, if no step has read
        lately): silence is measured from the last message read, never from a front end
        that was slow to read. A replica that stops answering loses its requests
        (:meth:`_unresponsive`); one that answers again takes requests again."""
        with self._lock:
            if self._closed:
                return
            now = self.clock()
            read_all = now - self._last_read > self._beat_s
            for replica in self.replicas:
                liveness = replica.liveness
                if replica.dead_reason is not None or liveness is None:
                    continue
                if read_all or liveness.verdict(now) is not None:
                    self._read(replica)
                    if replica.dead_reason is not None:
                        continue
                verdict = liveness.verdict(self.clock())
                if verdict is None and replica.unresponsive is not None:
                    self._rejoined(replica)
                elif verdict is not None and replica.unresponsive is None:
                    self._unresponsive(replica, verdict)
                elif verdict is not None:
                    replica.unresponsive = verdict  # silent <-> wedged
            if read_all:
                self._last_read = now
            news = bool(self._undelivered or self._failures)
        if news:
            self.wake()  # a step() waiting for reports returns them now

    def _unresponsive_reason(self, replica: RemoteReplica, now: float) -> str:
        return (f"replica {replica.replica_index} (pid {replica.handle.pid}) is unresponsive: "
                f"{replica.liveness.describe(replica.unresponsive, now)}")

    def _unresponsive(self, replica: RemoteReplica, verdict: str) -> None:
        """The replica stopped answering: routers no longer see it, and its requests
        leave it now. One that has produced no output yet goes to a replica that answers
        (it fails only if none does); one that has fails with a
        :class:`ReplicaFailedError` naming the replica. The replica is told to abort them
        all (it reads that when it runs again), and what it still reports of them is
        ignored (:meth:`_current`)."""
        replica.unresponsive = verdict
        reason = self._unresponsive_reason(replica, self.clock())
        ids = sorted(replica.requests)
        logger.error("%s; it takes no new requests until it answers again%s", reason,
                     f", and its {len(ids)} request(s) leave it" if ids else "")
        for request_id in ids:
            record = self._requests.get(request_id)
            if record is None:
                continue
            if record.started:
                self._fail(request_id, record,
                           f"{reason}; the request had started there, so it was aborted "
                           "(a request that has produced output is not retried)")
            else:
                self._move(request_id, record, reason)
        replica.requests.clear()
        if ids:
            try:
                replica.handle.send_bytes(pickle.dumps(AbortRequests(tuple(ids))))
                replica.commands_sent += 1
            except (OSError, EOFError, ValueError):
                pass  # it died: nothing of it is left to stop

    def _move(self, request_id: str, record: _InFlight, reason: str) -> None:
        """Send a request that has produced no output to another replica."""
        old = self.replicas[record.replica]
        old.forget(record.member_ids)
        self._finished(request_id, record)  # its router hears it left the old replica
        try:
            self._place(record)
        except ReplicasDeadError:
            self._end_failed(request_id, record, f"{reason}; the request had not started "
                             "there, but no other replica answers now")
            return
        except Exception as err:  # noqa: BLE001 - the router failed: this request fails
            self._end_failed(request_id, record, f"{reason}; the request had not started "
                             f"there, but routing it again failed: {type(err).__name__}: {err}")
            return
        logger.info("request %r moved from replica %d (unresponsive) to replica %d",
                    request_id, old.replica_index, record.replica)

    def _rejoined(self, replica: RemoteReplica) -> None:
        logger.warning("replica %d (pid %s) answers again; it takes requests again",
                       replica.replica_index, replica.handle.pid)
        replica.unresponsive = None

    # -- shutdown ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every replica (asked first, then terminated and killed after a timeout)
        and forget the requests in flight. Idempotent; also runs when the engine is
        garbage collected and at interpreter exit."""
        with self._lock:
            self._closed = True
            self._requests.clear()
            for replica in self.replicas:  # under the lock: no command is half sent
                replica.handle.request_stop()
        self._monitor.stop()
        if self.grammars is not None:  # the front end's own compiles
            self.grammars.close()
        self._finalizer()
        _LIVE_ENGINES.discard(self)

    close = shutdown

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        live = sum(r.is_live for r in self.replicas)
        return (f"DataParallelEngine(replicas={self.num_replicas}, live={live}, "
                f"router={component_name(self.router)}, in_flight={len(self._requests)})")


def _check_picklable(settings: dict[str, Any], num_replicas: int) -> None:
    """Each setting reaches the replicas pickled: name the one that cannot be."""
    for key, value in settings.items():
        try:
            pickle.dumps(value)
        except Exception as err:  # noqa: BLE001 - whatever pickling raises
            raise ValueError(
                f"{key}={value!r} cannot be sent to the replica processes: "
                f"data_parallel_size={num_replicas} builds each replica in a process of its "
                f"own, so components given as instances must be picklable ({type(err).__name__}: "
                f"{err}); give it by registered name, or make it picklable"
            ) from err
