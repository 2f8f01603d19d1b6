"""Physical KV blocks: ids, reference counts, and the pool that hands them out.

A block is in exactly one of three states:

* **in use** (``ref_count > 0``): held by one or more running requests;
* **cached** (``ref_count == 0`` with a hash): free, but its KV is still valid and findable
  through the prefix index; the eviction policy decides which of these is reclaimed first;
* **empty** (``ref_count == 0``, no hash): on the plain free list, reused first.

The pool owns the mechanism (counting, moving blocks between states); the
:class:`~llmlab.cache.eviction.EvictionPolicy` only chooses among cached blocks.
"""

from __future__ import annotations

from collections import deque

import attrs

from llmlab.cache.eviction import EvictionPolicy


@attrs.define(eq=False)
class Block:
    """One KV block. ``token_ids`` are kept with the hash to verify prefix hits."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@attrs.define
class BlockPool:
    """Fixed set of ``num_blocks`` blocks with reference counting and a free list.

    Prefix-cache bookkeeping (which hash maps to which block) lives in
    :class:`~llmlab.cache.prefix_index.PrefixIndex`; the pool calls ``on_evict`` so the
    index can forget a block the moment its contents are overwritten.
    """

    num_blocks: int
    eviction: EvictionPolicy
    blocks: list[Block] = attrs.field(init=False)
    _empty: deque[int] = attrs.field(init=False)
    _num_cached_free: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._empty = deque(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones plus evictable cached ones."""
        return len(self._empty) + self._num_cached_free

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    def allocate(self, n: int) -> tuple[list[Block], list[Block]]:
        """Take ``n`` blocks (ref count 1). Returns ``(blocks, evicted)``.

        Empty blocks go first; only then are cached blocks evicted, in the policy's order.
        ``evicted`` lists the blocks whose cached contents were dropped (their hash is still
        set so the caller can remove it from the index, then :meth:`clear_hash`).
        The caller must check :attr:`num_free_blocks` first; asking for more raises.
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        taken: list[Block] = []
        evicted: list[Block] = []
        for _ in range(n):
            if self._empty:
                block = self.blocks[self._empty.popleft()]
            else:
                block = self.eviction.evict()
                self._num_cached_free -= 1
                evicted.append(block)
            block.ref_count = 1
            taken.append(block)
        return taken, evicted

    def touch(self, block: Block) -> None:
        """Take one more reference on a block found through the prefix index."""
        if block.ref_count == 0:
            # Reviving a cached free block: it stops being an eviction candidate.
            self._num_cached_free -= 1
        self.eviction.on_hit(block)
        block.ref_count += 1

    def release(self, blocks: list[Block]) -> list[Block]:
        """Drop one reference from each block; returns the blocks that became free.

        Blocks are released in the order given; callers pass a request's blocks tail first
        so that, among blocks freed together, the end of a chain is evicted before its
        prefix (a prefix is shared by more future requests than its continuation).
        """
        freed = []
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_count 0")
            block.ref_count -= 1
            if block.ref_count == 0:
                freed.append(block)
                if block.block_hash is None:
                    self._empty.append(block.block_id)
                else:
                    self._num_cached_free += 1
                    self.eviction.on_free(block)
        return freed

    def clear_hash(self, block: Block) -> None:
        block.block_hash = None
        block.token_ids = None
