"""LFU, ARC and S3-FIFO: the contract, agreement with slow reference models over random
calls, and each policy's defining property, on bare policies and through the KV manager."""

import random

import attrs
import pytest

from llmlab.cache import (
    ARCEviction,
    FIFOEviction,
    KVCacheManager,
    LFUEviction,
    LRUEviction,
    S3FIFOEviction,
)
from tests.helpers import make_request

NEW_POLICIES = [LFUEviction, ARCEviction, S3FIFOEviction]


# -- slow reference models: lists and min() over every candidate, written from the papers --


class ReferenceFIFO:
    """FIFO keeps a block's first time as a candidate until it is evicted (shares S3-FIFO's
    queue, so it is checked here too)."""

    def __init__(self):
        self.queued_at, self.candidates, self.clock = {}, set(), 0

    def on_free(self, block_ids):
        for block_id in block_ids:
            self.queued_at.setdefault(block_id, self.clock)
            self.candidates.add(block_id)
            self.clock += 1

    def on_hit(self, block_ids):
        self.candidates.difference_update(block_ids)

    def evict(self, n):
        evicted = sorted(self.candidates, key=self.queued_at.__getitem__)[:n]
        for block_id in evicted:
            self.candidates.remove(block_id)
            del self.queued_at[block_id]
        return evicted


class ReferenceLFU:
    def __init__(self):
        self.hits, self.freed_at, self.clock = {}, {}, 0

    def on_free(self, block_ids):
        for block_id in block_ids:
            self.freed_at[block_id] = self.clock
            self.clock += 1

    def on_hit(self, block_ids):
        for block_id in block_ids:
            self.hits[block_id] = self.hits.get(block_id, 0) + 1
            self.freed_at.pop(block_id, None)

    def evict(self, n):
        evicted = []
        for _ in range(n):
            victim = min(self.freed_at, key=lambda b: (self.hits.get(b, 0), self.freed_at[b]))
            del self.freed_at[victim]
            self.hits.pop(victim, None)
            evicted.append(victim)
        return evicted

    def known(self):
        return set(self.hits) | set(self.freed_at)


class ReferenceARC:
    def __init__(self):
        self.t1, self.t2, self.reused, self.p = [], [], set(), 0.0

    def on_free(self, block_ids):
        for block_id in block_ids:
            (self.t2 if block_id in self.reused else self.t1).append(block_id)

    def on_hit(self, block_ids):
        for block_id in block_ids:
            self.reused.add(block_id)
            if block_id in self.t1:
                step = max(1.0, len(self.t2) / len(self.t1))
                self.p = min(self.p + step, len(self.t1) + len(self.t2))
                self.t1.remove(block_id)
            elif block_id in self.t2:
                step = max(1.0, len(self.t1) / len(self.t2))
                self.p = max(self.p - step, 0.0)
                self.t2.remove(block_id)

    def evict(self, n):
        evicted = []
        for _ in range(n):
            if self.t1 and (len(self.t1) > self.p or not self.t2):
                evicted.append(self.t1.pop(0))
            else:
                evicted.append(self.t2.pop(0))
                self.reused.discard(evicted[-1])
        return evicted

    def known(self):
        return set(self.t1) | set(self.t2) | self.reused


