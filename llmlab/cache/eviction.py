"""Eviction policies: which cached free blocks to reclaim when the pool runs out.

A policy sees block ids only, and only those of cached blocks whose reference count dropped
to zero (the *candidates*). The pool calls

* ``on_free(block_ids)`` when blocks become candidates, in release order (a request's
  blocks tail first);
* ``on_hit(block_ids)`` when a prefix-cache hit takes a reference on blocks, candidates or
  not, so frequency-based policies can count; the candidates among them stop being ones;
* ``evict(n)`` when it needs ``n`` blocks back, only when at least ``n`` candidates exist.

A new policy is a class with a ``name`` and these three methods. The pool checks what
``evict`` returns and survives a policy that raises (see :class:`~llmlab.cache.block_pool.
BlockPool`), but a policy's own bookkeeping should cost O(1) or O(log n) per block: pools
hold millions of blocks, so a scan over the candidates on each call is too slow.
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def on_free(self, block_ids: Sequence[int]) -> None:
        """These cached blocks (ref count now 0) became evictable, in release order."""

    def on_hit(self, block_ids: Sequence[int]) -> None:
        """A prefix-cache hit took a reference on these blocks; drop them from the candidates."""

    def evict(self, n: int) -> list[int]:
        """Remove and return ``n`` candidates. Called only when at least ``n`` exist."""


@attrs.define
class LRUEviction:
    """Least recently freed first (vLLM's free-block queue, SGLang's radix-cache default).

    An ``OrderedDict`` in freeing order gives O(1) per block for all three calls. Among the
    blocks one request frees together, the tail of its chain goes first because the pool
    releases a request's blocks tail first: a prefix is shared by more future requests than
    its continuation.
    """

    name: str = "lru"
    _order: OrderedDict[int, None] = attrs.field(factory=OrderedDict, repr=False)

    def on_free(self, block_ids: Sequence[int]) -> None:
        # A freed block is never a candidate already: each one lands at the back.
        order = self._order
        for block_id in block_ids:
            order[block_id] = None

    def on_hit(self, block_ids: Sequence[int]) -> None:
        pop = self._order.pop
        for block_id in block_ids:
            pop(block_id, None)

    def evict(self, n: int) -> list[int]:
        popitem = self._order.popitem
        return [popitem(last=False)[0] for _ in range(n)]


@attrs.define
class FIFOEviction:
    """First cached, first evicted: FIFO page replacement (Belady, "A study of replacement
    algorithms for a virtual-storage computer", IBM Systems Journal, 1966), no second chance.

    A block's place in line is the time it first became a candidate; hits and later frees
    do not refresh it, so a block keeps that time across reuse until it is evicted. A heap
    of ``(queued_at, block_id)`` with lazy deletion gives O(log n) per block: a hit only
    removes the block from ``_candidates``, and ``evict`` skips heap entries of blocks that
    are not candidates now (they are pushed again, with their old time, when freed again).
    """

    name: str = "fifo"
    _queued_at: dict[int, int] = attrs.field(factory=dict, repr=False)
    _candidates: set[int] = attrs.field(factory=set, repr=False)
    _heap: list[tuple[int, int]] = attrs.field(factory=list, repr=False)
    # Blocks with an entry in ``_heap``; keeps one entry per block however often it cycles.
    _in_heap: set[int] = attrs.field(factory=set, repr=False)
    _clock: int = attrs.field(default=0, repr=False)

    def on_free(self, block_ids: Sequence[int]) -> None:
        new_entries = []
        for block_id in block_ids:
            queued_at = self._queued_at.setdefault(block_id, self._clock)
            self._clock += 1
            self._candidates.add(block_id)
            if block_id not in self._in_heap:
                self._in_heap.add(block_id)
                new_entries.append((queued_at, block_id))
        if len(new_entries) > len(self._heap):
            # A big batch (e.g. a cold pool filling up): heapify is O(n), pushes O(n log n).
            self._heap.extend(new_entries)
            heapq.heapify(self._heap)
        else:
            for entry in new_entries:
                heapq.heappush(self._heap, entry)

    def on_hit(self, block_ids: Sequence[int]) -> None:
        discard = self._candidates.discard
        for block_id in block_ids:
            discard(block_id)

    def evict(self, n: int) -> list[int]:
        evicted: list[int] = []
        while len(evicted) < n:
            _, block_id = heapq.heappop(self._heap)
            self._in_heap.discard(block_id)
            if block_id in self._candidates:
                self._candidates.remove(block_id)
                del self._queued_at[block_id]
                evicted.append(block_id)
        return evicted


@attrs.define
class RandomEviction:
    """Uniformly random candidate (RAND in Belady 1966); the baseline to beat.

    Candidates live in a list with a position map, so removal is a swap with the last
    element and every call is O(1) per block. The same ``seed`` and the same calls give
    the same evictions.
    """

    name: str = "random"
    seed: int = 0
    _candidates: list[int] = attrs.field(factory=list, repr=False)
    _position: dict[int, int] = attrs.field(factory=dict, repr=False)
    _rng: random.Random = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def on_free(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if block_id not in self._position:
                self._position[block_id] = len(self._candidates)
                self._candidates.append(block_id)

    def on_hit(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            position = self._position.get(block_id)
            if position is not None:
                self._remove_at(position)

    def evict(self, n: int) -> list[int]:
        randrange = self._rng.randrange
        return [self._remove_at(randrange(len(self._candidates))) for _ in range(n)]

    def _remove_at(self, position: int) -> int:
        block_id = self._candidates[position]
        last = self._candidates.pop()
        if last != block_id:
            self._candidates[position] = last
            self._position[last] = position
        del self._position[block_id]
        return block_id


EVICTION_POLICIES: dict[str, type] = {
    "lru": LRUEviction,
    "fifo": FIFOEviction,
    "random": RandomEviction,
}
