"""Eviction policies on block ids: order semantics, determinism, and no scans at scale."""

import pytest

from llmlab.cache import (
    EVICTION_POLICIES,
    ARCEviction,
    EvictionPolicy,
    FIFOEviction,
    LFUEviction,
    LRUEviction,
    RandomEviction,
    S3FIFOEviction,
)

ALL_POLICIES = [
    LRUEviction,
    FIFOEviction,
    RandomEviction,
    LFUEviction,
    ARCEviction,
    S3FIFOEviction,
]
BUILTIN_NAMES = {
    "lru": LRUEviction,
    "fifo": FIFOEviction,
    "random": RandomEviction,
    "lfu": LFUEviction,
    "arc": ARCEviction,
    "s3fifo": S3FIFOEviction,
}


def test_registry_names_every_builtin_and_each_builds_without_arguments():
    # The registry is live: other tests may have registered their own policies.
    builtins = {
        name: cls
        for name, cls in EVICTION_POLICIES.items()
        if getattr(cls, "__module__", "").startswith("llmlab.")
    }
    assert builtins == BUILTIN_NAMES
    assert list(EVICTION_POLICIES)[: len(BUILTIN_NAMES)] == list(BUILTIN_NAMES)
    for name, cls in builtins.items():
        policy = cls()
        assert isinstance(policy, EvictionPolicy)
        assert policy.name == name


def test_lru_evicts_least_recently_freed_first():
    lru = LRUEviction()
    lru.on_free([3, 2, 1])  # one request's chain, tail first
    lru.on_free([7])
    assert lru.evict(2) == [3, 2]
    lru.on_hit([1])  # revived: no longer a candidate
    lru.on_free([1])  # freed again: now the most recent
    assert lru.evict(2) == [7, 1]


def test_fifo_hit_does_not_refresh_a_blocks_place():
    fifo = FIFOEviction()
    fifo.on_free([1, 2, 3])
    fifo.on_hit([1])
    fifo.on_free([4])
    fifo.on_free([1])  # back in line with its original time
    assert fifo.evict(4) == [1, 2, 3, 4]


def test_fifo_skips_blocks_in_use_and_forgets_the_time_of_evicted_ones():
    fifo = FIFOEviction()
    fifo.on_free([1, 2, 3])
    fifo.on_hit([1])  # in use: must be skipped
    assert fifo.evict(1) == [2]
    fifo.on_free([2])  # cached again after its eviction: a new, later time
    assert fifo.evict(2) == [3, 2]
    fifo.on_free([1])
    assert fifo.evict(1) == [1]


def test_fifo_keeps_one_queue_entry_per_block_across_many_reuses():
    fifo = FIFOEviction()
    for _ in range(1000):
        fifo.on_free([5])
        fifo.on_hit([5])
    assert len(fifo._line) == 1


def test_random_is_deterministic_for_a_seed_and_returns_only_candidates():
    def run(seed):
        policy = RandomEviction(seed=seed)
        policy.on_free(list(range(100)))
        policy.on_hit([0, 1, 2])
        return policy.evict(50)

    first = run(0)
    assert first == run(0)
    assert first != run(1)
    assert len(set(first)) == 50
    assert not {0, 1, 2} & set(first)


@pytest.mark.parametrize("policy_cls", ALL_POLICIES)
def test_each_evict_costs_no_scan_at_1e5_candidates(policy_cls):
    # 10^5 single evictions: a policy that scanned its candidates per call would do ~5e9
    # steps and never finish; O(1) or O(log n) ones take a fraction of a second.
    n = 100_000
    policy = policy_cls()
    policy.on_free(list(range(n)))
    policy.on_hit(list(range(0, n, 2)))  # half come back into use
    evicted = [policy.evict(1)[0] for _ in range(n // 2)]
    assert sorted(evicted) == list(range(1, n, 2))
    if policy_cls is not RandomEviction:
        assert evicted == list(range(1, n, 2))  # the rest: freeing order, no hit among them