class ReferenceS3FIFO:
    """Every block the policy knows sits in S or M at a time; a queue's order is by time."""

    def __init__(self, small_ratio=0.1, move_to_main_threshold=1):
        self.small_ratio, self.threshold = small_ratio, move_to_main_threshold
        self.queue, self.time, self.freq, self.candidates, self.clock = {}, {}, {}, set(), 0

    def _requeue(self, block_id, queue):
        self.queue[block_id], self.time[block_id] = queue, self.clock
        self.clock += 1

    def _oldest(self, queue):
        return min(
            (b for b in self.candidates if self.queue[b] == queue), key=self.time.__getitem__
        )

    def _count(self, queue):
        return sum(1 for b in self.candidates if self.queue[b] == queue)

    def _drop(self, block_id):
        self.candidates.remove(block_id)
        del self.queue[block_id], self.time[block_id]
        self.freq.pop(block_id, None)
        return block_id

    def on_free(self, block_ids):
        for block_id in block_ids:
            if block_id not in self.queue:
                self._requeue(block_id, "S")
            self.candidates.add(block_id)

    def on_hit(self, block_ids):
        for block_id in block_ids:
            self.freq[block_id] = min(self.freq.get(block_id, 0) + 1, 3)
            self.candidates.discard(block_id)

    def evict(self, n):
        evicted = []
        while len(evicted) < n:
            small, main = self._count("S"), self._count("M")
            if small and (not main or small >= self.small_ratio * (small + main)):
                while self._count("S"):  # the paper's evictS: until one leaves S for good
                    victim = self._oldest("S")
                    if self.freq.get(victim, 0) >= self.threshold:
                        self.freq[victim] = 0
                        self._requeue(victim, "M")
                    else:
                        evicted.append(self._drop(victim))
                        break
            else:
                while True:  # evictM: CLOCK over M
                    victim = self._oldest("M")
                    if self.freq.get(victim, 0):
                        self.freq[victim] -= 1
                        self._requeue(victim, "M")
                    else:
                        evicted.append(self._drop(victim))
                        break
        return evicted

    def known(self):
        return set(self.queue) | set(self.freq)


def pair(policy_cls, **params):
    reference = {
        FIFOEviction: ReferenceFIFO,
        LFUEviction: ReferenceLFU,
        ARCEviction: ReferenceARC,
        S3FIFOEviction: ReferenceS3FIFO,
    }[policy_cls]
    return policy_cls(**params), reference(**params)


# -- a driver that makes only the calls a block pool makes -------------------------------


def drive(policy, seed, num_ops, num_ids=48, reference=None):
    """Random calls in a pool's order, checked against the contract (and ``reference``).

    Each id is empty, in use (cached) or a candidate. Hits favour a few hot ids half the
    time; a ``drop_cached`` empties an in-use block without telling the policy, as the
    pool does. Ends by evicting every candidate. Returns every ``evict`` answer.
    """
    rng = random.Random(seed)
    state = dict.fromkeys(range(num_ids), "empty")
    hot = set(range(6))
    answers = []

    def having(*states):
        return [b for b, s in state.items() if s in states]

    def call(method, block_ids, new_state):
        for block_id in block_ids:
            state[block_id] = new_state
        getattr(policy, method)(block_ids)
        if reference is not None:
            getattr(reference, method)(block_ids)

    def evict(n):
        candidates = set(having("candidate"))
        got = policy.evict(n)
        assert len(got) == n == len(set(got)) and set(got) <= candidates
        if reference is not None:
            assert got == reference.evict(n)
        for block_id in got:
            state[block_id] = "empty"
        answers.append(got)

    for _ in range(num_ops):
        op = rng.random()
        if op < 0.2:  # allocated, then indexed once computed: the policy hears nothing yet
            empty = having("empty")
            for block_id in rng.sample(empty, min(3, len(empty))):
                state[block_id] = "in_use"
        elif op < 0.45:  # requests finish: their blocks, in some order
            in_use = having("in_use")
            freed = rng.sample(in_use, rng.randint(0, len(in_use)))
            if freed:
                call("on_free", freed, "candidate")
        elif op < 0.7:  # a prefix hit, on candidates and blocks in use alike
            cached = having("in_use", "candidate")
            if rng.random() < 0.5:
                cached = [b for b in cached if b in hot]
            hit = rng.sample(cached, rng.randint(0, min(4, len(cached))))
            if hit:
                call("on_hit", hit, "in_use")
        elif op < 0.95:
            num_candidates = len(having("candidate"))
            if num_candidates:
                evict(rng.randint(1, min(5, num_candidates)))
        else:
            in_use = having("in_use")
            if in_use:
                state[rng.choice(in_use)] = "empty"
    if having("candidate"):
        evict(len(having("candidate")))
    return answers


REFERENCE_CASES = [
    (FIFOEviction, {}),
    (LFUEviction, {}),
    (ARCEviction, {}),
    (S3FIFOEviction, {}),
    (S3FIFOEviction, {"small_ratio": 0.3, "move_to_main_threshold": 2}),
]


