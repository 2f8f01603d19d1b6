"""Block sharing between requests, and the copies it costs (copy-on-write).

A block may be held by several requests: a prefix hit shares a cached block, and
:meth:`~CopyOnWrite.fork` gives a new request (a parallel sample) every block of its
parent. Nobody copies anything until a request is about to write into a block it shares:
then ``allocate`` swaps a fresh block into its table and queues a copy of the computed KV
(``_blocks_written_in_place`` finds those blocks, ``_copy_on_write`` swaps them in), which
the executor takes through :meth:`~CopyOnWrite.take_block_copies` and applies before the
next forward pass. :class:`CopyOnWrite` is a mixin of
:class:`~llmlab.cache.kv_cache_manager.KVCacheManager`: its methods are the manager's
(``kv.fork(parent, child)``), working on the state declared there (``_tables``,
``_pending_copies``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmlab.request import Request


class CopyOnWrite:
    """Sharing and copy-on-write of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager`
    (see the module)."""

    __slots__ = ()  # the manager is slotted; its fields hold this mixin's state

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

    def take_block_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies ``(src_block, dst_block)`` since the last call.

        The executor applies them to the KV tensors, in this order (a copy may read a block
        an earlier one wrote), before the next forward pass.
        """
        copies, self._pending_copies = self._pending_copies, []
        return copies

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

