"""Block accounting, prefix caching and eviction order of the KV cache manager."""

import random

import pytest

from llmlab.cache import KVCacheManager, LRUEviction, block_pool
from llmlab.errors import ComponentError
from tests.cache.test_block_pool import BAD_ANSWERS, FaultyEviction
from tests.cache.test_eviction import ALL_POLICIES
from tests.helpers import make_request


def admit(kv, request, num_tokens=None):
    prefix = kv.lookup_prefix(request)
    n = (num_tokens or request.num_tokens) - len(prefix) * kv.block_size
    assert kv.allocate(request, n, prefix)
    request.num_computed_tokens = len(prefix) * kv.block_size + n
    kv.cache_computed_blocks(request)
    return prefix


def test_allocation_rounds_up_to_blocks_and_free_returns_them():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = make_request(range(9))
    admit(kv, r)
    assert len(list(kv.block_table(r.request_id))) == 3
    assert kv.num_free_blocks == 7
    kv.free(r)
    assert kv.num_free_blocks == 10
    assert list(kv.block_table(r.request_id)) == []


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(range(8))
    admit(kv, a)
    before = kv.snapshot()
    b = make_request(range(100, 109))
    assert not kv.allocate(b, 9)
    assert kv.snapshot() == before
    assert kv.drain_events().allocated == tuple(list(kv.block_table(a.request_id)))


def test_shared_prefix_hits_full_blocks_only_and_shares_them():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_request(list(range(10)))
    admit(kv, a)
    b = make_request(list(range(10)) + [99, 98])
    hits = admit(kv, b)
    assert hits == list(kv.block_table(a.request_id))[:2]
    assert list(kv.block_table(b.request_id))[:2] == list(kv.block_table(a.request_id))[:2]
    assert kv.drain_events().prefix_hits == tuple(list(kv.block_table(a.request_id))[:2])
    assert [kv.pool.ref_counts[i] for i in list(kv.block_table(a.request_id))[:2]] == [2, 2]


def test_prefix_lookup_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_request(range(8))
    admit(kv, a)
    b = make_request(range(8))  # identical prompt, exactly two full blocks
    assert len(kv.lookup_prefix(b)) == 1


def test_hash_collision_is_caught_by_token_check():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_request(range(9))
    admit(kv, a)
    victim = list(kv.block_table(a.request_id))[0]
    # Same hash, different content: must not hit.
    kv.index._entry_of_block[victim] = (kv.index.hash_of(victim), (7, 7, 7, 7))
    b = make_request(range(9))
    assert kv.lookup_prefix(b) == []


def test_freed_cached_blocks_stay_findable_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = make_request(range(9))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = make_request(range(9))
    assert len(admit(kv, b)) == 2  # revived from the cache
    kv.free(b)
    c = make_request(range(50, 66))  # needs all 4 blocks: evicts both cached ones
    admit(kv, c)
    assert len(kv.drain_events().evicted) == 2
    assert kv.lookup_prefix(make_request(range(9))) == []


def test_lru_evicts_tail_of_chain_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, eviction=LRUEviction())
    a = make_request(range(7))  # 3 full blocks cached + 1 partial
    admit(kv, a)
    chain = list(kv.block_table(a.request_id))
    kv.free(a)
    kv.drain_events()
    b = make_request([90, 91])  # one empty block, then one eviction
    admit(kv, b, 2)
    c = make_request([80, 81])
    admit(kv, c, 2)
    assert kv.drain_events().evicted == (chain[2],)
    # The head of the chain is still cached.
    assert len(kv.lookup_prefix(make_request(range(5)))) == 2