@pytest.mark.parametrize(("policy_cls", "params"), REFERENCE_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_random_calls_evict_exactly_what_the_slow_reference_model_evicts(policy_cls, params, seed):
    policy, reference = pair(policy_cls, **params)
    drive(policy, seed, num_ops=3000, reference=reference)
    if policy_cls is ARCEviction:
        assert policy.target_recent_size == reference.p


@pytest.mark.parametrize("policy_cls", NEW_POLICIES)
def test_the_same_calls_give_the_same_evictions(policy_cls):
    assert drive(policy_cls(), 7, 1500) == drive(policy_cls(), 7, 1500)


@pytest.mark.parametrize("policy_cls", NEW_POLICIES)
def test_evict_returns_distinct_candidates_and_never_a_block_in_use(policy_cls):
    policy = policy_cls()
    policy.on_free([4, 3, 2, 1, 0])
    policy.on_hit([1, 3])  # in use now
    policy.on_hit([9])  # in use and never a candidate
    assert policy.evict(0) == []
    assert sorted(policy.evict(3)) == [0, 2, 4]
    policy.on_free([3])
    assert policy.evict(1) == [3]


@pytest.mark.parametrize("policy_cls", NEW_POLICIES)
def test_an_evicted_block_leaves_no_metadata_behind(policy_cls):
    policy = policy_cls()
    for _ in range(3):
        policy.on_free(list(range(100)))
        policy.on_hit(list(range(0, 100, 3)))
        policy.on_free(list(range(0, 100, 3)))
        assert sorted(policy.evict(100)) == list(range(100))
        for field in attrs.fields(policy_cls):
            value = getattr(policy, field.name)
            if isinstance(value, set):
                assert not value, field.name
            elif isinstance(value, dict):  # LFU may keep an empty bucket for reuse
                assert not any(value.values()) if field.name == "_buckets" else not value
            elif isinstance(value, tuple):
                assert not any(map(len, value)), field.name  # S3-FIFO's queues


# -- LFU ---------------------------------------------------------------------------------


def test_lfu_without_hits_is_lru_tail_of_a_chain_first():
    lfu, lru = LFUEviction(), LRUEviction()
    for policy in (lfu, lru):
        policy.on_free([3, 2, 1])  # one request's chain, tail first
        policy.on_free([7, 6])
    assert lfu.evict(5) == lru.evict(5) == [3, 2, 1, 7, 6]


def test_lfu_keeps_the_most_reused_block_through_every_other_eviction():
    lfu = LFUEviction()
    lfu.on_free(list(range(10)))
    reuses = {0: 5, 9: 1, 4: 2, 7: 1}
    for block_id, times in reuses.items():
        for _ in range(times):
            lfu.on_hit([block_id])
            lfu.on_free([block_id])
    # Fewest hits first, least recently freed among equals; block 0 (5 hits) outlives all.
    assert lfu.evict(9) == [1, 2, 3, 5, 6, 8, 9, 7, 4]
    lfu.on_free(list(range(10, 40)))
    assert 0 not in lfu.evict(30)
    assert lfu.evict(1) == [0]


def test_lfu_counts_hits_on_blocks_in_use_and_forgets_counts_of_evicted_blocks():
    lfu = LFUEviction()
    lfu.on_free([1])
    lfu.on_hit([1])
    lfu.on_hit([1])  # a second request shares it while it is in use
    lfu.on_free([1, 2])
    assert lfu.evict(1) == [2]
    lfu.on_free([3])
    assert lfu.evict(2) == [3, 1]
    lfu.on_free([1, 4])  # id 1 holds new content now: no hits
    assert lfu.evict(1) == [1]


# -- ARC ---------------------------------------------------------------------------------


def test_arc_puts_blocks_ever_hit_in_t2_and_new_or_reused_ids_in_t1():
    arc = ARCEviction()
    arc.on_free([1, 2])
    arc.on_hit([1, 3])  # 3: hit while in use, never a candidate yet
    arc.on_free([3, 1])
    assert list(arc._recent) == [2] and list(arc._frequent) == [3, 1]
    assert arc.target_recent_size == 1  # the hit on candidate 1 in T1
    assert arc.evict(3) == [3, 1, 2]  # |T1| = p: T2 first, then T1 once T2 is empty
    arc.on_free([1])  # the id now holds other content: not a ghost hit, back in T1
    assert list(arc._recent) == [1] and not arc._frequent


def test_arc_hits_on_t1_grow_p_and_hits_on_t2_shrink_it():
    arc = ARCEviction()
    arc.on_free(list(range(10)))
    arc.on_hit([0, 1, 2])  # T1 hits, T2 empty: +1 each
    assert arc.target_recent_size == 3
    arc.on_free([0, 1, 2])
    arc.on_hit([0])  # T2 hit with |T1| = 7, |T2| = 3: -7/3
    assert arc.target_recent_size == pytest.approx(3 - 7 / 3)
    arc.on_hit([1, 2])
    assert arc.target_recent_size == 0
    arc.on_free([0, 1, 2])
    arc.on_hit([3])  # T1 hit with |T1| = 7, |T2| = 3: +1
    assert arc.target_recent_size == 1


def test_arc_evicts_t2_once_t1_is_down_to_its_target_size():
    arc = ARCEviction()
    arc.on_free([0, 1])
    arc.on_hit([0, 1])
    arc.on_free([0, 1])  # T2 = [0, 1]
    arc.on_free(list(range(10, 20)))  # T1 = [10, ..., 19]
    arc.on_hit([10, 11, 12])  # recency kept these: p grows from 1 to 4
    assert arc.target_recent_size == 4
    # T1 down to p, then T2 (LRU would take 0 and 1 first), then T1 once T2 is empty.
    assert arc.evict(8) == [13, 14, 15, 0, 1, 16, 17, 18]


# -- S3-FIFO -----------------------------------------------------------------------------


def test_s3fifo_evicts_one_hit_blocks_from_s_and_moves_reused_ones_to_m():
    s3 = S3FIFOEviction()
    s3.on_free(list(range(10)))
    s3.on_hit([0, 2])
    s3.on_free([2, 0])  # back in line where they were: hits move nothing
    assert s3.evict(3) == [1, 3, 4]  # 0 and 2 went to M on the way
    assert s3._in_main == {0, 2}
    assert s3.evict(5) == [5, 6, 7, 8, 9]
    assert s3.evict(2) == [0, 2]  # M, frequency reset to 0 by the move


def test_s3fifo_main_queue_reinserts_with_one_frequency_less():
    s3 = S3FIFOEviction()
    s3.on_free([0, 1, 2])
    s3.on_hit([0, 1])
    s3.on_free([0, 1])
    assert s3.evict(1) == [2]  # 0 and 1 (hit once) went to M on the way
    for _ in range(4):
        s3.on_hit([0])
        s3.on_free([0])
    s3.on_hit([1])
    s3.on_free([1])
    assert s3._freq == {0: 3, 1: 1}  # the two-bit counter stops at 3
    # M in order 0, 1: 0 back with 2, 1 back with 0, 0 back with 1, then 1 goes.
    assert s3.evict(1) == [1]
    assert s3.evict(1) == [0]


def test_s3fifo_keeps_a_blocks_place_while_it_is_in_use():
    s3 = S3FIFOEviction()
    s3.on_free([0, 1, 2])
    s3.on_hit([0])  # in use: evict passes over it, but it keeps its place
    assert s3.evict(1) == [1]
    s3.on_free([3])
    s3.on_hit([0])
    s3.on_free([0])  # freq 2 now, still the oldest in S
    assert s3.evict(1) == [2]
    assert s3._in_main == {0}
    assert s3.evict(2) == [3, 0]


def test_s3fifo_an_evicted_id_reenters_s_as_new_content():
    s3 = S3FIFOEviction()
    s3.on_free([0])
    s3.on_hit([0])
    s3.on_free([0])
    assert s3.evict(1) == [0]  # moved to M with frequency 0, then evicted from M
    s3.on_free([0, 1])  # no ghost: the id holds other content, so it starts in S
    assert s3._in_main == set() and s3._freq == {}
    assert s3.evict(2) == [0, 1]


@pytest.mark.parametrize("bad", [{"small_ratio": 0}, {"small_ratio": 1.0}, {"small_ratio": "x"}])
def test_s3fifo_rejects_a_small_ratio_outside_the_open_unit_interval(bad):
    with pytest.raises(ValueError, match="small_ratio must be a number in"):
        S3FIFOEviction(**bad)


@pytest.mark.parametrize("threshold", [0, 4, True, 1.0])
def test_s3fifo_rejects_a_threshold_the_two_bit_counter_cannot_reach(threshold):
    with pytest.raises(ValueError, match=r"move_to_main_threshold must be an int in \[1, 3\]"):
        S3FIFOEviction(move_to_main_threshold=threshold)


# -- scan resistance: a hot working set and a one-time scan ------------------------------


def cached_after(policy, capacity, trace):
    """Run a block cache of ``capacity`` over content keys; return the keys still cached.

    A key found in the cache is a hit (taken, then freed); a miss takes an empty id or
    evicts one, as the pool does.
    """
    block_of, content_of = {}, {}
    empty = list(range(capacity))
    for key in trace:
        if key in block_of:
            policy.on_hit([block_of[key]])
        else:
            block_id = empty.pop() if empty else policy.evict(1)[0]
            if block_id in content_of:
                del block_of[content_of[block_id]]
            block_of[key], content_of[block_id] = block_id, key
        policy.on_free([block_of[key]])
    return set(block_of)


HOT_THEN_SCAN = [f"hot{i}" for i in range(8)] * 4 + [f"scan{i}" for i in range(200)]


@pytest.mark.parametrize("policy_cls", [ARCEviction, S3FIFOEviction, LFUEviction])
def test_a_hot_working_set_survives_a_one_time_scan(policy_cls):
    cached = cached_after(policy_cls(), 32, HOT_THEN_SCAN)
    assert {f"hot{i}" for i in range(8)} <= cached


@pytest.mark.parametrize("policy_cls", [LRUEviction, FIFOEviction])
def test_a_one_time_scan_flushes_the_hot_set_from_recency_and_fifo_order(policy_cls):
    cached = cached_after(policy_cls(), 32, HOT_THEN_SCAN)
    assert not {f"hot{i}" for i in range(8)} & cached


BLOCK_SIZE = 4
HOT_PREFIXES = [[100 * p + t for t in range(2 * BLOCK_SIZE)] for p in range(1, 4)]


def run_prompt(kv, tokens):
    """Admit a prompt (reusing its cached prefix), compute it, cache it and finish it."""
    request = make_request(tokens)
    prefix = kv.lookup_prefix(request)
    num_new = request.num_tokens - len(prefix) * BLOCK_SIZE
    assert kv.allocate(request, num_new, prefix)
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)
    kv.free(request)
    return len(prefix)


