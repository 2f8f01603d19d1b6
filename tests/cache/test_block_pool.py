"""The block pool: array state at scale, batched operations, and failing eviction policies."""

import attrs
import numpy as np
import pytest

from llmlab.cache import BlockPool, LRUEviction
from llmlab.errors import ComponentError


@attrs.define
class FaultyEviction:
    """LRU that raises in ``fail_in``, or answers ``evict`` with ``bad_answer(inner, n)``."""

    fail_in: str = ""
    bad_answer: object = None
    name: str = "faulty"
    inner: LRUEviction = attrs.field(factory=LRUEviction)

    def on_free(self, block_ids):
        if self.fail_in == "on_free":
            raise RuntimeError("boom")
        self.inner.on_free(block_ids)

    def on_hit(self, block_ids):
        if self.fail_in == "on_hit":
            raise RuntimeError("boom")
        self.inner.on_hit(block_ids)

    def evict(self, n):
        if self.fail_in == "evict":
            raise RuntimeError("boom")
        if self.bad_answer is not None:
            return self.bad_answer(self.inner, n)
        return self.inner.evict(n)


def cached_free_pool(num_blocks, num_cached, eviction, dropped=None):
    """A pool whose first ``num_cached`` blocks are cached and free (freed in id order)."""
    pool = BlockPool(num_blocks, eviction, on_drop=dropped.extend if dropped is not None else None)
    ids, _ = pool.allocate(num_cached)
    pool.mark_cached(ids)
    pool.release(ids)
    return pool


def test_a_pool_of_ten_million_blocks_builds_and_works():
    pool = BlockPool(10_000_000, LRUEviction())
    assert pool.num_free_blocks == pool.num_empty_blocks == 10_000_000
    ids, evicted = pool.allocate(3)
    assert (ids, evicted) == ([0, 1, 2], [])
    assert pool.release(ids[::-1]) == [2, 1, 0]
    assert pool.num_free_blocks == 10_000_000


def test_never_used_blocks_go_first_then_returned_ones_in_return_order():
    pool = BlockPool(4, LRUEviction())
    a, _ = pool.allocate(3)
    pool.release([a[2], a[0]])
    b, _ = pool.allocate(3)
    assert b == [3, 2, 0]
    pool.check()


def test_release_returns_freed_blocks_and_cached_ones_become_candidates():
    pool = BlockPool(6, LRUEviction())
    ids, _ = pool.allocate(4)
    pool.mark_cached(ids[:2])
    pool.touch([ids[0]])  # a second holder for block 0
    assert pool.release(ids[::-1]) == [3, 2, 1]
    assert pool.num_cached_free_blocks == 1
    assert pool.num_empty_blocks == 4
    assert pool.num_free_blocks == 5
    pool.check()


def test_allocation_evicts_only_after_empty_blocks_and_tells_on_drop():
    dropped = []
    pool = cached_free_pool(6, 4, LRUEviction(), dropped)
    ids, evicted = pool.allocate(4)  # two empty blocks, then the two oldest candidates
    assert ids == [4, 5, 0, 1]
    assert evicted == dropped == [0, 1]
    assert not pool.cached[[0, 1]].any()
    assert pool.num_cached_free_blocks == 2
    pool.check()


def test_touch_revives_a_candidate_and_rejects_an_empty_block():
    pool = cached_free_pool(4, 2, LRUEviction())
    pool.touch([0])
    assert pool.ref_counts[0] == 1
    assert pool.num_cached_free_blocks == 1
    with pytest.raises(RuntimeError, match="block 3 touched while empty"):
        pool.touch([3])
    pool.check()


def test_internal_misuse_is_rejected_before_any_change():
    pool = BlockPool(100, LRUEviction())
    ids, _ = pool.allocate(80)
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.release([ids[0], 90])
    with pytest.raises(ValueError, match="distinct"):
        pool.release([ids[0], ids[0]])
    with pytest.raises(ValueError, match="distinct"):
        pool.release(ids + [ids[5]])  # the large-batch path
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        pool.release([100])
    with pytest.raises(RuntimeError, match="asked for 21 blocks"):
        pool.allocate(21)
    assert (pool.ref_counts[:80] == 1).all()
    pool.check()


