"""Host tiers of the KV cache manager: swap space and the prefix cache's offload tier.

:class:`HostTiers` is a mixin of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager`:
its methods are the manager's (``kv.swap_out(request)``), and the state they work on is
declared there (``swap``, ``tier``, the recorded transfers and the tier's errors). It
decides every KV move between the device pool and the host pools
(:mod:`llmlab.cache.host_pools`, bookkeeping only) and records each, in order, as a
:class:`~llmlab.cache.transfers.KVTransfer` for the executor (:meth:`take_transfers`):

* swap preemption: :meth:`swap_out` copies a preempted request's computed blocks to the
  swap space and frees its device blocks; :meth:`swap_in` copies them back into fresh
  device blocks (vLLM's swap preemption).
* the offload tier: cached prefix blocks the device pool drops spill there (``_spill``,
  called from the manager's ``on_drop`` hook); :meth:`lookup_offloaded` continues a device
  prefix hit there, and ``allocate(..., offloaded_blocks)`` loads the hits back (``_load``).

Where the core calls in: ``allocate`` (pins, loads), ``free`` (a swapped request's host
blocks), ``_forget`` (spills), ``drain_events`` (the tier's evictions) and ``check``
(:meth:`_check_tiers`). Without host pools (``swap`` and ``tier`` None) none of this runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmlab.cache.transfers import KVTransfer
from llmlab.errors import ComponentError

if TYPE_CHECKING:
    from llmlab.request import Request


class HostTiers:
    """Swap space and offload tier of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager`
    (see the module)."""

    __slots__ = ()  # the manager is slotted; its fields hold this mixin's state

    # -- swap preemption -----------------------------------------------------------------

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

    # -- the offload tier ----------------------------------------------------------------

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

    def _spill(self, block_ids: list[int]) -> None:
        """Copy dropped prefix blocks (their content still valid: nothing wrote them yet)
        into the offload tier, under their index entries."""
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

    # -- what the executor and the scheduler take ----------------------------------------

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

    def _record(self, kind: str, blocks: tuple[tuple[int, int], ...]) -> None:
        """Queue a transfer; copy-on-write copies queued before it go first, so the
        executor's order (transfers, then block copies) is the order of events here."""
        if self._pending_copies:
            self._transfers.append(KVTransfer("copy", tuple(self._pending_copies)))
            self._pending_copies = []
        self._transfers.append(KVTransfer(kind, blocks))

    def _check_tiers(self) -> None:
        """The host pools' invariants, and no request in both the device and swap pools."""
        if self.swap is not None:
            self.swap.check()
            both = sorted(set(self.swap.tables()) & set(self._tables))
            if both:
                raise AssertionError(f"requests {both[:4]} hold device and swap blocks at once")
        if self.tier is not None:
            self.tier.check()