def hot_prefixes_cached_after_a_scan(policy):
    kv = KVCacheManager(num_blocks=24, block_size=BLOCK_SIZE, eviction=policy)
    suffix = iter(range(10_000, 20_000))
    for round_ in range(4):  # each hot prefix: cached once, then hit three times
        for prefix in HOT_PREFIXES:
            hits = run_prompt(kv, prefix + [next(suffix)])
            assert hits == (2 if round_ else 0)
    for i in range(30):  # 60 one-time full blocks through a 24-block cache
        run_prompt(kv, [50_000 + 10 * i + t for t in range(2 * BLOCK_SIZE)] + [7])
    kv.check()
    assert len(kv.drain_events().evicted) >= 30
    return [len(kv.lookup_prefix(make_request(prefix + [0]))) for prefix in HOT_PREFIXES]


@pytest.mark.parametrize("policy_cls", [ARCEviction, S3FIFOEviction, LFUEviction])
def test_kv_manager_keeps_hot_prefixes_through_a_scan(policy_cls):
    assert hot_prefixes_cached_after_a_scan(policy_cls()) == [2, 2, 2]


@pytest.mark.parametrize("policy_cls", [LRUEviction, FIFOEviction])
def test_kv_manager_loses_hot_prefixes_to_a_scan_under_lru_and_fifo(policy_cls):
    assert hot_prefixes_cached_after_a_scan(policy_cls()) == [0, 0, 0]
