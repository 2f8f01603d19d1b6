"""Per-request KV block accounting on top of the block pool and the prefix index.

The scheduler talks only to this class: find a request's cached prefix, reserve blocks for
the tokens it will compute this step (all or nothing), register blocks once their KV is
computed, give everything back when the request finishes, is aborted or is preempted, cut a
request back (``truncate``) or share its blocks with a new one (``fork``, copy-on-write).
Each call records what happened to which block; the engine drains that record into the
step's :class:`~llmlab.observe.events.StepEvent`, and takes the pending block copies for the
executor to apply before the next forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from llmlab import registry
from llmlab.cache.block_pool import BlockPool
from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.host_pools import OffloadTier, SwapSpace
from llmlab.cache.prefix_index import PrefixIndex, extend_block_hashes
from llmlab.cache.transfers import KVTransfer
from llmlab.errors import ComponentError

if TYPE_CHECKING:
    from llmlab.request import Request


def _at_least_one(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _read_only_copy(array: np.ndarray) -> np.ndarray:
    copy = array.copy()
    copy.flags.writeable = False
    return copy


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

    Host tiers (``llmlab.cache.host_pools``): ``spilled`` lists ``(device_block,
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


@attrs.frozen
class CacheSnapshot:
    """Immutable picture of every block, for views and tests (compares with ``==``)."""

    ref_counts: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    cached: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    block_tables: dict[str, tuple[int, ...]]
    num_free_blocks: int


# No attrs hooks on assignment (they would sit in the hot path); sizes are fixed once built.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class KVCacheManager:
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

    Every KV move between pools is recorded in order (:meth:`take_transfers`), with the
    copy-on-write copies recorded before it, for the executor to apply before the forward.
    """

    num_blocks: int = attrs.field(validator=_at_least_one)
    block_size: int = attrs.field(validator=_at_least_one)
    enable_prefix_caching: bool = True
    # Only the pool's reference is live (see the ``eviction`` property).
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
    swap: SwapSpace | None = attrs.field(default=None, kw_only=True)
    tier: OffloadTier | None = attrs.field(default=None, kw_only=True)
    _transfers: list[KVTransfer] = attrs.field(init=False, factory=list, repr=False)
    # Failures of the tier's eviction policy, which surface inside the device pool's calls
    # (reported through take_errors; the pools are consistent).
    _errors: list[Exception] = attrs.field(init=False, factory=list, repr=False)
    _spilling: bool = attrs.field(init=False, default=True, repr=False)
    # Fresh blocks reserved for a KV press's compaction in flight, per request
    # (llmlab.kvpress): they replace its table if the executor compacts it, else go back.
    _compacting: dict[str, list[int]] = attrs.field(init=False, factory=dict, repr=False)
    # ... or, in a full pool, how many of its own first blocks it compacts into.
    _in_place: dict[str, int] = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        self.pool = BlockPool(self.num_blocks, self._initial_eviction, on_drop=self._forget)
        self._log = {
            "allocated": [],
            "freed": [],
            "prefix_hits": [],
            "evicted": [],
            "forked": [],
            "cached": [],
            "spilled": [],
            "loaded": [],
            "swapped_out": [],
            "swapped_in": [],
        }

    # -- queries -------------------------------------------------------------------------

    @property
    def eviction(self) -> EvictionPolicy:
        return self.pool.eviction

    @eviction.setter
    def eviction(self, policy: EvictionPolicy) -> None:
        registry.check("eviction_policy", policy)
        self._initial_eviction = policy
        self.pool.eviction = policy

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

    # -- prefix lookup -------------------------------------------------------------------

    def lookup_prefix(self, request: Request) -> list[int]:
        """Ids of the longest run of cached full blocks matching the request's first tokens.

        The last token is never covered: the model must compute at least one position to
        produce the next token's logits.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        bs = self.block_size
        extend_block_hashes(request.block_hashes, tokens, bs, request.hash_salt)
        max_blocks = (len(tokens) - 1) // bs
        hits: list[int] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block_id = self.index.get(block_hash, tuple(tokens[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

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
        block the new tokens would write into is replaced by a
        fresh one first (copy-on-write; the copy waits in :meth:`take_block_copies`), and an
        indexed block of its own that they would overwrite leaves the prefix index. All or
        nothing: on ``False`` nothing changed, and on ``ComponentError`` (the eviction policy
        failed) the request holds nothing new and the pool is consistent.
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

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that became full of computed KV (never a compacted
        request's: its blocks hold a selection of its tokens, not a prefix)."""
        if (
            not self.enable_prefix_caching or request.kv_compressed
            or request.request_id in self._in_place  # about to be rewritten
        ):
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(table))
        start = self._num_indexed.get(rid, 0)
        if num_full <= start:
            return
        tokens = request.all_token_ids
        if len(request.block_hashes) < num_full:
            extend_block_hashes(
                request.block_hashes, tokens[: num_full * bs], bs, request.hash_salt
            )
        cached = self.pool.cached
        newly_cached = []
        for i in range(start, num_full):
            block_id = table[i]
            block_hash = request.block_hashes[i]
            # Two requests may compute the same content at once; the first one indexed
            # wins and the duplicate stays private (it goes back to the empty list on free).
            if not cached[block_id] and not self.index.contains(block_hash):
                self.index.insert(block_id, block_hash, tuple(tokens[i * bs : (i + 1) * bs]))
                newly_cached.append(block_id)
        if newly_cached:
            self.pool.mark_cached(newly_cached)
            self._log["cached"].extend(newly_cached)
        self._num_indexed[rid] = num_full

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

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` (a new request with the parent's tokens so far) share its blocks.

        Every block gains a reference; the partly filled last one stays shared until either
        request writes into it (copy-on-write in :meth:`allocate`). The caller sets the
        child's ``num_computed_tokens``.
        """
        parent_table = self._tables.get(parent.request_id)
        if not parent_table:
            raise ValueError(f"parent {parent.request_id!r} holds no blocks to share")
        if child.request_id == parent.request_id or self._tables.get(child.request_id):
            raise ValueError(f"child {child.request_id!r} already holds blocks")
        self.pool.share(parent_table)
        self._log["forked"].extend(parent_table)
        self._tables[child.request_id] = list(parent_table)
        self._touched[child.request_id] = None
        self._changed(child.request_id, 0)
        if parent.request_id in self._num_indexed:
            self._num_indexed[child.request_id] = self._num_indexed[parent.request_id]
        child.block_hashes = list(parent.block_hashes)

    # -- KV press compaction (llmlab.kvpress) ---------------------------------------------

    def begin_compaction(
        self, request: Request, num_blocks: int
    ) -> tuple[tuple[int, ...], bool] | None:
        """Blocks for the request's kept tokens (the executor moves them there after this
        step's forward): ``(blocks, in_place)``, or None (nothing reserved; try later).

        Fresh blocks when the pool has them: the request's own may be shared with other
        requests or indexed as full-fidelity prefixes, and stay valid until
        :meth:`commit_compaction`. When it has too few (a full pool, where compaction
        matters most), the request's own first ``num_blocks`` blocks, if it alone holds
        every one of its blocks: they leave the prefix index now, so no request can share
        what is about to be rewritten (``in_place``)."""
        rid = request.request_id
        if rid in self._compacting or rid in self._in_place:
            raise ValueError(f"request {rid!r} already has a compaction in flight")
        if num_blocks < 1:
            return None
        if num_blocks <= self.pool.num_free_blocks:
            ids = self.pool.allocate(num_blocks)[0]
            self._compacting[rid] = list(ids)
            self._log["allocated"].extend(ids)
            return tuple(ids), False
        table = self._tables.get(rid, [])
        if num_blocks > len(table) or (self.pool.ref_counts[table] != 1).any():
            return None
        indexed = [b for b in table if self.pool.cached[b]]
        if indexed:
            self.pool.drop_cached(indexed)
        self._num_indexed[rid] = 0
        self._in_place[rid] = num_blocks
        return tuple(table[:num_blocks]), True

    def commit_compaction(self, request: Request) -> None:
        """The executor compacted the request into its reserved blocks: they become its
        table, and its old blocks are released (indexed full blocks stay in the prefix
        cache: their KV was computed before compaction and is exact). The request's
        blocks are never indexed from now on (``request.kv_compressed``)."""
        rid = request.request_id
        old = self._tables.get(rid, [])
        if rid in self._in_place:  # the kept tokens are in its first blocks: drop the rest
            num_kept = self._in_place.pop(rid)
            targets, old = old[:num_kept], old[num_kept:]
        else:
            targets = self._compacting.pop(rid)
        self._tables[rid] = targets
        self._num_indexed.pop(rid, None)
        self._changed(rid, 0)
        self._touched[rid] = None
        if old:
            self._release(old[::-1])

    def cancel_compaction(self, request: Request) -> None:
        """Give back the blocks reserved for a compaction that did not happen (the press
        failed, the step failed, or the request ended first)."""
        # In place: nothing was written (the executor selects every layer before it writes
        # any), so the blocks hold what they held; they only left the prefix index.
        self._in_place.pop(request.request_id, None)
        targets = self._compacting.pop(request.request_id, None)
        if targets:
            self._release(targets[::-1])

    def cancel_compactions(self) -> None:
        """Give back every reservation still in flight (a step failed before its outputs
        were applied): the scheduler plans them again."""
        self._in_place.clear()
        for rid in list(self._compacting):
            targets = self._compacting.pop(rid)
            self._release(targets[::-1])

    def compacting(self, request_id: str) -> tuple[int, ...]:
        """Blocks reserved for the request's compaction in flight (``()``: none)."""
        return tuple(self._compacting.get(request_id, ()))

    # -- host tiers: swap space and the offload tier -------------------------------------

    def is_swapped(self, request: Request) -> bool:
        """Whether the request's computed KV waits in the swap space (:meth:`swap_in`)."""
        return self.swap is not None and self.swap.holds(request.request_id)

    def swap_out(self, request: Request) -> bool:
        """Preempt by swapping: copy the blocks holding the request's computed tokens to the
        swap space and free its device blocks. False (nothing changed) when there is no
        swap space, nothing computed, or too few free host blocks: then preempt by
        recompute (:meth:`free`). The request keeps ``num_computed_tokens``."""
        rid = request.request_id
        table = self._tables.get(rid)
        n = self.blocks_needed(request.num_computed_tokens)
        if request.kv_compressed:  # its table is a KV press's selection: recompute it
            return False
        if self.swap is None or not table or n == 0 or n > len(table):
            return False
        host = self.swap.take(rid, n)
        if host is None:
            return False
        self._record("swap_out", tuple(zip(table[:n], host, strict=True)))
        self._log["swapped_out"].append((rid, n))
        self._free_device(request)
        return True

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Resume a swapped-out request: fresh device blocks for its swapped KV and
        ``num_new_tokens`` more tokens, the copies back recorded, its host blocks freed.
        All or nothing (False: not enough free device blocks); ``ComponentError`` if the
        eviction policy fails (nothing taken)."""
        rid = request.request_id
        host = self.swap.table(rid) if self.swap is not None else ()
        if not host:
            raise ValueError(f"request {rid!r} is not swapped out")
        if self._tables.get(rid):
            raise ValueError(f"request {rid!r} is swapped out but holds device blocks")
        n = max(len(host), self.blocks_needed(request.num_computed_tokens + num_new_tokens))
        if n > self.pool.num_free_blocks:
            return False
        new_ids, _ = self.pool.allocate(n)  # evictions (and their spills) come first
        self._record("swap_in", tuple(zip(host, new_ids[: len(host)], strict=True)))
        self.swap.give_back(rid)
        self._tables[rid] = new_ids
        self._num_indexed[rid] = 0  # its full blocks re-enter the index as usual
        self._changed(rid, 0)
        self._touched[rid] = None
        self._log["allocated"].extend(new_ids)
        self._log["swapped_in"].append((rid, len(host)))
        return True

    def lookup_offloaded(self, request: Request, first_block: int) -> list[int]:
        """Second-tier ids continuing a prefix hit: the request's full blocks from
        ``first_block`` (the device hit's length, from :meth:`lookup_prefix`, which
        computed the request's block hashes) found in the offload tier, up to the first
        miss; never the last token. Read-only: nothing moves until :meth:`allocate`."""
        if self.tier is None or not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        last = min((len(tokens) - 1) // self.block_size, len(request.block_hashes))
        return self.tier.lookup(request.block_hashes, tokens, self.block_size, first_block, last)

    def take_transfers(self) -> list[KVTransfer]:
        """KV moves recorded since the last call, in order (copy-on-write copies recorded
        before a move among them); the executor applies them before
        :meth:`take_block_copies`' copies and the next forward pass."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def take_errors(self) -> list[Exception]:
        """Failures of the offload tier's eviction policy since the last call (each left
        the tiers consistent; the blocks concerned are simply not in the tier)."""
        errors, self._errors = self._errors, []
        return errors

    # -- observation ---------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Evict every cached block no request holds (vLLM's ``reset_prefix_cache``): the
        index forgets them and they become empty, through the eviction policy's own order
        (``evicted`` block events). Blocks requests hold keep their content and entries.
        True when the prefix cache is now empty (no cached block was in use)."""
        pool = self.pool
        num_cached = pool.num_cached_free_blocks
        if num_cached:
            # Taking every free block evicts every candidate (on_drop -> _forget); giving
            # them straight back returns them as empty blocks. Nothing spills: the second
            # tier is emptied too.
            self._spilling = False
            try:
                taken, _ = pool.allocate(pool.num_empty_blocks + num_cached)
                pool.release(taken)
            finally:
                self._spilling = True
        if self.tier is not None:
            self.tier.clear()
            if len(self.tier.index):
                return False
        return len(self.index) == 0

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies ``(src_block, dst_block)`` since the last call.

        The executor applies them to the KV tensors, in this order (a copy may read a block
        an earlier one wrote), before the next forward pass.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

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
        for rid, targets in self._compacting.items():
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
        if self.swap is not None:
            self.swap.check()
            both = sorted(set(self.swap.tables()) & set(self._tables))
            if both:
                raise AssertionError(f"requests {both[:4]} hold device and swap blocks at once")
        if self.tier is not None:
            self.tier.check()

    # -- internals -----------------------------------------------------------------------

    def _blocks_written_in_place(
        self, table: list[int], write_start: int, write_end: int
    ) -> tuple[list[int], list[int]]:
        """Positions in ``table`` of held blocks that tokens ``[write_start, write_end)``
        would overwrite: ``(shared, private_cached)``.

        Shared ones need copy-on-write; private ones that are still indexed (a request cut
        back by :meth:`truncate` inside a block that was shared then, or never freed by its
        other holder since) must leave the index first.
        """
        if write_end <= write_start:
            return [], []
        first = write_start // self.block_size
        last = min(len(table), self.blocks_needed(write_end))
        refs, cached = self.pool.ref_counts, self.pool.cached
        shared, private_cached = [], []
        for i in range(first, last):
            if refs[table[i]] > 1:
                shared.append(i)
            elif cached[table[i]]:
                private_cached.append(i)
        return shared, private_cached

    def _copy_on_write(
        self, table: list[int], positions: list[int], fresh: list[int], write_start: int
    ) -> None:
        """Swap fresh blocks in at ``positions``; blocks with computed KV get a pending copy."""
        shared = [table[i] for i in positions]
        for i, src, dst in zip(positions, shared, fresh, strict=True):
            table[i] = dst
            if i * self.block_size < write_start:
                self._pending_copies.append((src, dst))
        # Each was shared (ref count > 1), so dropping our reference frees none of them and
        # the policy is not called.
        self.pool.release(shared)

    def _release(self, tail_first: list[int]) -> None:
        """Release blocks and log those freed, also when the policy fails in ``on_free``."""
        try:
            freed = self.pool.release(tail_first)
        except ComponentError:
            ids = np.asarray(tail_first)
            self._note_freed(ids[self.pool.ref_counts[ids] == 0].tolist())
            raise
        self._note_freed(freed)

    def _release_quietly(self, tail_first: list[int]) -> None:
        """Undo references during a rollback; the caller re-raises the first failure."""
        try:
            self.pool.release(tail_first)
        except ComponentError:
            pass  # the pool is consistent either way (freed as empty)

    def _record(self, kind: str, blocks: tuple[tuple[int, int], ...]) -> None:
        """Queue a transfer; copy-on-write copies queued before it go first, so the
        executor's order (transfers, then block copies) is the order of events here."""
        if self._pending_copies:
            self._transfers.append(KVTransfer("copy", tuple(self._pending_copies)))
            self._pending_copies = []
        self._transfers.append(KVTransfer(kind, blocks))

    def _spill(self, block_ids: list[int]) -> None:
        entries = []
        for block_id in block_ids:
            entry = self.index.entry(block_id)
            if entry is not None:
                entries.append((block_id, entry[0], entry[1]))
        if not entries:
            return
        try:
            pairs = self.tier.store(entries)
        except ComponentError as err:  # inside the device pool's call: report, go on
            self._errors.append(err)
            return
        if pairs:
            self._record("spill", tuple(pairs))
            self._log["spilled"].extend(pairs)

    def _load(
        self, request: Request, first: int, tier_ids: list[int], device_ids: list[int]
    ) -> None:
        """Record loads of second-tier hits into fresh device blocks (positions ``first``
        on of the request), index those blocks, and unpin the tier's."""
        pairs = tuple(zip(tier_ids, device_ids, strict=True))
        self._record("load", pairs)
        self._log["loaded"].extend(pairs)
        bs, tokens, hashes = self.block_size, request.all_token_ids, request.block_hashes
        indexed = []
        for i, block_id in enumerate(device_ids):
            pos = first + i
            if not self.index.contains(hashes[pos]):  # the device may hold a later block
                self.index.insert(block_id, hashes[pos], tuple(tokens[pos * bs : (pos + 1) * bs]))
                indexed.append(block_id)
        if indexed:
            self.pool.mark_cached(indexed)
            self._log["cached"].extend(indexed)
        try:
            self.tier.unpin(tier_ids)
        except ComponentError as err:
            self._errors.append(err)

    def _unpin_quietly(self, tier_ids: list[int]) -> None:
        try:
            self.tier.unpin(tier_ids)
        except ComponentError:
            pass  # the tier is consistent either way; the caller re-raises its failure

    def _note_freed(self, freed: list[int]) -> None:
        # Pending copies into freed blocks stay: a later copy may read from such a block,
        # and copying into a block nobody reads yet is harmless.
        self._log["freed"].extend(freed)

    def _forget(self, block_ids: list[int]) -> None:
        """The pool dropped these blocks' cached content: the index must not find them.
        With a second tier, the content (still valid now: nothing wrote the blocks yet)
        spills there first."""
        if self.tier is not None and self._spilling:
            self._spill(block_ids)
        self.index.remove(block_ids)
        self._log["evicted"].extend(block_ids)
