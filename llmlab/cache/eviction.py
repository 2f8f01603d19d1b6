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
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from llmlab.registry import register, table


@runtime_checkable
class EvictionPolicy(Protocol):
    """Three calls on block ids (see the module docstring). A complete example, most
    recently freed first, in a dict's insertion order::

        @register("eviction_policy", "mru")
        class MostRecentlyFreed:
            name = "mru"

            def __init__(self):
                self.order = {}

            def on_free(self, block_ids):
                self.order.update(dict.fromkeys(block_ids))

            def on_hit(self, block_ids):
                for block_id in block_ids:
                    self.order.pop(block_id, None)

            def evict(self, n):
                return [self.order.popitem()[0] for _ in range(n)]
    """

    name: str

    def on_free(self, block_ids: Sequence[int]) -> None:
        """These cached blocks (ref count now 0) became evictable, in release order."""

    def on_hit(self, block_ids: Sequence[int]) -> None:
        """A prefix-cache hit took a reference on these blocks; drop them from the candidates."""

    def evict(self, n: int) -> list[int]:
        """Remove and return ``n`` candidates. Called only when at least ``n`` exist."""


@register("eviction_policy", "lru")
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
class _KeptPlaceQueue:
    """Block ids in order of a queue time that stays theirs while they are in use.

    A block joins with the largest time yet, at the back of a deque: O(1). ``pop_oldest``
    returns the candidate with the smallest time; a block in use that it passes loses its
    entry and is remembered in ``passed``, and ``rejoin`` puts it back with its old time
    once it is freed, into a heap of such returns: O(log r) for r of them. The oldest
    entry is the smaller of the two fronts. Every other block the owner put in keeps its
    one entry however often it cycles through use, so ``passed`` is the only membership
    kept, and it stays small.
    """

    _joined: deque[tuple[int, int]] = attrs.field(factory=deque)
    _returned: list[tuple[int, int]] = attrs.field(factory=list)
    passed: set[int] = attrs.field(factory=set)

    def __len__(self) -> int:
        return len(self._joined) + len(self._returned)

    def join(self, queued_at: int, block_id: int) -> None:
        """Append ``block_id``; ``queued_at`` must exceed every time given so far."""
        self._joined.append((queued_at, block_id))

    def rejoin(self, queued_at: int, block_id: int) -> None:
        """Put a block from ``passed`` back in line with its old time."""
        self.passed.remove(block_id)
        heapq.heappush(self._returned, (queued_at, block_id))

    def pop_oldest(self, candidates: set[int]) -> int:
        """Remove and return the oldest block in ``candidates`` (one must be here)."""
        joined, returned = self._joined, self._returned
        while True:
            if returned and (not joined or returned[0] < joined[0]):
                block_id = heapq.heappop(returned)[1]
            else:
                block_id = joined.popleft()[1]
            if block_id in candidates:
                return block_id
            self.passed.add(block_id)


@register("eviction_policy", "fifo")
@attrs.define
class FIFOEviction:
    """First cached, first evicted: FIFO page replacement (Belady, "A study of replacement
    algorithms for a virtual-storage computer", IBM Systems Journal, 1966), no second chance.

    A block's place in line is the time it first became a candidate; hits and later frees
    do not refresh it, so a block keeps that time across reuse until it is evicted. The line
    is a :class:`_KeptPlaceQueue`: a hit only removes the block from ``_candidates``, and
    ``evict`` drops the entries of blocks that are not candidates now (they rejoin, with
    their old time, when freed again). O(1) per block, plus O(log r) for the r blocks that
    the front of the line passed while they were in use.
    """

    name: str = "fifo"
    _queued_at: dict[int, int] = attrs.field(factory=dict, repr=False)
    _candidates: set[int] = attrs.field(factory=set, repr=False)
    _line: _KeptPlaceQueue = attrs.field(factory=_KeptPlaceQueue, repr=False)
    _clock: int = attrs.field(default=0, repr=False)

    def on_free(self, block_ids: Sequence[int]) -> None:
        queued_at, line = self._queued_at, self._line
        for block_id in block_ids:
            self._candidates.add(block_id)
            if block_id not in queued_at:
                queued_at[block_id] = self._clock
                line.join(self._clock, block_id)
            elif block_id in line.passed:
                line.rejoin(queued_at[block_id], block_id)
            self._clock += 1

    def on_hit(self, block_ids: Sequence[int]) -> None:
        discard = self._candidates.discard
        for block_id in block_ids:
            discard(block_id)

    def evict(self, n: int) -> list[int]:
        evicted = [self._line.pop_oldest(self._candidates) for _ in range(n)]
        for block_id in evicted:
            self._candidates.remove(block_id)
            del self._queued_at[block_id]
        return evicted


