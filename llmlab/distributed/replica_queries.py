"""What the data-parallel front end asks of a replica's engine, and how the answers come back.

A replica's engine lives in its own process, so the members of
:class:`~llmlab.engine.client.EngineClient` that read an engine's state (``snapshot``,
``observe``, ``record``, ``kv_cache``) are questions: the front end sends a
:class:`~llmlab.distributed.replica_process.Query`, the replica answers it between two of
its steps with a :class:`~llmlab.distributed.replica_process.QueryReply`, on the same
connection as its step reports and in order with them. That order is what makes
``observe`` exact: every event a replica reports after its snapshot's answer comes from a
later step.

This module holds the front end's side of those answers: :class:`PendingQuery` (one
question in flight), :class:`SnapshotObserver` (an observer that hears each replica from
its snapshot on), :class:`ReplicaKVCache` (one replica's KV cache, read remotely) and
:class:`ReplicaRecordings` (the recordings ``record`` started, one file per replica).
:class:`~llmlab.distributed.data_parallel.DataParallelEngine` sends the questions and
waits for the answers.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from llmlab.distributed.replica_process import KV_CACHE_READS, QueryReply, ReplicaInfo


@attrs.define(eq=False)
class PendingQuery:
    """One question sent to replica ``replica``, until its answer is read.

    ``on_answer(replica, value)`` runs when a successful answer is read, under the front
    end's lock and before any later message of that replica is applied.
    """

    replica: int
    on_answer: Callable[[int, Any], None] | None = None
    answered: bool = False
    value: Any = None
    error: str | None = None

    def answer(self, reply: QueryReply) -> None:
        self.value, self.error, self.answered = reply.value, reply.error, True
        if self.on_answer is not None and reply.error is None:
            self.on_answer(self.replica, reply.value)


class SnapshotObserver:
    """An observer attached by ``DataParallelEngine.observe``: it hears replica ``i``'s
    events only from the moment replica ``i``'s snapshot was taken (its answer was read),
    so applying them to that snapshot follows the replica exactly. A replica whose
    snapshot never came back is never heard."""

    __slots__ = ("observer", "replicas")

    def __init__(self, observer: Callable) -> None:
        self.observer = observer
        self.replicas: set[int] = set()

    def start(self, replica: int, snapshot: Any = None) -> None:
        self.replicas.add(replica)

    def __call__(self, replica: int, event: Any) -> None:
        if replica in self.replicas:
            self.observer(event)

    def __repr__(self) -> str:
        return f"observe({self.observer!r})"


class RemoteMemberError(NotImplementedError, AttributeError):
    """A member of an engine part that lives in a replica's process and cannot be read from
    the front end (an ``AttributeError`` too, so ``hasattr`` says False)."""


class ReplicaKVCache:
    """Replica ``replica_index``'s KV cache manager, read from the front end
    (``DataParallelEngine.kv_cache[i]``).

    The manager lives in the replica's process (its block pool holds memoryviews: it
    cannot be pickled), so this view answers what can be asked of it there: the pool's
    shape (``num_blocks``, ``block_size``, ``enable_prefix_caching``: known here), and
    ``num_free_blocks``, ``usage``, ``block_table(request_id)``, ``snapshot()`` and
    ``check()``, each one question answered between two of the replica's steps. Any other
    member of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager` raises
    :class:`RemoteMemberError` (a ``NotImplementedError``) naming it.

    ``ask(name, args)`` asks the replica; it raises when the replica does not answer.
    """

    def __init__(self, ask: Callable[[str, tuple], Any], replica_index: int,
                 info: ReplicaInfo) -> None:
        self._ask = ask
        self.replica_index = replica_index
        self.num_blocks = info.num_kv_blocks
        self.block_size = info.block_size
        self.enable_prefix_caching = info.enable_prefix_caching

    @property
    def num_free_blocks(self) -> int:
        return self._ask("num_free_blocks", ())

    @property
    def usage(self) -> float:
        return self._ask("usage", ())

    def block_table(self, request_id: str) -> tuple[int, ...]:
        return self._ask("block_table", (request_id,))

    def snapshot(self) -> Any:
        """The replica's :class:`~llmlab.cache.kv_cache_manager.CacheSnapshot` now."""
        return self._ask("snapshot", ())

    def check(self) -> None:
        """Check the replica's pool invariants there; raises what its check raised."""
        self._ask("check", ())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        raise RemoteMemberError(
            f"kv_cache[{self.replica_index}].{name}: replica {self.replica_index}'s "
            "KVCacheManager lives in the replica's process and cannot be copied here; from "
            "the front end a replica's KV cache answers num_blocks, block_size, "
            f"enable_prefix_caching, {', '.join(KV_CACHE_READS)} (and "
            "DataParallelEngine.snapshot() gives every replica's whole state)"
        )

    def __repr__(self) -> str:
        return (f"ReplicaKVCache(replica={self.replica_index}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size})")


def replica_path(path: str | pathlib.Path, index: int) -> pathlib.Path:
    """Replica ``index``'s recording file: ``run.jsonl`` -> ``run.replica0.jsonl``,
    ``run.jsonl.gz`` -> ``run.replica0.jsonl.gz`` (still compressed), ``run`` ->
    ``run.replica0``."""
    path = pathlib.Path(path)
    compressed = path.suffix == ".gz"
    base = path.with_suffix("") if compressed else path
    named = base.with_name(f"{base.stem}.replica{index}{base.suffix}")
    return named.with_name(named.name + ".gz") if compressed else named


class ReplicaRecordings:
    """The recordings ``DataParallelEngine.record`` started: each replica's engine writes
    its own run (``Engine.record``'s format, readable with :func:`llmlab.viz.load`) to its
    own file, in its own process.

    Attributes:
        paths: replica ``i``'s file, or None for a replica that was not recorded (dead, or
            not answering when recording started).
        num_steps: after :meth:`close`, the steps each recording holds (None: its replica
            did not answer, and its file ends without a footer).

    :meth:`close` (or leaving a ``with`` block) stops them all and waits for each footer;
    a replica that exits closes its recording itself.
    """

    def __init__(self, stop: Callable[[Mapping[int, int]], list], paths: tuple,
                 recording_ids: dict[int, int]) -> None:
        self._stop = stop
        self.paths: tuple[pathlib.Path | None, ...] = paths
        self._ids: dict[int, int] | None = recording_ids
        self.num_steps: tuple[int | None, ...] | None = None

    def close(self) -> None:
        """Stop every replica's recording (idempotent)."""
        if self._ids is None:
            return
        ids, self._ids = self._ids, None
        self.num_steps = tuple(self._stop(ids))

    def __enter__(self) -> ReplicaRecordings:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._ids is None else "recording"
        files = [str(p) for p in self.paths if p is not None]
        return f"ReplicaRecordings({files}, {state})"
