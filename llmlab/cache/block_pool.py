"""Physical KV blocks: reference counts, cached flags, and the pool that hands them out.

A block is in exactly one of three states:

* **in use** (``ref_count > 0``): held by one or more requests, cached or not;
* **cached free** (``ref_count == 0``, cached): its KV is still valid and findable through the
  prefix index; it is an eviction *candidate*, and the policy decides which goes first;
* **empty** (``ref_count == 0``, not cached): handed out before any cached block.

There is no Python object per block: state is two numpy arrays indexed by block id, and the
empty blocks are a high-water mark (ids never handed out) plus a deque of returned ids, so a
pool of 10^7 blocks builds in milliseconds and every operation costs O(1) per block (plus
the policy's own O(1) or O(log n)). Operations take batches of distinct block ids: small
batches are walked in Python through memoryviews of the arrays, large ones in numpy.

The pool owns the mechanism; the :class:`~llmlab.cache.eviction.EvictionPolicy` only orders
the candidates. The policy is user code, so every call into it is guarded: a policy method
that raises is assumed to have changed nothing, and the pool makes its own state match that
assumption before raising :class:`~llmlab.errors.ComponentError`. Assigning a new policy
(``pool.eviction = LRUEviction()``) hands it every current candidate, which restores
agreement whatever a failed policy did. What the pool checks (the ids callers pass, the
policy's answers, its invariants) is in :mod:`llmlab.cache.pool_checks`, a mixin.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from llmlab.cache.eviction import EvictionPolicy
from llmlab.cache.pool_checks import POLICY_KIND, PoolChecks, at_least_one, shown_ids
from llmlab.errors import ComponentError

# Below this many ids a Python loop over memoryviews beats numpy's fixed cost per call
# (~1 us each); above it, one vectorized call per step wins. Typical batches (a request's
# blocks) are small; a long prefill or a pool-wide fill is large.
VECTOR_MIN_IDS = 64


# No attrs hooks on assignment: counters change on every call, and a hook would put a
# Python-level __setattr__ in the hot path. ``num_blocks`` is fixed after construction.
@attrs.define(on_setattr=attrs.setters.NO_OP)
class BlockPool(PoolChecks):
    """``num_blocks`` KV blocks with reference counts, cached flags and a free list.

    Prefix-cache bookkeeping (which hash names which block) lives in
    :class:`~llmlab.cache.prefix_index.PrefixIndex`; the pool calls ``on_drop(block_ids)``
    whenever blocks lose their cached content (eviction, ``drop_cached``, or a failed
    policy call) so the index forgets them at once.
    """

    num_blocks: int = attrs.field(validator=at_least_one)
    _eviction: EvictionPolicy = attrs.field(alias="eviction")
    on_drop: Callable[[list[int]], None] | None = None
    ref_counts: np.ndarray = attrs.field(init=False, repr=False)
    cached: np.ndarray = attrs.field(init=False, repr=False)
    # The same memory as ``ref_counts`` and ``cached``: reading or writing one element
    # through a memoryview costs a fraction of numpy's scalar indexing.
    _refs: memoryview = attrs.field(init=False, repr=False)
    _cached_flags: memoryview = attrs.field(init=False, repr=False)
    # Ids at or above this were never handed out: empty without being listed anywhere.
    _next_unused: int = attrs.field(init=False, default=0)
    _returned_empty: deque[int] = attrs.field(init=False, factory=deque, repr=False)
    _num_cached_free: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        # np.zeros maps zeroed pages lazily: building costs nothing per block.
        self.ref_counts = np.zeros(self.num_blocks, np.int32)
        self.cached = np.zeros(self.num_blocks, np.bool_)
        self._refs = memoryview(self.ref_counts)
        self._cached_flags = memoryview(self.cached)

    # -- the policy ----------------------------------------------------------------------

    @property
    def eviction(self) -> EvictionPolicy:
        return self._eviction

    @eviction.setter
    def eviction(self, policy: EvictionPolicy) -> None:
        """Swap the policy; the new one learns every current candidate (in block id order)."""
        self._eviction = policy
        candidates = self.cached_free_block_ids()
        if candidates:
            try:
                policy.on_free(candidates)
            except Exception as err:
                self._drop_to_empty(candidates)
                raise ComponentError.wrap(POLICY_KIND, policy, "on_free", err) from err

    # -- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: empty ones plus evictable cached ones."""
        return self.num_empty_blocks + self._num_cached_free

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def num_empty_blocks(self) -> int:
        return self.num_blocks - self._next_unused + len(self._returned_empty)

    def num_idle(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks no request holds (ref count 0)."""
        refs = self._refs
        return sum(1 for block_id in block_ids if refs[block_id] == 0)

    def cached_free_block_ids(self) -> list[int]:
        """Ids of the eviction candidates (O(num_blocks); for swaps and checks)."""
        return np.flatnonzero(self.cached & (self.ref_counts == 0)).tolist()

    # -- operations ----------------------------------------------------------------------

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        """Take ``n`` blocks at ref count 1. Returns ``(block_ids, evicted_block_ids)``.

        Empty blocks go first; only then are candidates evicted, in the policy's order, and
        ``on_drop`` is told. The caller checks :attr:`num_free_blocks` first; asking for more
        is a bug (``RuntimeError``). If the policy fails, raises ``ComponentError`` with no
        block taken (see :meth:`_evict`).
        """
        if not 0 <= n <= self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        num_evicted = max(0, n - self.num_empty_blocks)
        # Evict first: it is the step that can fail, and nothing is taken yet if it does.
        evicted = self._evict(num_evicted) if num_evicted else []
        block_ids = self._take_empty(n - num_evicted)
        block_ids += evicted
        if evicted:
            self._set_flags(self.cached, self._cached_flags, evicted, False)
            self._num_cached_free -= len(evicted)
        if n < VECTOR_MIN_IDS:
            refs = self._refs
            for block_id in block_ids:
                refs[block_id] = 1
        else:
            self.ref_counts[block_ids] = 1
        if evicted and self.on_drop is not None:
            self.on_drop(evicted)
        return block_ids, evicted

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block found through the prefix index.

        The policy hears of the hit first; if it raises, nothing changed here.
        """
        ids = self._checked_ids(block_ids, VECTOR_MIN_IDS)
        if ids is None:
            refs, cached = self._refs, self._cached_flags
            for block_id in block_ids:
                if refs[block_id] == 0 and not cached[block_id]:
                    raise RuntimeError(f"block {block_id} touched while empty (not cached)")
        else:
            empty = (self.ref_counts[ids] == 0) & ~self.cached[ids]
            if empty.any():
                raise RuntimeError(f"block {ids[empty][0]} touched while empty (not cached)")
        try:
            self._eviction.on_hit(list(block_ids))
        except Exception as err:
            raise ComponentError.wrap(POLICY_KIND, self._eviction, "on_hit", err) from err
        self._num_cached_free -= self._add_refs(block_ids, ids, 1)

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on blocks already in use (a fork); no policy involved."""
        ids = self._checked_ids(block_ids, VECTOR_MIN_IDS)
        self._require_in_use(block_ids, ids, "shared")
        self._add_refs(block_ids, ids, 1)

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference from each block; returns the ids that became free, in order.

        Callers pass a request's blocks tail first so that, among blocks freed together, the
        policy sees the end of a chain before its prefix. Freed cached blocks become
        candidates through one ``on_free`` call; if it raises, they are freed as empty
        instead (uncached, ``on_drop`` told) and ``ComponentError`` is raised.
        """
        ids = self._checked_ids(block_ids, VECTOR_MIN_IDS)
        self._require_in_use(block_ids, ids, "released")
        self._add_refs(block_ids, ids, -1)
        if ids is None:
            refs, cached = self._refs, self._cached_flags
            freed = [block_id for block_id in block_ids if refs[block_id] == 0]
            candidates = [block_id for block_id in freed if cached[block_id]]
            if len(candidates) < len(freed):
                self._returned_empty.extend(b for b in freed if not cached[b])
        else:
            freed_ids = ids[self.ref_counts[ids] == 0]
            freed_cached = self.cached[freed_ids]
            self._returned_empty.extend(freed_ids[~freed_cached].tolist())
            candidates = freed_ids[freed_cached].tolist()
            freed = freed_ids.tolist()
        if candidates:
            self._num_cached_free += len(candidates)
            try:
                self._eviction.on_free(candidates)
            except Exception as err:
                self._drop_to_empty(candidates)
                raise ComponentError.wrap(POLICY_KIND, self._eviction, "on_free", err) from err
        return freed

    def mark_cached(self, block_ids: Sequence[int]) -> None:
        """Flag in-use blocks as holding indexed content (they become candidates once freed)."""
        ids = self._checked_ids(block_ids, VECTOR_MIN_IDS)
        self._require_in_use(block_ids, ids, "marked cached")
        if self._num_flagged(block_ids, ids) != 0:
            raise RuntimeError(f"a block among {shown_ids(block_ids)} is cached already")
        self._set_flags(self.cached, self._cached_flags, block_ids, True)

    def drop_cached(self, block_ids: Sequence[int]) -> None:
        """Forget the cached content of in-use blocks (they will be overwritten).

        Only blocks in use: a candidate's place is the policy's, which has no call to remove
        one without a hit.
        """
        ids = self._checked_ids(block_ids, VECTOR_MIN_IDS)
        self._require_in_use(block_ids, ids, "dropped from the cache")
        if self._num_flagged(block_ids, ids) != len(block_ids):
            raise RuntimeError(f"a block among {shown_ids(block_ids)} is not cached")
        self._set_flags(self.cached, self._cached_flags, block_ids, False)
        if self.on_drop is not None:
            self.on_drop(list(block_ids))

    # -- internals -----------------------------------------------------------------------

    def _add_refs(self, block_ids: Sequence[int], ids: np.ndarray | None, delta: int) -> int:
        """Add ``delta`` to each ref count; returns how many were 0 before."""
        if ids is None:
            refs = self._refs
            num_were_idle = 0
            for block_id in block_ids:
                count = refs[block_id]
                num_were_idle += count == 0
                refs[block_id] = count + delta
            return num_were_idle
        counts = self.ref_counts[ids]
        self.ref_counts[ids] = counts + delta
        return int(np.count_nonzero(counts == 0))

    def _num_flagged(self, block_ids: Sequence[int], ids: np.ndarray | None) -> int:
        """How many of these blocks are cached."""
        if ids is None:
            cached = self._cached_flags
            return sum(1 for block_id in block_ids if cached[block_id])
        return int(np.count_nonzero(self.cached[ids]))

    @staticmethod
    def _set_flags(
        flags: np.ndarray, flag_view: memoryview, block_ids: Sequence[int], value: bool
    ) -> None:
        if len(block_ids) < VECTOR_MIN_IDS:
            for block_id in block_ids:
                flag_view[block_id] = value
        else:
            flags[block_ids] = value

    def _take_empty(self, n: int) -> list[int]:
        """``n`` empty ids: never-used ones first (as a fresh pool would), then returned ones."""
        num_unused = min(n, self.num_blocks - self._next_unused)
        block_ids = list(range(self._next_unused, self._next_unused + num_unused))
        self._next_unused += num_unused
        popleft = self._returned_empty.popleft
        block_ids.extend(popleft() for _ in range(n - num_unused))
        return block_ids

    def _drop_to_empty(self, candidates: list[int]) -> None:
        """Turn cached free blocks into empty ones (the policy does not track them)."""
        self._set_flags(self.cached, self._cached_flags, candidates, False)
        self._num_cached_free -= len(candidates)
        self._returned_empty.extend(candidates)
        if self.on_drop is not None:
            self.on_drop(candidates)

    def _evict(self, n: int) -> list[int]:
        """``n`` candidates from the policy, checked; ``ComponentError`` if it fails (see
        ``_checked_eviction``)."""
        policy = self._eviction
        try:
            answer = list(policy.evict(n))
        except Exception as err:
            raise ComponentError.wrap(POLICY_KIND, policy, "evict", err) from err
        if n >= VECTOR_MIN_IDS and self._is_valid_eviction_vectorized(answer, n):
            return [int(block_id) for block_id in answer]
        return self._checked_eviction(answer, n)
