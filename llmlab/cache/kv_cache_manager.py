"""Per-request KV block accounting on top of the block pool and the prefix index.

The scheduler talks only to this class: find a request's cached prefix, reserve blocks for
the tokens it will compute this step (all or nothing), register blocks once their KV is
computed, and give everything back when the request finishes, is aborted or is preempted.
Each call records what happened to which block; the engine drains that record into the
step's :class:`~llmlab.engine.events.StepEvent`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from llmlab.cache.block_pool import Block, BlockPool
from llmlab.cache.eviction import EvictionPolicy, LRUEviction
from llmlab.cache.prefix_index import PrefixIndex, extend_block_hashes

if TYPE_CHECKING:
    from llmlab.request import Request


@attrs.frozen
class BlockEvents:
    """Block ids touched since the last drain, in the order it happened."""

    allocated: tuple[int, ...] = ()
    freed: tuple[int, ...] = ()
    prefix_hits: tuple[int, ...] = ()
    evicted: tuple[int, ...] = ()


@attrs.frozen
class CacheSnapshot:
    """Immutable picture of every block, for views and tests."""

    ref_counts: tuple[int, ...]
    cached: tuple[bool, ...]
    block_tables: dict[str, tuple[int, ...]]
    num_free_blocks: int


@attrs.define
class KVCacheManager:
    """Paged KV accounting with automatic prefix caching.

    Args:
        num_blocks: physical blocks in the KV tensors.
        block_size: tokens per block.
        enable_prefix_caching: index full blocks by content and reuse them across requests.
        eviction: chooses which cached free block is reclaimed first (default LRU).
    """

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    eviction: EvictionPolicy = attrs.field(factory=LRUEviction)
    pool: BlockPool = attrs.field(init=False)
    index: PrefixIndex = attrs.field(init=False, factory=PrefixIndex)
    _blocks_of: dict[str, list[Block]] = attrs.field(init=False, factory=dict)
    _num_indexed: dict[str, int] = attrs.field(init=False, factory=dict)
    _log: dict[str, list[int]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        self.pool = BlockPool(self.num_blocks, self.eviction)
        self._log = {"allocated": [], "freed": [], "prefix_hits": [], "evicted": []}

    # -- queries -----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks_of.get(request_id, ())]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix lookup -----------------------------------------------------------------

    def lookup_prefix(self, request: Request) -> list[Block]:
        """Longest run of cached full blocks matching the start of the request's tokens.

        The last token is never covered: the model must compute at least one position to
        produce the next token's logits.
        """
        if not self.enable_prefix_caching:
            return []
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens, self.block_size)
        max_blocks = (len(tokens) - 1) // self.block_size
        hits: list[Block] = []
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.index.get(block_hash, tuple(tokens[i * bs : (i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits

    # -- allocation --------------------------------------------------------------------

    def allocate(
        self, request: Request, num_new_tokens: int, prefix_blocks: list[Block] = ()
    ) -> bool:
        """Reserve blocks so ``num_new_tokens`` more tokens of ``request`` can be stored.

        ``prefix_blocks`` (from :meth:`lookup_prefix`, for a request being admitted) are
        shared, not copied. All or nothing: on ``False`` no state changed.
        """
        held = self._blocks_of.get(request.request_id, [])
        # ``num_computed_tokens`` does not yet include the prefix hit (the scheduler
        # advances it only once the allocation succeeded).
        hit_tokens = len(prefix_blocks) * self.block_size
        total_tokens = request.num_computed_tokens + hit_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(held) - len(prefix_blocks)
        # Hit blocks that are currently free would be revived, not taken from the free pool,
        # so they cannot also count as capacity for the new blocks.
        revived = sum(1 for b in prefix_blocks if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free_blocks - revived:
            return False
        if prefix_blocks:
            for block in prefix_blocks:
                self.pool.touch(block)
            self._log["prefix_hits"].extend(b.block_id for b in prefix_blocks)
            self._num_indexed[request.request_id] = len(prefix_blocks)
        new_blocks: list[Block] = []
        if num_new_blocks > 0:
            new_blocks, evicted = self.pool.allocate(num_new_blocks)
            for block in evicted:
                self.index.remove(block)
                self.pool.clear_hash(block)
            self._log["evicted"].extend(b.block_id for b in evicted)
            self._log["allocated"].extend(b.block_id for b in new_blocks)
        self._blocks_of[request.request_id] = held + list(prefix_blocks) + new_blocks
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index the request's blocks that became full of computed KV."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        blocks = self._blocks_of.get(rid)
        if not blocks:
            return
        bs = self.block_size
        num_full = request.num_computed_tokens // bs
        start = self._num_indexed.get(rid, 0)
        if num_full <= start:
            return
        tokens = request.all_token_ids
        extend_block_hashes(request.block_hashes, tokens[: num_full * bs], bs)
        for i in range(start, num_full):
            block = blocks[i]
            block_hash = request.block_hashes[i]
            # Two requests may compute the same content at once; the first one indexed
            # wins and the duplicate stays private (it goes back to the empty list on free).
            if block.block_hash is None and not self.index.contains(block_hash):
                self.index.insert(block, block_hash, tuple(tokens[i * bs : (i + 1) * bs]))
        self._num_indexed[rid] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds (finish, abort or preemption)."""
        blocks = self._blocks_of.pop(request.request_id, None)
        self._num_indexed.pop(request.request_id, None)
        if not blocks:
            return
        freed = self.pool.release(list(reversed(blocks)))
        self._log["freed"].extend(b.block_id for b in freed)

    # -- observation -------------------------------------------------------------------

    def drain_events(self) -> BlockEvents:
        events = BlockEvents(**{k: tuple(v) for k, v in self._log.items()})
        for v in self._log.values():
            v.clear()
        return events

    def snapshot(self) -> CacheSnapshot:
        blocks = self.pool.blocks
        return CacheSnapshot(
            ref_counts=tuple(b.ref_count for b in blocks),
            cached=tuple(b.block_hash is not None for b in blocks),
            block_tables={rid: tuple(b.block_id for b in bl) for rid, bl in self._blocks_of.items()},
            num_free_blocks=self.num_free_blocks,
        )
