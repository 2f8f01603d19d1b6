"""Automatic prefix caching: the KV cache manager's use of the prefix index.

Full blocks of computed KV are indexed by their chained hash
(:class:`~llmlab.cache.prefix_index.PrefixIndex`) and found again by later requests with
the same first tokens; a cached block no request holds stays valid until the eviction
policy (``kv.eviction``) lets the pool reclaim it, and ``_forget``, the block pool's
``on_drop`` hook, takes it out of the index then. :class:`PrefixCaching` is a mixin of
:class:`~llmlab.cache.kv_cache_manager.KVCacheManager`: its methods are the manager's
(``kv.lookup_prefix(request)``, ``kv.cache_computed_blocks(request)``), working on the
state declared there (``index``, ``_num_indexed``). Hits are taken by
``allocate(request, n, prefix_blocks)`` in the core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmlab import registry
from llmlab.cache.prefix_index import extend_block_hashes

if TYPE_CHECKING:
    from llmlab.cache.eviction import EvictionPolicy
    from llmlab.request import Request


class PrefixCaching:
    """Prefix lookups and indexing of :class:`~llmlab.cache.kv_cache_manager.KVCacheManager`
    (see the module)."""

    __slots__ = ()  # the manager is slotted; its fields hold this mixin's state

    @property
    def eviction(self) -> EvictionPolicy:
        """Orders the cached free blocks (the prefix cache's eviction candidates)."""
        return self.pool.eviction

    @eviction.setter
    def eviction(self, policy: EvictionPolicy) -> None:
        registry.check("eviction_policy", policy)
        self._initial_eviction = policy
        self.pool.eviction = policy

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

    def _forget(self, block_ids: list[int]) -> None:
        """The pool dropped these blocks' cached content: the index must not find them.
        With a second tier, the content (still valid now: nothing wrote the blocks yet)
        spills there first."""
        if self.tier is not None and self._spilling:
            self._spill(block_ids)
        self.index.remove(block_ids)
        self._log["evicted"].extend(block_ids)
