"""Eviction policies: which cached free block to reclaim when the pool runs out.

A policy sees only cached blocks whose reference count dropped to zero. The pool calls
``on_free`` when a block becomes such a candidate, ``on_hit`` when a prefix-cache hit
reuses a block (candidate or not, so frequency-based policies can count), and ``evict``
when it needs one back. A new policy is a class with these three methods.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from llmlab.cache.block_pool import Block


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def on_free(self, block: Block) -> None:
        """``block`` (cached, ref count 0) became evictable."""

    def on_hit(self, block: Block) -> None:
        """A prefix-cache hit took a reference on ``block``; drop it from the candidates."""

    def evict(self) -> Block:
        """Remove and return the candidate to reclaim. Called only when one exists."""


@attrs.define
class LRUEviction:
    """Least recently freed first (vLLM / SGLang radix-cache default).

    Ties among blocks freed by one request are broken tail-of-chain first because the pool
    releases a request's blocks in reverse order.
    """

    name: str = "lru"
    _order: OrderedDict[int, Block] = attrs.field(factory=OrderedDict)

    def on_free(self, block: Block) -> None:
        self._order[block.block_id] = block

    def on_hit(self, block: Block) -> None:
        self._order.pop(block.block_id, None)

    def evict(self) -> Block:
        _, block = self._order.popitem(last=False)
        return block


@attrs.define
class FIFOEviction:
    """First cached, first evicted: hits do not refresh a block's place in line."""

    name: str = "fifo"
    _order: OrderedDict[int, Block] = attrs.field(factory=OrderedDict)
    _queued_at: dict[int, int] = attrs.field(factory=dict)
    _clock: int = 0

    def on_free(self, block: Block) -> None:
        # A block keeps its original insertion time across reuse.
        self._queued_at.setdefault(block.block_id, self._clock)
        self._clock += 1
        self._order[block.block_id] = block

    def on_hit(self, block: Block) -> None:
        self._order.pop(block.block_id, None)

    def evict(self) -> Block:
        block_id = min(self._order, key=self._queued_at.__getitem__)
        self._queued_at.pop(block_id)
        return self._order.pop(block_id)


@attrs.define
class RandomEviction:
    """Uniformly random candidate; the baseline any smarter policy must beat."""

    name: str = "random"
    seed: int = 0
    _candidates: dict[int, Block] = attrs.field(factory=dict)
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def on_free(self, block: Block) -> None:
        self._candidates[block.block_id] = block

    def on_hit(self, block: Block) -> None:
        self._candidates.pop(block.block_id, None)

    def evict(self) -> Block:
        block_id = self._rng.choice(list(self._candidates))
        return self._candidates.pop(block_id)


EVICTION_POLICIES: dict[str, type] = {
    "lru": LRUEviction,
    "fifo": FIFOEviction,
    "random": RandomEviction,
}