def test_lru_prefers_least_recently_freed_request():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old, new = make_request([1, 2, 3]), make_request([4, 5, 6])
    admit(kv, old)
    admit(kv, new)
    kv.free(old)
    kv.free(new)
    kv.drain_events()
    admit(kv, make_request([7, 8, 9, 10, 11]))  # 3 blocks: 2 empty + 1 eviction
    evicted = kv.drain_events().evicted
    assert len(evicted) == 1
    assert len(kv.lookup_prefix(make_request([1, 2, 3]))) == 0
    assert len(kv.lookup_prefix(make_request([4, 5, 6]))) == 1


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_every_policy_keeps_accounting_consistent(policy):
    kv = KVCacheManager(num_blocks=6, block_size=2, eviction=policy())
    for i in range(30):
        r = make_request([i % 5, (i + 1) % 5, i, 7])
        prefix = kv.lookup_prefix(r)
        n = r.num_tokens - len(prefix) * 2
        if kv.allocate(r, n, prefix):
            r.num_computed_tokens = r.num_tokens
            kv.cache_computed_blocks(r)
            kv.free(r)
        snap = kv.snapshot()
        assert all(c == 0 for c in snap.ref_counts)
        assert kv.num_free_blocks == 6
    assert len(kv.index) <= 6


def test_prefix_caching_off_never_hits():
    kv = KVCacheManager(num_blocks=10, block_size=2, enable_prefix_caching=False)
    a = make_request(range(6))
    admit(kv, a)
    assert kv.lookup_prefix(make_request(range(6))) == []
    assert len(kv.index) == 0


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


# -- scale ------------------------------------------------------------------------------


def test_a_five_million_block_cache_builds_and_serves_requests():
    kv = KVCacheManager(num_blocks=5_000_000, block_size=16)
    requests = [make_request(range(i, i + 40)) for i in range(3)]
    for r in requests:
        admit(kv, r)
    assert kv.num_free_blocks == 5_000_000 - 9
    for r in requests:
        kv.free(r)
    assert kv.num_free_blocks == 5_000_000
    kv.check()


def test_snapshot_is_a_read_only_copy_that_compares_by_value():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    admit(kv, make_request(range(3)))
    snap = kv.snapshot()
    assert snap == kv.snapshot()
    assert not snap.ref_counts.flags.writeable and not snap.cached.flags.writeable
    admit(kv, make_request(range(10, 13)))
    assert snap != kv.snapshot()


def test_prefix_blocks_are_only_for_a_request_holding_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = make_request(range(5))
    admit(kv, a)
    with pytest.raises(ValueError, match="already holds 3 blocks"):
        kv.allocate(a, 1, list(kv.block_table(a.request_id))[:1])


# -- a randomized soak that also tracks what each KV slot holds -------------------------


