"""What the KV cache manager reports about itself: block events, snapshots, invariants.

:class:`BlockEvents` (what happened to blocks and tables since the last drain; the engine
puts it in the step's :class:`~llmlab.observe.events.StepEvent`) and :class:`CacheSnapshot`
(every block's state, for views and tests) are plain records. :class:`Observation` is a
mixin of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager`: its methods are the
manager's (``kv.drain_events()``, ``kv.snapshot()``, ``kv.check()``), reading the state
declared there. The manager's operations append to its log as they go
(``self._log["allocated"].extend(...)``), one list per name in :data:`LOGGED_EVENTS`.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class BlockEvents:
    """Block ids touched since the last drain, in the order it happened.

    ``evicted`` lists every block whose cached content was dropped from the prefix index:
    reclaimed for reuse, cut by :meth:`KVCacheManager.truncate`, or after a failed policy.
    ``forked`` lists the blocks :meth:`KVCacheManager.fork` shared with a new holder (once
    per fork: a prompt shared by four samples appears three times).
    ``cached`` lists the blocks that entered the prefix index and are still in it.
    ``tables`` gives, for every request whose block table changed, the table as it is now
    (``()``: the request holds no blocks any more), in the order requests were first
    touched. Applying ``evicted``, then ``cached``, then ``tables`` to the previous
    :meth:`KVCacheManager.snapshot` gives the current one (what replayed views rely on).

    Host tiers (``llmlab.cache.tiers``): ``spilled`` lists ``(device_block,
    offload_block)`` copies of dropped prefix blocks into the second tier, ``loaded``
    ``(offload_block, device_block)`` second-tier hits copied back (those device blocks
    are in ``cached`` too), ``offload_evicted`` the tier blocks whose content was dropped;
    ``swapped_out`` / ``swapped_in`` give ``(request_id, num_blocks)`` per swap.
    """

    allocated: tuple[int, ...] = ()
    freed: tuple[int, ...] = ()
    prefix_hits: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()
    forked: tuple[int, ...] = ()
    cached: tuple[int, ...] = ()
    tables: tuple[tuple[str, tuple[int, ...]], ...] = ()
    spilled: tuple[tuple[int, int], ...] = ()
    loaded: tuple[tuple[int, int], ...] = ()
    offload_evicted: tuple[int, ...] = ()
    swapped_out: tuple[tuple[str, int], ...] = ()
    swapped_in: tuple[tuple[str, int], ...] = ()


# The events the manager logs as they happen; ``tables`` and ``offload_evicted`` are read
# at drain time instead.
LOGGED_EVENTS = (
    "allocated", "freed", "prefix_hits", "evicted", "forked", "cached",
    "spilled", "loaded", "swapped_out", "swapped_in",
)


@attrs.frozen
class CacheSnapshot:
    """Immutable picture of every block, for views and tests (compares with ``==``)."""

    ref_counts: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    cached: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    block_tables: dict[str, tuple[int, ...]]
    num_free_blocks: int


def _read_only_copy(array: np.ndarray) -> np.ndarray:
    copy = array.copy()
    copy.flags.writeable = False
    return copy


class Observation:
    """Events, snapshots and invariants of
    :class:`~llmlab.cache.kv_cache_manager.KVCacheManager` (see the module)."""

    __slots__ = ()  # the manager is slotted; its fields hold this mixin's state

    def drain_events(self) -> BlockEvents:
        """What happened to blocks and tables since the last drain (then forget it)."""
        log = {k: tuple(v) for k, v in self._log.items()}
        if self.tier is not None:
            log["offload_evicted"] = self.tier.drain_evicted()
        cached = self.pool.cached
        # A block indexed and then evicted again within the drain window ends up uncached.
        log["cached"] = tuple(b for b in log["cached"] if cached[b])
        tables = tuple((rid, tuple(self._tables.get(rid, ()))) for rid in self._touched)
        for v in self._log.values():
            v.clear()
        self._touched.clear()
        return BlockEvents(**log, tables=tables)

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(
            ref_counts=_read_only_copy(self.pool.ref_counts),
            cached=_read_only_copy(self.pool.cached),
            block_tables={rid: tuple(table) for rid, table in self._tables.items()},
            num_free_blocks=self.num_free_blocks,
        )

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (O(num_blocks))."""
        self.pool.check()
        holders = np.zeros(self.num_blocks, np.int64)
        for rid, table in self._tables.items():
            if not table or len(set(table)) != len(table):
                raise AssertionError(f"request {rid!r} has an empty or repeating table {table}")
            holders[table] += 1
        for rid, targets in self._compacting.items():  # reserved for a compaction
            holders[targets] += 1
        mismatched = np.flatnonzero(holders != self.pool.ref_counts)
        if mismatched.size:
            b = int(mismatched[0])
            raise AssertionError(
                f"block {b} has ref count {self.pool.ref_counts[b]} but {holders[b]} tables hold it"
            )
        cached = set(np.flatnonzero(self.pool.cached).tolist())
        indexed = set(self.index.block_ids())
        if cached != indexed or len(self.index) != len(indexed):
            raise AssertionError(
                f"cached but not indexed: {sorted(cached - indexed)[:8]}; indexed but not "
                f"cached: {sorted(indexed - cached)[:8]}; {len(self.index)} hashes"
            )
        for rid, num_indexed in self._num_indexed.items():
            if rid not in self._tables or num_indexed > len(self._tables[rid]):
                raise AssertionError(f"request {rid!r} counts {num_indexed} indexed blocks")
        self._check_tiers()
