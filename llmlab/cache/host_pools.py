"""Host-side KV pools: the swap space and the prefix cache's second tier (bookkeeping only).

Both are :class:`~llmlab.cache.block_pool.BlockPool`\\ s of their own, with their own ids
(``0 .. num_blocks - 1`` in that pool), so the mechanism (ref counts, free lists, a
guarded eviction policy) is the device pool's. The KV tensors behind them live with the
executor (``llmlab.cache.kv_tensors.HostKVCaches``); what crosses over is a list of
:class:`~llmlab.cache.transfers.KVTransfer`\\ s that the
:class:`~llmlab.cache.kv_cache_manager.KVCacheManager` records (:mod:`llmlab.cache.tiers`).

* :class:`SwapSpace` (``preemption_mode="swap"``, ``swap_space`` GiB): a preempted
  request's computed blocks are copied here and its device blocks freed; on resumption
  they are copied back into fresh device blocks, and it continues where it stopped
  (vLLM's swap preemption). No caching: a block belongs to one swapped request.
* :class:`OffloadTier` (``kv_offloading_size`` GiB): cached prefix blocks the device pool
  drops are *spilled* here (a copy, under their chained hash), with their own
  :class:`~llmlab.cache.prefix_index.PrefixIndex` and
  :class:`~llmlab.cache.eviction.EvictionPolicy` (any registered one: vLLM's offload
  tier's eviction policy, SGLang's HiCache host pool). A prefix lookup that runs past the
  device hits continues here; hits get device blocks and are *loaded* back. The tier is
  inclusive: a loaded block stays here too, so evicting it from the device again costs no
  copy. Every tier block is a cached free block (an eviction candidate) except while a
  load that reads it is being recorded (one reference, so a spill in the same step cannot
  take it).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from llmlab.cache.block_pool import BlockPool
from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.pool_checks import at_least_one
from llmlab.cache.prefix_index import PrefixIndex


@attrs.define(on_setattr=attrs.setters.NO_OP)
class SwapSpace:
    """Host blocks of swapped-out requests: ``take`` on swap-out, ``give_back`` on swap-in
    or abort. Each request's host table lists its blocks in position order."""

    num_blocks: int = attrs.field(validator=at_least_one)
    pool: BlockPool = attrs.field(init=False, repr=False)
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        # Nothing here is ever cached, so the policy is never asked to evict.
        self.pool = BlockPool(self.num_blocks, LRUEviction())

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free_blocks

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    def table(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._tables.get(request_id, ()))

    def tables(self) -> dict[str, tuple[int, ...]]:
        return {rid: tuple(t) for rid, t in self._tables.items()}

    def take(self, request_id: str, n: int) -> list[int] | None:
        """``n`` host blocks for ``request_id``, or None when fewer are free."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} is already swapped out")
        if n < 1 or n > self.pool.num_free_blocks:
            return None
        block_ids, _ = self.pool.allocate(n)
        self._tables[request_id] = block_ids
        return list(block_ids)

    def give_back(self, request_id: str) -> list[int]:
        """Free the request's host blocks (swapped in, or aborted while swapped out);
        returns their ids (empty when it held none)."""
        table = self._tables.pop(request_id, None)
        if not table:
            return []
        self.pool.release(table[::-1])
        return table

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        self.pool.check()
        holders = np.zeros(self.num_blocks, np.int64)
        for rid, table in self._tables.items():
            if not table or len(set(table)) != len(table):
                raise AssertionError(f"swapped request {rid!r} has a bad host table {table}")
            holders[table] += 1
        if not np.array_equal(holders, self.pool.ref_counts):
            b = int(np.flatnonzero(holders != self.pool.ref_counts)[0])
            raise AssertionError(
                f"swap block {b} has ref count {self.pool.ref_counts[b]} but {holders[b]} "
                "swapped requests hold it"
            )
        if self.pool.cached.any():
            raise AssertionError("a swap block is flagged cached")


@attrs.define(on_setattr=attrs.setters.NO_OP)
class OffloadTier:
    """The prefix cache's second tier: content-addressed host blocks with their own
    eviction policy (see the module docstring).

    Args:
        num_blocks: host blocks in the tier.
        eviction: orders the tier's blocks for reuse (default LRU); any registered
            eviction policy works, as on the device pool.
    """

    num_blocks: int = attrs.field(validator=at_least_one)
    _initial_eviction: EvictionPolicy = attrs.field(
        factory=LRUEviction, alias="eviction", repr=False
    )
    pool: BlockPool = attrs.field(init=False, repr=False)
    index: PrefixIndex = attrs.field(init=False, factory=PrefixIndex, repr=False)
    # Tier blocks whose content was dropped since the last drain (for step events).
    _evicted: list[int] = attrs.field(init=False, factory=list, repr=False)

    def __attrs_post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self._initial_eviction, on_drop=self._forget)

    @property
    def eviction(self) -> EvictionPolicy:
        return self.pool.eviction

    @property
    def num_cached_blocks(self) -> int:
        return len(self.index)

    def lookup(self, block_hashes: Sequence[int], token_ids: Sequence[int], block_size: int,
               first: int, last: int) -> list[int]:
        """Tier ids of the run of blocks ``first, first + 1, ... < last`` of a sequence
        found here (chained hashes, token ids verified), stopping at the first miss."""
        hits: list[int] = []
        bs = block_size
        for i in range(first, last):
            block_id = self.index.get(block_hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def store(self, entries: Sequence[tuple[int, int, tuple[int, ...]]]) -> list[tuple[int, int]]:
        """Give each ``(device_block, block_hash, token_ids)`` not already here a tier block
        (evicting the tier's own candidates as needed); returns the ``(device_block,
        tier_block)`` pairs whose KV must be copied. Blocks left without room (every tier
        block pinned by a load) are not stored. May raise ``ComponentError`` (the tier's
        policy failed; the tier is consistent and nothing was stored)."""
        wanted = [e for e in entries if not self.index.contains(e[1])]
        n = min(len(wanted), self.pool.num_free_blocks)
        if n == 0:
            return []
        wanted = wanted[:n]
        tier_ids, _ = self.pool.allocate(n)
        for tier_id, (_, block_hash, token_ids) in zip(tier_ids, wanted, strict=True):
            self.index.insert(tier_id, block_hash, token_ids)
        self.pool.mark_cached(tier_ids)
        # Candidates at once, in the order the device pool dropped them.
        self.pool.release(tier_ids)
        return [(e[0], t) for e, t in zip(wanted, tier_ids, strict=True)]

    def pin(self, tier_ids: Sequence[int]) -> None:
        """Hold blocks a load is about to read (a hit for the tier's policy)."""
        self.pool.touch(tier_ids)

    def unpin(self, tier_ids: Sequence[int]) -> None:
        """The load is recorded: the blocks are candidates again."""
        self.pool.release(list(tier_ids)[::-1])

    def clear(self) -> None:
        """Drop every unpinned block's content (``reset_prefix_cache``)."""
        pool = self.pool
        num_cached = pool.num_cached_free_blocks
        if num_cached:
            taken, _ = pool.allocate(pool.num_empty_blocks + num_cached)
            pool.release(taken)

    def drain_evicted(self) -> tuple[int, ...]:
        evicted, self._evicted = tuple(self._evicted), []
        return evicted

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant."""
        self.pool.check()
        if self.pool.ref_counts.any():
            b = int(np.flatnonzero(self.pool.ref_counts)[0])
            raise AssertionError(f"offload block {b} is still pinned between steps")
        cached = set(np.flatnonzero(self.pool.cached).tolist())
        indexed = set(self.index.block_ids())
        if cached != indexed or len(self.index) != len(indexed):
            raise AssertionError(
                f"offload tier: cached but not indexed {sorted(cached - indexed)[:8]}; "
                f"indexed but not cached {sorted(indexed - cached)[:8]}"
            )

    def _forget(self, tier_ids: list[int]) -> None:
        self.index.remove(tier_ids)
        self._evicted.extend(tier_ids)