def test_check_names_a_broken_invariant():
    pool = cached_free_pool(4, 2, LRUEviction())
    pool.check()
    pool.cached[1] = False  # a candidate unflagged behind the pool's back
    with pytest.raises(AssertionError, match="3 empty blocks, counted 2"):
        pool.check()


def test_evict_that_raises_leaves_the_pool_unchanged():
    pool = cached_free_pool(4, 4, FaultyEviction("evict"))
    refs, cached = pool.ref_counts.copy(), pool.cached.copy()
    with pytest.raises(ComponentError, match=r"'faulty' \(FaultyEviction\) failed in evict\(\)"):
        pool.allocate(1)
    assert np.array_equal(pool.ref_counts, refs) and np.array_equal(pool.cached, cached)
    assert pool.num_cached_free_blocks == 4
    pool.check()


BAD_ANSWERS = {
    "duplicate": (lambda inner, n: [inner.evict(1)[0]] * n, "appears twice"),
    "in use": (lambda inner, n: [5] + inner.evict(n - 1), "block 5 is in use"),
    "empty": (lambda inner, n: [7] + inner.evict(n - 1), "block 7 is not cached"),
    "out of range": (lambda inner, n: [99] + inner.evict(n - 1), r"outside \[0, 8\)"),
    "not an id": (lambda inner, n: ["x"] + inner.evict(n - 1), "'x' is not a block id"),
    "too few": (lambda inner, n: inner.evict(n - 1), "1 ids instead of 2"),
    "too many": (lambda inner, n: inner.evict(n + 1), "3 ids instead of 2"),
}


@pytest.mark.parametrize("case", BAD_ANSWERS)
def test_bad_evict_answer_drops_what_it_returned_and_keeps_pool_and_policy_agreeing(case):
    answer, problem = BAD_ANSWERS[case]
    dropped = []
    policy = FaultyEviction(bad_answer=answer)
    pool = cached_free_pool(8, 5, policy, dropped)
    pool.touch([4])  # block 5 in use below, block 4 in use as a revived candidate
    pool.allocate(2)  # blocks 5 and 6: now only block 7 is empty
    refs = pool.ref_counts.copy()
    with pytest.raises(ComponentError, match=problem) as info:
        pool.allocate(3)  # one empty block, then evict(2)
    assert "'faulty'" in str(info.value) and "evict()" in str(info.value)
    assert np.array_equal(pool.ref_counts, refs)  # nothing taken
    pool.check()
    # Whatever the policy handed back is no longer its candidate: the pool dropped it.
    assert sorted(pool.cached_free_block_ids()) == sorted(policy.inner._order)
    assert not pool.cached[dropped].any()
    assert pool.num_free_blocks == 5  # dropped blocks are empty, still free


def test_on_free_that_raises_frees_the_blocks_as_empty():
    dropped = []
    pool = BlockPool(4, FaultyEviction("on_free"), on_drop=dropped.extend)
    ids, _ = pool.allocate(3)
    pool.mark_cached(ids[:2])
    with pytest.raises(ComponentError, match=r"failed in on_free\(\): RuntimeError: boom"):
        pool.release(ids[::-1])
    assert dropped == [1, 0]
    assert pool.num_free_blocks == pool.num_empty_blocks == 4
    assert not pool.cached.any() and not pool.ref_counts.any()
    pool.check()


def test_on_hit_that_raises_changes_nothing():
    pool = cached_free_pool(4, 2, FaultyEviction("on_hit"))
    with pytest.raises(ComponentError, match=r"failed in on_hit\(\)"):
        pool.touch([0, 1])
    assert not pool.ref_counts.any()
    assert pool.num_cached_free_blocks == 2
    pool.check()


def test_a_new_policy_learns_every_current_candidate():
    pool = cached_free_pool(6, 4, FaultyEviction("evict"))
    pool.touch([1])
    pool.eviction = LRUEviction()
    assert list(pool.eviction._order) == [0, 2, 3]
    _, evicted = pool.allocate(5)
    assert evicted == [0, 2, 3]
    pool.check()
