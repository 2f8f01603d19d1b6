"""Block accounting, prefix caching and eviction order of the KV cache manager."""

import pytest

from llmlab.cache import FIFOEviction, KVCacheManager, LRUEviction, RandomEviction
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
    assert len(kv.block_ids(r.request_id)) == 3
    assert kv.num_free_blocks == 7
    kv.free(r)
    assert kv.num_free_blocks == 10
    assert kv.block_ids(r.request_id) == []


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request(range(8))
    admit(kv, a)
    before = kv.snapshot()
    b = make_request(range(100, 109))
    assert not kv.allocate(b, 9)
    assert kv.snapshot() == before
    assert kv.drain_events().allocated == tuple(kv.block_ids(a.request_id))


def test_shared_prefix_hits_full_blocks_only_and_shares_them():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = make_request(list(range(10)))
    admit(kv, a)
    b = make_request(list(range(10)) + [99, 98])
    hits = admit(kv, b)
    assert [blk.block_id for blk in hits] == kv.block_ids(a.request_id)[:2]
    assert kv.block_ids(b.request_id)[:2] == kv.block_ids(a.request_id)[:2]
    assert kv.drain_events().prefix_hits == tuple(kv.block_ids(a.request_id)[:2])
    assert [kv.pool.blocks[i].ref_count for i in kv.block_ids(a.request_id)[:2]] == [2, 2]


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
    victim = kv.pool.blocks[kv.block_ids(a.request_id)[0]]
    victim.token_ids = (7, 7, 7, 7)  # same hash, different content: must not hit
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
    chain = kv.block_ids(a.request_id)
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


@pytest.mark.parametrize("policy", [LRUEviction, FIFOEviction, RandomEviction])
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