class Simulator:
    """Drives the manager like scheduler + executor, recording the token in every slot.

    After each operation the manager's invariants must hold and every computed position of
    every running request must read back its own token: that catches a prefix hit on stale
    content, a write into a shared block, and a lost copy-on-write.
    """

    def __init__(self, kv, rng):
        self.kv, self.rng = kv, rng
        self.slots = {}
        self.running = []
        self.bases = [[rng.randrange(6) for _ in range(14)] for _ in range(3)]

    def compute(self, r, num_tokens):
        start = r.num_computed_tokens
        for src, dst in self.kv.take_block_copies():
            self.slots[dst] = list(self.slots[src])
        bs, table = self.kv.block_size, list(self.kv.block_table(r.request_id))
        for p in range(start, start + num_tokens):
            self.slots.setdefault(table[p // bs], [None] * bs)[p % bs] = r.all_token_ids[p]
        r.num_computed_tokens = start + num_tokens
        self.kv.cache_computed_blocks(r)

    def admit(self):
        rng = self.rng
        tokens = rng.choice(self.bases)[: rng.randint(1, 14)] + [rng.randrange(6)] * rng.randint(
            0, 3
        )
        r = make_request(tokens)
        prefix = self.kv.lookup_prefix(r)
        cached = len(prefix) * self.kv.block_size
        n = min(r.num_tokens - cached, rng.randint(1, 8))
        if self.kv.allocate(r, n, prefix):
            r.num_computed_tokens = cached
            self.compute(r, n)
            self.running.append(r)

    def step(self, r):
        if r.num_computed_tokens == r.num_tokens:
            r.append_output(self.rng.randrange(6), 0.0)
        n = min(r.num_tokens - r.num_computed_tokens, self.rng.randint(1, 5))
        if self.kv.allocate(r, n):
            self.compute(r, n)
        else:
            self.free(r)

    def free(self, r):
        self.kv.free(r)
        self.running.remove(r)

    def truncate(self, r):
        t = self.rng.randint(0, r.num_computed_tokens)
        self.kv.truncate(r, t)
        del r.all_token_ids[t:]
        r.num_computed_tokens = t

    def fork(self, parent):
        child = make_request(parent.all_token_ids)
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    def verify(self):
        self.kv.check()
        bs = self.kv.block_size
        for r in self.running:
            table = list(self.kv.block_table(r.request_id))
            assert len(table) == self.kv.blocks_needed(r.num_computed_tokens)
            held = [self.slots[table[p // bs]][p % bs] for p in range(r.num_computed_tokens)]
            assert held == r.all_token_ids[: r.num_computed_tokens], r.request_id


def run_soak(policy, block_size, num_ops=400):
    kv = KVCacheManager(num_blocks=16, block_size=block_size, eviction=policy())
    sim = Simulator(kv, random.Random(block_size))
    for _ in range(num_ops):
        op = sim.rng.random()
        running = [r for r in sim.running if list(sim.kv.block_table(r.request_id))]
        if op < 0.3 or not running:
            sim.admit()
        elif op < 0.6:
            sim.step(sim.rng.choice(sim.running))
        elif op < 0.75:
            sim.free(sim.rng.choice(sim.running))
        elif op < 0.87:
            sim.truncate(sim.rng.choice(sim.running))
        else:
            sim.fork(sim.rng.choice(running))
        sim.verify()
    for r in list(sim.running):
        sim.free(r)
    sim.verify()
    assert sim.kv.num_free_blocks == 16
    assert not sim.kv.pool.ref_counts.any()


@pytest.mark.parametrize("policy", ALL_POLICIES)
@pytest.mark.parametrize("block_size", [2, 4])
def test_random_operations_keep_every_policy_consistent(policy, block_size):
    run_soak(policy, block_size)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_the_vectorized_path_behaves_like_the_per_block_one(policy, monkeypatch):
    # Small batches normally take the per-block path; force every batch through numpy.
    monkeypatch.setattr(block_pool, "VECTOR_MIN_IDS", 1)
    run_soak(policy, 2)


# -- truncate and fork ------------------------------------------------------------------


def test_truncate_releases_tail_blocks_tail_first_and_trims_hashes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(range(13))
    admit(kv, a)
    table = list(kv.block_table(a.request_id))
    kv.drain_events()
    kv.truncate(a, 4)
    assert list(kv.block_table(a.request_id)) == table[:1]
    assert kv.drain_events().freed == (table[3], table[2], table[1])
    assert len(a.block_hashes) == 1
    assert kv.num_free_blocks == 7
    kv.check()
    kv.truncate(a, 0)
    assert list(kv.block_table(a.request_id)) == [] and a.block_hashes == []
    assert kv.num_free_blocks == 8
    kv.check()


def test_truncate_into_a_private_cached_block_takes_it_out_of_the_index():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(range(9))
    admit(kv, a)
    second = list(kv.block_table(a.request_id))[1]
    assert len(kv.lookup_prefix(make_request(range(9)))) == 2
    kv.truncate(a, 6)  # block 1 keeps tokens 4, 5; its tail will be overwritten
    assert kv.drain_events().evicted == (second,)
    assert len(kv.lookup_prefix(make_request(range(9)))) == 1
    a.all_token_ids[6:] = [60, 61]
    a.num_computed_tokens = 6
    assert kv.allocate(a, 2)
    assert kv.take_block_copies() == []  # private: written in place
    kv.check()


def test_truncate_into_a_shared_block_copies_it_on_the_next_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request(range(9)), make_request(range(9))
    admit(kv, a)
    admit(kv, b)  # shares a's two full blocks
    shared = list(kv.block_table(a.request_id))[1]
    kv.truncate(b, 6)
    assert kv.pool.cached[shared]  # a still relies on it
    b.all_token_ids[6:] = [60, 61]
    b.num_computed_tokens = 6
    kv.drain_events()
    assert kv.allocate(b, 2)
    fresh = list(kv.block_table(b.request_id))[1]
    assert kv.take_block_copies() == [(shared, fresh)]
    assert kv.pool.ref_counts[shared] == 1 and list(kv.block_table(a.request_id))[1] == shared
    assert len(kv.lookup_prefix(make_request(range(9)))) == 2
    kv.check()


def test_a_write_into_a_cached_block_left_private_by_its_other_holder_unindexes_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request(range(9)), make_request(range(9))
    admit(kv, a)
    admit(kv, b)
    shared = list(kv.block_table(a.request_id))[1]
    kv.truncate(b, 6)  # shared then: stays indexed
    kv.free(a)  # now b alone holds it, still indexed
    b.all_token_ids[6:] = [60, 61]
    b.num_computed_tokens = 6
    kv.drain_events()
    assert kv.allocate(b, 2)
    assert kv.take_block_copies() == []
    assert kv.drain_events().evicted == (shared,)
    assert len(kv.lookup_prefix(make_request(range(9)))) == 1
    kv.check()


def test_fork_shares_every_block_and_copies_the_partial_one_on_first_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request(range(6))  # one full block, one partial
    admit(kv, parent)
    child = make_request(range(6))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    table = list(kv.block_table(parent.request_id))
    assert list(kv.block_table(child.request_id)) == table
    assert list(kv.pool.ref_counts[table]) == [2, 2]
    assert (
        child.block_hashes == parent.block_hashes and child.block_hashes is not parent.block_hashes
    )
    kv.check()

    parent.append_output(50, 0.0)
    assert kv.allocate(parent, 1)
    fresh = list(kv.block_table(parent.request_id))[1]
    assert kv.take_block_copies() == [(table[1], fresh)]
    assert kv.take_block_copies() == []
    assert list(kv.block_table(child.request_id)) == table
    child.append_output(70, 0.0)
    assert kv.allocate(child, 1)
    assert kv.take_block_copies() == []  # the child is the last holder: writes in place
    assert list(kv.block_table(child.request_id)) == table
    kv.check()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8
    kv.check()


def test_fork_after_a_full_block_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request(range(8))
    admit(kv, parent)
    child = make_request(range(8))
    kv.fork(parent, child)
    child.num_computed_tokens = 8
    for r in (parent, child):
        r.append_output(9, 0.0)
        assert kv.allocate(r, 1)
    assert kv.take_block_copies() == []
    assert list(kv.block_table(parent.request_id))[:2] == list(kv.block_table(child.request_id))[:2]
    assert list(kv.block_table(parent.request_id))[2] != list(kv.block_table(child.request_id))[2]
    kv.check()


def test_fork_needs_a_parent_with_blocks_and_a_child_without():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request(range(5)), make_request(range(5))
    with pytest.raises(ValueError, match="holds no blocks"):
        kv.fork(a, b)
    admit(kv, a)
    admit(kv, b)
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.fork(a, b)


def test_copy_on_write_counts_against_capacity():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    parent = make_request(range(6))
    admit(kv, parent)
    child = make_request(range(6))
    kv.fork(parent, child)
    parent.append_output(50, 0.0)
    before = kv.snapshot()
    assert not kv.allocate(parent, 1)  # the copy needs a block and none is free
    assert kv.snapshot() == before and kv.take_block_copies() == []


# -- failing eviction policies ----------------------------------------------------------


def full_cache(eviction, num_blocks=5, block_size=2):
    """A cache whose free blocks are all cached; request ``h`` holds one block."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size, eviction=eviction)
    h = make_request([90, 91])
    admit(kv, h)
    a = make_request(range(8))
    admit(kv, a)
    kv.free(a)
    return kv, h


def assert_recovers(kv, *held):
    """Consistent now; with a healthy policy every block can still be used, and freed."""
    kv.check()
    kv.eviction = LRUEviction()
    for r in held:
        kv.free(r)
    kv.check()
    assert kv.num_free_blocks == kv.num_blocks
    everything = make_request(range(100, 100 + kv.num_blocks * kv.block_size))
    admit(kv, everything)
    assert kv.num_free_blocks == 0
    kv.free(everything)
    assert kv.num_free_blocks == kv.num_blocks
    kv.check()


@pytest.mark.parametrize("case", ["raises", *BAD_ANSWERS])
def test_failing_evict_leaves_the_request_holding_nothing_new(case):
    policy = (
        FaultyEviction("evict")
        if case == "raises"
        else FaultyEviction(bad_answer=BAD_ANSWERS[case][0])
    )
    kv, h = full_cache(policy, num_blocks=8)
    g = make_request([80, 81, 82, 83])
    admit(kv, g)  # blocks 5 and 6 in use, block 7 empty, as BAD_ANSWERS expect
    before = kv.snapshot().block_tables
    b = make_request(range(50, 55))  # 3 blocks: one empty, evict(2)
    with pytest.raises(ComponentError, match=r"'faulty' \(FaultyEviction\) failed in evict\(\)"):
        kv.allocate(b, 5)
    assert kv.snapshot().block_tables == before
    assert_recovers(kv, h, g)


def test_failing_evict_after_a_prefix_hit_gives_the_hit_back():
    kv, h = full_cache(FaultyEviction("evict"))
    b = make_request([0, 1, 2, 3, 50, 51, 52])  # hits two blocks, needs two more: evict(2)
    prefix = kv.lookup_prefix(b)
    assert len(prefix) == 2
    with pytest.raises(ComponentError, match=r"failed in evict\(\)"):
        kv.allocate(b, 3, prefix)
    assert list(kv.block_table(b.request_id)) == []
    assert not kv.pool.ref_counts[prefix].any() and kv.pool.cached[prefix].all()
    assert kv.lookup_prefix(b) == prefix
    assert kv.drain_events().prefix_hits == ()
    assert_recovers(kv, h)


def test_failing_on_hit_admits_nothing():
    kv, h = full_cache(FaultyEviction("on_hit"))
    b = make_request([0, 1, 2, 3, 50])
    prefix = kv.lookup_prefix(b)
    before = kv.snapshot()
    with pytest.raises(ComponentError, match=r"'faulty' \(FaultyEviction\) failed in on_hit\(\)"):
        kv.allocate(b, 1, prefix)
    assert kv.snapshot() == before
    assert_recovers(kv, h)


def test_failing_on_free_still_frees_everything_as_empty():
    kv = KVCacheManager(num_blocks=4, block_size=2, eviction=FaultyEviction("on_free"))
    a = make_request(range(5))
    admit(kv, a)
    table = list(kv.block_table(a.request_id))
    kv.drain_events()
    with pytest.raises(ComponentError, match=r"'faulty' \(FaultyEviction\) failed in on_free\(\)"):
        kv.free(a)
    assert list(kv.block_table(a.request_id)) == []
    events = kv.drain_events()
    assert events.freed == tuple(table[::-1])
    assert events.evicted == (table[1], table[0])  # the cached ones lost their content
    assert len(kv.index) == 0 and kv.num_free_blocks == 4
    assert_recovers(kv)