@register("eviction_policy", "random")
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


_MAX_FREQ = 3  # S3-FIFO's two-bit counter
_SMALL, _MAIN = 0, 1  # S3-FIFO's queues


def _check_fraction(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1:
        raise ValueError(f"{attribute.name} must be a number in (0, 1), got {value!r}")


def _check_s3fifo_threshold(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= _MAX_FREQ:
        raise ValueError(f"{attribute.name} must be an int in [1, {_MAX_FREQ}], got {value!r}")


@register("eviction_policy", "lfu")
@attrs.define
class LFUEviction:
    """Fewest prefix-cache hits first, least recently freed among equals: LFU with the
    buckets of Shah, Mitra & Matani, "An O(1) algorithm for implementing the LFU cache
    eviction scheme" (2010).

    A block's count is how many ``on_hit`` calls named it since it was cached, as a
    candidate or in use; eviction forgets it (the id then holds other content). With no
    hits this is LRU, tail of a request's chain first.

    Candidates sit in one bucket per count, an ``OrderedDict`` in freeing order. A count
    changes only on a hit, which takes the block out of the candidates, so a candidate
    never moves between buckets and ``on_free``/``on_hit`` are O(1) per block. Deviation:
    the paper links its buckets in count order, which works because an item only ever
    steps to the next count; a block here comes back from use with any count, so a heap of
    the counts that have a bucket finds the smallest, O(log k) amortized per eviction for k
    distinct counts. Like classic LFU there is no aging: a prefix that was hot long ago
    keeps its count until it is evicted.
    """

    name: str = "lfu"
    _hits: dict[int, int] = attrs.field(init=False, factory=dict, repr=False)
    _buckets: dict[int, OrderedDict[int, None]] = attrs.field(init=False, factory=dict, repr=False)
    # Exactly the keys of ``_buckets``; a bucket that empties stays until evict pops it.
    _counts: list[int] = attrs.field(init=False, factory=list, repr=False)

    def on_free(self, block_ids: Sequence[int]) -> None:
        hits, buckets = self._hits, self._buckets
        for block_id in block_ids:
            count = hits.get(block_id, 0)
            bucket = buckets.get(count)
            if bucket is None:
                bucket = buckets[count] = OrderedDict()
                heapq.heappush(self._counts, count)
            bucket[block_id] = None

    def on_hit(self, block_ids: Sequence[int]) -> None:
        hits, buckets = self._hits, self._buckets
        for block_id in block_ids:
            count = hits.get(block_id, 0)
            bucket = buckets.get(count)
            if bucket is not None:
                bucket.pop(block_id, None)
            hits[block_id] = count + 1

    def evict(self, n: int) -> list[int]:
        counts, buckets, hits = self._counts, self._buckets, self._hits
        evicted: list[int] = []
        while len(evicted) < n:
            bucket = buckets[counts[0]]
            if not bucket:
                del buckets[heapq.heappop(counts)]
                continue
            popitem = bucket.popitem
            for _ in range(min(n - len(evicted), len(bucket))):
                block_id = popitem(last=False)[0]
                hits.pop(block_id, None)
                evicted.append(block_id)
        return evicted


@register("eviction_policy", "arc")
@attrs.define
class ARCEviction:
    """Adaptive Replacement Cache (Megiddo & Modha, "ARC: A Self-Tuning, Low Overhead
    Replacement Cache", FAST 2003), on the candidates and without ghost lists.

    T1 holds candidates never hit since they were cached, T2 those hit at least once (a
    block hit while in use joins T2 when it is freed); each is an ``OrderedDict`` in
    freeing order, so its front is its LRU end (a request's tail first, as in LRU). A hit
    moves a block to T2's MRU end in ARC; here it leaves the candidates and re-enters at
    T2's back when freed. ``evict`` takes T1's front while ``|T1| > p`` (or T2 is empty),
    else T2's front. All three calls are O(1) per block.

    Deviation: ARC adapts the target size ``p`` of T1 on hits in its ghost lists B1/B2
    (pages recently evicted from T1/T2). A block id is reused for other content once
    evicted, so a later ``on_free`` of that id is not a ghost hit, and the interface shows
    no content to remember instead; there are no B1/B2. ``p`` adapts on hits on candidates
    instead, with ARC's step sizes: a hit on a T1 candidate (recency kept it) grows ``p``
    by ``max(1, |T2|/|T1|)``, a hit on a T2 candidate (frequency kept it) shrinks it by
    ``max(1, |T1|/|T2|)``; ``p`` stays in ``[0, |T1|+|T2|]``, the candidates counted at
    that hit, as ARC keeps it in ``[0, c]``. Hits on blocks in use change no ``p``: no list
    kept them. ARC's tie rule (evict from T1 at ``|T1| == p`` after a B2 hit) is dropped.
    """

    name: str = "arc"
    # ARC's ``p``: how many candidates T1 is meant to hold.
    target_recent_size: float = attrs.field(init=False, default=0.0)
    _recent: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict, repr=False)
    _frequent: OrderedDict[int, None] = attrs.field(init=False, factory=OrderedDict, repr=False)
    # Blocks hit since they were cached (candidates in T2 and blocks in use alike).
    _reused: set[int] = attrs.field(init=False, factory=set, repr=False)

    def on_free(self, block_ids: Sequence[int]) -> None:
        recent, frequent, reused = self._recent, self._frequent, self._reused
        for block_id in block_ids:
            if block_id in reused:
                frequent[block_id] = None
            else:
                recent[block_id] = None

    def on_hit(self, block_ids: Sequence[int]) -> None:
        recent, frequent = self._recent, self._frequent
        for block_id in block_ids:
            self._reused.add(block_id)
            num_recent, num_frequent = len(recent), len(frequent)
            if block_id in recent:
                step = max(1.0, num_frequent / num_recent)
                limit = num_recent + num_frequent
                self.target_recent_size = min(self.target_recent_size + step, limit)
                del recent[block_id]
            elif block_id in frequent:
                step = max(1.0, num_recent / num_frequent)
                self.target_recent_size = max(self.target_recent_size - step, 0.0)
                del frequent[block_id]

    def evict(self, n: int) -> list[int]:
        recent, frequent, reused = self._recent, self._frequent, self._reused
        evicted: list[int] = []
        for _ in range(n):
            if recent and (len(recent) > self.target_recent_size or not frequent):
                block_id = recent.popitem(last=False)[0]
            else:
                block_id = frequent.popitem(last=False)[0]
                reused.discard(block_id)
            evicted.append(block_id)
        return evicted


@register("eviction_policy", "s3fifo")
@attrs.define
class S3FIFOEviction:
    """S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023):
    a small FIFO S that filters one-hit blocks and a main FIFO M with reinsertion.

    A block enters S's back when it first becomes a candidate; hits raise its frequency
    (capped at 3, counted in use too) and, as in the paper, move nothing. S is evicted
    while it holds at least ``small_ratio`` of the candidates (else M): S's oldest block
    moves to M's back with frequency 0 if its frequency reached ``move_to_main_threshold``,
    else it is evicted; M's oldest is reinserted at its back with frequency - 1 while
    above 0 (CLOCK), else evicted. Eviction forgets a block's frequency and place.

    A block keeps its place in S or M while it is in use (it still sits in the queue, only
    it cannot be evicted): each queue is a :class:`_KeptPlaceQueue`, as in
    :class:`FIFOEviction`, so every call is O(1) per block (plus O(log r) for blocks the
    front passed while in use); reinsertions are paid for by the hits that raised the
    frequency.

    Deviations: no ghost queue G. In the paper a missed object found in G enters M
    directly; here an evicted id is reused for other content, so a later ``on_free`` of it
    is not a ghost hit, and the interface shows no content to key a ghost on: every block
    enters S. S's share is of the candidates, not of the whole cache (blocks in use
    cannot be evicted), and M has no capacity of its own: it is what S does not hold. The
    SOSP artifact (libCacheSim's ``S3FIFOv0``, which also resets the frequency on the move
    to M) promotes at frequency >= 2 ("more than once"); the default here is 1 (hit at
    least once), as libCacheSim's ``S3FIFOdv2`` does: a KV block hit even once holds a
    prefix that two requests shared.
    """

    name: str = "s3fifo"
    small_ratio: float = attrs.field(default=0.1, validator=_check_fraction)
    move_to_main_threshold: int = attrs.field(default=1, validator=_check_s3fifo_threshold)
    _freq: dict[int, int] = attrs.field(init=False, factory=dict, repr=False)
    _queued_at: dict[int, int] = attrs.field(init=False, factory=dict, repr=False)
    _in_main: set[int] = attrs.field(init=False, factory=set, repr=False)
    _candidates: set[int] = attrs.field(init=False, factory=set, repr=False)
    # Candidates per queue, indexed by _SMALL / _MAIN.
    _num_candidates: list[int] = attrs.field(init=False, factory=lambda: [0, 0], repr=False)
    # S and M, indexed by _SMALL / _MAIN; a block is in the one ``_in_main`` says.
    _queues: tuple[_KeptPlaceQueue, _KeptPlaceQueue] = attrs.field(
        init=False, factory=lambda: (_KeptPlaceQueue(), _KeptPlaceQueue()), repr=False
    )
    _clock: int = attrs.field(init=False, default=0, repr=False)

    def on_free(self, block_ids: Sequence[int]) -> None:
        queued_at, in_main = self._queued_at, self._in_main
        for block_id in block_ids:
            self._candidates.add(block_id)
            queue = _MAIN if block_id in in_main else _SMALL
            self._num_candidates[queue] += 1
            if block_id not in queued_at:
                self._append(_SMALL, block_id)
            elif block_id in self._queues[queue].passed:
                # The front passed it while it was in use: back in line with its old time.
                self._queues[queue].rejoin(queued_at[block_id], block_id)

    def on_hit(self, block_ids: Sequence[int]) -> None:
        freq, candidates = self._freq, self._candidates
        for block_id in block_ids:
            freq[block_id] = min(freq.get(block_id, 0) + 1, _MAX_FREQ)
            if block_id in candidates:
                candidates.remove(block_id)
                self._num_candidates[_MAIN if block_id in self._in_main else _SMALL] -= 1

    def evict(self, n: int) -> list[int]:
        evicted: list[int] = []
        num_candidates = self._num_candidates
        while len(evicted) < n:
            num_small, num_main = num_candidates
            if num_small and (
                not num_main or num_small >= self.small_ratio * (num_small + num_main)
            ):
                block_id = self._evict_small()
            else:
                block_id = self._evict_main()
            if block_id is not None:
                evicted.append(block_id)
        return evicted

    def _evict_small(self) -> int | None:
        """S's oldest candidates move to M until one is evicted; None if S runs out."""
        freq = self._freq
        while self._num_candidates[_SMALL]:
            block_id = self._queues[_SMALL].pop_oldest(self._candidates)
            if freq.get(block_id, 0) < self.move_to_main_threshold:
                return self._forget(block_id, _SMALL)
            freq[block_id] = 0
            self._in_main.add(block_id)
            self._num_candidates[_SMALL] -= 1
            self._num_candidates[_MAIN] += 1
            self._append(_MAIN, block_id)
        return None

    def _evict_main(self) -> int:
        """M's oldest candidates go to its back, one frequency less, until one has none."""
        freq = self._freq
        while True:
            block_id = self._queues[_MAIN].pop_oldest(self._candidates)
            count = freq.get(block_id, 0)
            if not count:
                return self._forget(block_id, _MAIN)
            freq[block_id] = count - 1
            self._append(_MAIN, block_id)

    def _append(self, queue: int, block_id: int) -> None:
        self._queued_at[block_id] = self._clock
        self._queues[queue].join(self._clock, block_id)
        self._clock += 1

    def _forget(self, block_id: int, queue: int) -> int:
        self._candidates.remove(block_id)
        self._num_candidates[queue] -= 1
        self._freq.pop(block_id, None)
        del self._queued_at[block_id]
        self._in_main.discard(block_id)
        return block_id


EVICTION_POLICIES = table("eviction_policy")
"""Registered eviction policies by name (live: includes the ones users register)."""
