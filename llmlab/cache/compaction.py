"""KV press compaction reservations of the KV cache manager (:mod:`llmlab.kvpress`).

A KV press keeps a selection of a request's tokens; after the step's forward pass the
executor moves their KV into blocks reserved here, and the request's table becomes those
blocks. :class:`Compaction` is a mixin of
:class:`~llmlab.cache.kv_cache_manager.KVCacheManager`: its methods are the manager's
(``kv.begin_compaction(request, n)``), called by the press's scheduler side
(``llmlab.kvpress.schedule``), and its state is declared there: ``_compacting`` (fresh
blocks reserved per request) and ``_in_place`` (in a full pool, how many of its own first
blocks a request compacts into).

Where the core calls in: ``free`` cancels a request's reservation, ``cache_computed_blocks``
skips a request compacting in place (its blocks are about to be rewritten), and ``check``
counts reserved blocks as held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmlab.request import Request


class Compaction:
    """Compaction reservations of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager`
    (see the module)."""

    __slots__ = ()  # the manager is slotted; its fields hold this mixin's state

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
