"""Checks of a block pool: the ids callers pass, the eviction policy's answers, invariants.

:class:`PoolChecks` is a mixin of :class:`~llmlab.cache.block_pool.BlockPool`: its methods
are the pool's (``pool.check()``), reading the state declared there, so a check costs no
extra call. The pool keeps the mechanism (ref counts, cached flags, the free list, calls
into the policy) and decides which batches take the vectorized path (``VECTOR_MIN_IDS``,
passed to ``_checked_ids``); what it checks lives here:

* ``_checked_ids`` and ``_require_in_use``: the ids a caller passes are distinct, in range
  and (for release, share and the cached flags) held by someone;
* ``_is_valid_eviction_vectorized``, ``_checked_eviction``: an answer to ``evict(n)`` names
  ``n`` distinct cached free blocks (the policy is user code: every answer is checked
  before the pool acts on it, and a bad one leaves pool and policy agreeing);
* :meth:`PoolChecks.check`: every invariant of the pool's state (for tests and
  ``KVCacheManager.check``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from llmlab.errors import ComponentError

# How ComponentError names the pool's policy.
POLICY_KIND = "eviction policy"


def at_least_one(instance: object, attribute: attrs.Attribute, value: object) -> None:
    """attrs validator: ``value`` is an int >= 1 (block counts and sizes)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


class PoolChecks:
    """Input, answer and invariant checks of :class:`~llmlab.cache.block_pool.BlockPool`
    (see the module)."""

    __slots__ = ()  # the pool is slotted; its fields hold the state checked here

    def check(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (O(num_blocks))."""
        refs, cached = self.ref_counts, self.cached
        if (refs < 0).any():
            raise AssertionError(f"negative ref counts at blocks {np.flatnonzero(refs < 0)[:8]}")
        unused = slice(self._next_unused, None)
        if refs[unused].any() or cached[unused].any():
            raise AssertionError(f"a block at or above next_unused={self._next_unused} is used")
        returned = list(self._returned_empty)
        if len(set(returned)) != len(returned):
            raise AssertionError("the returned-empty list holds a block twice")
        if returned:
            ids = np.asarray(returned)
            if ids.min() < 0 or ids.max() >= self._next_unused:
                raise AssertionError(f"returned-empty ids outside [0, {self._next_unused})")
            if refs[ids].any() or cached[ids].any():
                raise AssertionError("a block on the returned-empty list is in use or cached")
        idle = refs == 0
        num_empty = int(np.count_nonzero(idle & ~cached))
        if num_empty != self.num_empty_blocks:
            raise AssertionError(f"{num_empty} empty blocks, counted {self.num_empty_blocks}")
        num_cached_free = int(np.count_nonzero(idle & cached))
        if num_cached_free != self._num_cached_free:
            raise AssertionError(
                f"{num_cached_free} cached free blocks, counted {self._num_cached_free}"
            )

    def _checked_ids(self, block_ids: Sequence[int], vector_min_ids: int) -> np.ndarray | None:
        """Check that ``block_ids`` are distinct and in range (``ValueError`` if not).

        Returns them as an array for the vectorized path (at least ``vector_min_ids`` of
        them: the pool's ``VECTOR_MIN_IDS``, passed in because the pool owns that setting),
        or None for a small batch, which the callers walk in Python.
        """
        n = len(block_ids)
        if n == 0:
            return None
        if n < vector_min_ids:
            ids = None
            lowest, highest, num_distinct = min(block_ids), max(block_ids), len(set(block_ids))
        else:
            ids = np.asarray(block_ids, dtype=np.int64)
            lowest, highest, num_distinct = ids.min(), ids.max(), _num_distinct(ids)
        if lowest < 0 or highest >= self.num_blocks:
            raise ValueError(
                f"block ids must lie in [0, {self.num_blocks}), got {shown_ids(block_ids)}"
            )
        if num_distinct != n:
            raise ValueError(f"block ids must be distinct, got {shown_ids(block_ids)}")
        return ids

    def _require_in_use(self, block_ids: Sequence[int], ids: np.ndarray | None, verb: str) -> None:
        if ids is None:
            refs = self._refs
            for block_id in block_ids:
                if refs[block_id] <= 0:
                    raise RuntimeError(f"block {block_id} {verb} with ref count 0")
        elif (self.ref_counts[ids] <= 0).any():
            bad = ids[self.ref_counts[ids] <= 0][0]
            raise RuntimeError(f"block {bad} {verb} with ref count 0")

    def _is_valid_eviction_vectorized(self, answer: list, n: int) -> bool:
        try:
            ids = np.asarray(answer)
        except (TypeError, ValueError):
            return False
        return bool(
            len(answer) == n
            and ids.dtype.kind in "iu"
            and ids.ndim == 1
            and ids.min() >= 0
            and ids.max() < self.num_blocks
            and _num_distinct(ids) == n
            and self.cached[ids].all()
            and not self.ref_counts[ids].any()
        )

    def _checked_eviction(self, answer: list, n: int) -> list[int]:
        """The blocks named by an answer to ``evict(n)``, checked one by one; on a bad
        answer, ``ComponentError``, after the valid candidates it did return (which the
        policy no longer tracks) are dropped to empty, so pool and policy still agree on
        the candidates."""
        problems: list[str] = []
        valid: list[int] = []
        seen: set[int] = set()
        refs, cached = self._refs, self._cached_flags
        for item in answer:
            if isinstance(item, bool | np.bool_):
                problems.append(f"{item!r} is not a block id")
                continue
            try:
                block_id = operator.index(item)
            except TypeError:
                problems.append(f"{item!r} is not a block id")
                continue
            if not 0 <= block_id < self.num_blocks:
                problems.append(f"block {block_id} is outside [0, {self.num_blocks})")
            elif block_id in seen:
                problems.append(f"block {block_id} appears twice")
            elif refs[block_id] > 0:
                problems.append(f"block {block_id} is in use (ref count {refs[block_id]})")
            elif not cached[block_id]:
                problems.append(f"block {block_id} is not cached")
            else:
                valid.append(block_id)
            seen.add(block_id)
        if len(answer) != n:
            problems.insert(0, f"{len(answer)} ids instead of {n}")
        if not problems:
            return valid
        if valid:
            self._drop_to_empty(valid)
        raise ComponentError(
            POLICY_KIND,
            self._eviction,
            "evict",
            f"evict({n}) must return {n} distinct ids of cached free blocks, got "
            f"{shown_ids(answer)}: {problems[0]}",
        )


def _num_distinct(ids: np.ndarray) -> int:
    """Distinct values in ``ids``; sorting beats ``np.unique``'s hash table on large ids."""
    ordered = np.sort(ids)
    return int(np.count_nonzero(ordered[1:] != ordered[:-1])) + (ordered.size > 0)


def shown_ids(block_ids: Iterable) -> list:
    """At most 8 ids, for messages about batches that may hold millions."""
    shown = list(itertools.islice(block_ids, 9))
    return shown if len(shown) <= 8 else [*shown[:8], "..."]
