"""Per-request KV block accounting on top of the block pool: the manager's core.

The scheduler talks only to :class:`KVCacheManager`: reserve blocks for the tokens a
request will compute this step (all or nothing), give everything back when it finishes, is
aborted or is preempted, or cut it back (``truncate``). This file holds that core: device
block allocation, block tables and their deltas, and all of the manager's state. The rest
of the class comes from mixins, one role per file (their methods are the class's own):

* :mod:`llmlab.cache.prefix_cache`: prefix lookups, indexing computed blocks, evictions;
* :mod:`llmlab.cache.copy_on_write`: ``fork`` and the block copies sharing costs;
* :mod:`llmlab.cache.tiers`: host tiers (swap preemption, the offload tier), transfers;
* :mod:`llmlab.cache.compaction`: KV press compaction reservations;
* :mod:`llmlab.cache.observation`: block events, snapshots and ``check()``.

Each call records what happened to which block; the engine drains that record into the
step's :class:`~llmlab.observe.events.StepEvent`, and the executor applies the recorded
transfers and block copies before the next forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from llmlab.cache.block_pool import BlockPool
from llmlab.cache.compaction import Compaction
from llmlab.cache.copy_on_write import CopyOnWrite
from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.host_pools import OffloadTier, SwapSpace
from llmlab.cache.observation import LOGGED_EVENTS, BlockEvents, CacheSnapshot, Observation
from llmlab.cache.pool_checks import at_least_one
from llmlab.cache.prefix_cache import PrefixCaching
from llmlab.cache.prefix_index import PrefixIndex
from llmlab.cache.tiers import HostTiers
from llmlab.cache.transfers import KVTransfer
from llmlab.errors import ComponentError

if TYPE_CHECKING:
    from llmlab.request import Request

__all__ = ["BlockEvents", "CacheSnapshot", "KVCacheManager"]  # records from observation.py


# No attrs hooks on assignment (they would sit in the hot path); sizes are fixed once built.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class KVCacheManager(PrefixCaching, CopyOnWrite, HostTiers, Compaction, Observation):
    """Paged KV accounting with automatic prefix caching and copy-on-write sharing.

    Args:
        num_blocks: physical blocks in the KV tensors.
        block_size: tokens per block.
        enable_prefix_caching: index full blocks by content and reuse them across requests.
        eviction: chooses which cached free blocks are reclaimed first (default LRU). It can
            be swapped later (``kv.eviction = FIFOEviction()``); the new one learns every
            current candidate.
        swap: host blocks for swap preemption (:meth:`swap_out`, :meth:`swap_in`), or None.
        tier: the prefix cache's second tier (dropped cached blocks spill there, and
            :meth:`lookup_offloaded` finds them), or None.
    """

    num_blocks: int = attrs.field(validator=at_least_one)
    block_size: int = attrs.field(validator=at_least_one)
    enable_prefix_caching: bool = True
    # Only the pool's reference is live (the ``eviction`` property, in prefix_cache.py).
    _initial_eviction: EvictionPolicy = attrs.field(
        factory=LRUEviction, alias="eviction", repr=False
    )
    pool: BlockPool = attrs.field(init=False, repr=False)
    index: PrefixIndex = attrs.field(init=False, factory=PrefixIndex, repr=False)
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict, repr=False)
    # Leading blocks of each request already offered to the index.
    _num_indexed: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    _pending_copies: list[tuple[int, int]] = attrs.field(init=False, factory=list, repr=False)
    _log: dict[str, list[int]] = attrs.field(init=False, repr=False)
    # Requests whose table changed since the last drain (a dict keeps first-touch order).
    _touched: dict[str, None] = attrs.field(init=False, factory=dict, repr=False)
    # Per request, the lowest table index changed since its last ``table_delta``.
    _changed_from: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)
    # Host tiers (llmlab.cache.tiers).
    swap: SwapSpace | None = attrs.field(default=None, kw_only=True)
    tier: OffloadTier | None = attrs.field(default=None, kw_only=True)
    _transfers: list[KVTransfer] = attrs.field(init=False, factory=list, repr=False)
    # Failures of the tier's eviction policy, which surface inside the device pool's calls
    # (reported through take_errors; the pools are consistent).
    _errors: list[Exception] = attrs.field(init=False, factory=list, repr=False)
    _spilling: bool = attrs.field(init=False, default=True, repr=False)
    # KV press compactions (llmlab.cache.compaction): fresh blocks reserved per request
    # (they replace its table if the executor compacts it, else go back) ...
    _compacting: dict[str, list[int]] = attrs.field(init=False, factory=dict, repr=False)
    # ... or, in a full pool, how many of its own first blocks it compacts into.
    _in_place: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self._initial_eviction, on_drop=self._forget)
        self._log = {name: [] for name in LOGGED_EVENTS}

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def block_table(self, request_id: str) -> tuple[int, ...]:
        """The request's block ids in position order, as an immutable copy."""
        return tuple(self._tables.get(request_id, ()))

    def table_delta(self, request_id: str, whole: bool = False) -> tuple[int, tuple[int, ...]]:
        """How the request's table changed since the last call: ``(first, blocks)`` with
        ``table[first:] == blocks`` (``(len(table), ())`` when nothing changed); the
        whole table with ``whole``. What the step contract sends executors."""
        table = self._tables.get(request_id, ())
        changed = self._changed_from.pop(request_id, None)
        first = 0 if whole else len(table) if changed is None else min(changed, len(table))
        return first, tuple(table[first:])

    def _changed(self, request_id: str, first: int) -> None:
        old = self._changed_from.get(request_id)
        self._changed_from[request_id] = first if old is None or first < old else old

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ----------------------------------------------------------------------

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        prefix_blocks: Sequence[int] = (),
        offloaded_blocks: Sequence[int] = (),
    ) -> bool:
        """Reserve blocks so ``num_new_tokens`` more tokens of ``request`` can be stored.

        ``prefix_blocks`` (from :meth:`lookup_prefix`, for a request being admitted) are
        shared, not copied; ``offloaded_blocks`` (from :meth:`lookup_offloaded`, the hit's
        continuation in the second tier) get fresh device blocks, and their loads are
        recorded (:meth:`take_transfers`); those blocks join the prefix index. A shared
        block the new tokens would write into is replaced by a fresh one first (copy-on-write;
        the copy waits in :meth:`take_block_copies`), and an indexed block of its own that
        they would overwrite leaves the prefix index. All or nothing: on ``False`` nothing
        changed, and on ``ComponentError`` (the eviction policy failed) the request holds
        nothing new and the pool is consistent.
        """
        rid = request.request_id
        table = self._tables.get(rid, [])
        if not prefix_blocks and table and num_new_tokens > 0:
            # The common decode case, checked first because it runs for every running
            # request every step: the new tokens land in the last held block, which this
            # request alone holds and which is not in the prefix index. Nothing to do.
            write_start = request.num_cached_kv
            last = len(table) - 1
            if (
                write_start // self.block_size == last
                and (write_start + num_new_tokens - 1) // self.block_size == last
                and self.pool.ref_counts[table[last]] == 1
                and not self.pool.cached[table[last]]
            ):
                return True
        prefix = list(prefix_blocks)
        loads = list(offloaded_blocks)
        if (prefix or loads) and table:
            raise ValueError(
                f"prefix_blocks are for admitting a request, but {rid!r} already holds "
                f"{len(table)} blocks"
            )
        num_hit = len(prefix) + len(loads)
        # ``num_computed_tokens`` does not yet include the prefix hit (the scheduler
        # advances it only once the allocation succeeded).
        write_start = request.num_cached_kv + num_hit * self.block_size
        write_end = write_start + num_new_tokens
        num_fresh = max(0, self.blocks_needed(write_end) - len(table) - num_hit)
        to_copy, to_uncache = self._blocks_written_in_place(table, write_start, write_end)
        # Hit blocks that are free now would be revived, not taken from the free pool, so
        # they cannot also count as room for the new blocks.
        revived = self.pool.num_idle(prefix)
        num_wanted = num_fresh + len(to_copy) + len(loads)
        if num_wanted > self.pool.num_free_blocks - revived:
            return False
        if loads:
            self.tier.pin(loads)  # a spill caused by this allocation must not take them
        try:
            if prefix:
                self.pool.touch(prefix)  # the policy's on_hit goes first: it may raise
            try:
                new_ids = self.pool.allocate(num_wanted)[0] if num_wanted else []
            except ComponentError:
                if prefix:
                    self._release_quietly(prefix[::-1])
                raise
        except ComponentError:
            if loads:
                self._unpin_quietly(loads)
            raise
        if prefix or loads:
            table = prefix
            self._log["prefix_hits"].extend(prefix)
            self._num_indexed[rid] = num_hit
        if loads:
            loaded = new_ids[len(to_copy) : len(to_copy) + len(loads)]
            self._load(request, len(prefix), loads, loaded)
            table.extend(loaded)
        if to_copy:
            self._copy_on_write(table, to_copy, new_ids[: len(to_copy)], write_start)
        if to_uncache:
            # Our own indexed blocks are about to be overwritten: the index must forget them.
            self.pool.drop_cached([table[i] for i in to_uncache])
        if to_copy or to_uncache:
            first = min(to_copy + to_uncache)
            self._num_indexed[rid] = min(self._num_indexed.get(rid, 0), first)
        self._changed(rid, 0 if prefix or loads else min(to_copy, default=len(table)))
        table.extend(new_ids[len(to_copy) + len(loads) :])
        if table:
            self._tables[rid] = table
        if new_ids or prefix:
            self._touched[rid] = None
        self._log["allocated"].extend(new_ids)
        return True

    def free(self, request: Request) -> None:
        """Release every block the request holds (finish, abort or preemption), tail first.

        The request's table goes first, so even when the policy fails (``ComponentError``
        after the pool is consistent) the request holds nothing.
        """
        if self.swap is not None and self.swap.holds(request.request_id):
            self.swap.give_back(request.request_id)  # aborted while swapped out
        self._free_device(request)
        self.cancel_compaction(request)

    def _free_device(self, request: Request) -> None:
        table = self._tables.pop(request.request_id, None)
        self._num_indexed.pop(request.request_id, None)
        self._changed_from.pop(request.request_id, None)
        if table:
            self._touched[request.request_id] = None
            self._release(table[::-1])

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Keep only the blocks covering the first ``num_tokens`` tokens; release the rest.

        Trims ``request.block_hashes`` to the full blocks left. A new last block that is now
        partial will be overwritten past ``num_tokens``: if only this request holds it, it
        leaves the prefix index; if it is shared, the next :meth:`allocate` copies it first.
        The caller sets ``request.num_computed_tokens``.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        rid = request.request_id
        num_full = num_tokens // self.block_size
        del request.block_hashes[num_full:]
        table = self._tables.get(rid)
        if not table:
            return
        if rid in self._num_indexed:
            self._num_indexed[rid] = min(self._num_indexed[rid], num_full)
        num_kept = self.blocks_needed(num_tokens)
        if num_tokens % self.block_size and num_kept <= len(table):
            last = table[num_kept - 1]
            if self.pool.cached[last] and self.pool.ref_counts[last] == 1:
                self.pool.drop_cached([last])
        released = table[num_kept:]
        del table[num_kept:]
        if released:
            self._touched[rid] = None
            self._changed(rid, num_kept)
        if not table:
            del self._tables[rid]
            self._num_indexed.pop(rid, None)
        if released:
            self._release(released[::-1])

    # -- internals -----------------------------------------------------------------------

    def _release(self, tail_first: list[int]) -> None:
        """Release blocks and log those freed, also when the policy fails in ``on_free``."""
        # Pending copies into freed blocks stay: a later copy may read from such a block,
        # and copying into a block nobody reads yet is harmless.
        try:
            freed = self.pool.release(tail_first)
        except ComponentError:
            ids = np.asarray(tail_first)
            self._log["freed"].extend(ids[self.pool.ref_counts[ids] == 0].tolist())
            raise
        self._log["freed"].extend(freed)

    def _release_quietly(self, tail_first: list[int]) -> None:
        """Undo references during a rollback; the caller re-raises the first failure."""
        try:
            self.pool.release(tail_first)
        except ComponentError:
            pass  # the pool is consistent either way (freed as empty)

