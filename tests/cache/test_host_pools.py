"""Swap space and the offload tier, as the KV cache manager keeps them: which transfers
are recorded, in which order, and that every pool's bookkeeping stays consistent."""

import pytest

from llmlab.cache import FIFOEviction, KVCacheManager, LRUEviction
from llmlab.cache.host_pools import OffloadTier, SwapSpace
from llmlab.cache.transfers import KVTransfer
from tests.helpers import make_request


def admit(kv, request, num_tokens=None):
    prefix = kv.lookup_prefix(request)
    offloaded = kv.lookup_offloaded(request, len(prefix))
    cached = (len(prefix) + len(offloaded)) * kv.block_size
    n = (num_tokens or request.num_tokens) - cached
    assert kv.allocate(request, n, prefix, offloaded)
    request.num_computed_tokens = cached + n
    kv.cache_computed_blocks(request)
    return prefix, offloaded


def test_swap_out_copies_computed_blocks_and_frees_the_device():
    kv = KVCacheManager(num_blocks=8, block_size=4, swap=SwapSpace(4))
    r = make_request(range(10))
    admit(kv, r)
    table = kv.block_table(r.request_id)
    kv.take_transfers()
    assert kv.swap_out(r)
    (transfer,) = kv.take_transfers()
    assert transfer.kind == "swap_out" and transfer.source == "device"
    assert [d for d, _ in transfer.blocks] == list(table)  # 10 tokens: 3 blocks
    assert kv.is_swapped(r) and kv.block_table(r.request_id) == ()
    assert kv.swap.num_used_blocks == 3 and r.num_computed_tokens == 10
    assert kv.drain_events().swapped_out == ((r.request_id, 3),)
    kv.check()

    assert kv.swap_in(r, 1)
    (back,) = kv.take_transfers()
    assert back.kind == "swap_in"
    assert [h for h, _ in back.blocks] == [h for _, h in transfer.blocks]
    assert [d for _, d in back.blocks] == list(kv.block_table(r.request_id))
    assert not kv.is_swapped(r) and kv.swap.num_used_blocks == 0
    assert kv.drain_events().swapped_in == ((r.request_id, 3),)
    kv.check()


def test_swap_out_refuses_without_room_and_changes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, swap=SwapSpace(2))
    r = make_request(range(10))
    admit(kv, r)
    kv.take_transfers()
    before = kv.snapshot()
    assert not kv.swap_out(r)  # 3 blocks, 2 host blocks
    assert kv.snapshot() == before and kv.take_transfers() == []
    assert not KVCacheManager(num_blocks=8, block_size=4).swap_out(r)  # no swap space


def test_freeing_a_swapped_request_gives_its_host_blocks_back():
    kv = KVCacheManager(num_blocks=8, block_size=4, swap=SwapSpace(4))
    r = make_request(range(10))
    admit(kv, r)
    assert kv.swap_out(r)
    kv.free(r)  # aborted while swapped out
    assert kv.swap.num_used_blocks == 0 and not kv.is_swapped(r)
    kv.check()


def test_swap_in_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4, swap=SwapSpace(4))
    a, b = make_request(range(10)), make_request(range(50, 62))
    admit(kv, a)
    assert kv.swap_out(a)
    admit(kv, b)  # 3 of the 4 device blocks
    kv.take_transfers()
    assert not kv.swap_in(a, 1)
    assert kv.take_transfers() == [] and kv.is_swapped(a)
    kv.check()


def test_copy_on_write_recorded_before_a_transfer_travels_with_it():
    kv = KVCacheManager(num_blocks=12, block_size=4, swap=SwapSpace(8))
    parent = make_request(range(6))
    admit(kv, parent)
    child = make_request(range(6))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.allocate(child, 1)  # writes into the shared partial block: copy pending
    assert kv.swap_out(parent)
    transfers = kv.take_transfers()
    assert [t.kind for t in transfers] == ["copy", "swap_out"]
    assert kv.take_block_copies() == []  # it went first, with the transfers


def test_dropped_cached_blocks_spill_to_the_tier_and_load_back():
    kv = KVCacheManager(num_blocks=4, block_size=4, tier=OffloadTier(8))
    a = make_request(range(13))  # 3 full blocks + 1 token
    admit(kv, a)
    kv.free(a)
    kv.take_transfers()
    b = make_request(range(100, 116))  # takes every block: evicts a's cached ones
    admit(kv, b)
    (spill,) = kv.take_transfers()
    assert spill.kind == "spill" and len(spill.blocks) == 3
    events = kv.drain_events()
    assert events.spilled == spill.blocks
    assert kv.tier.num_cached_blocks == 3
    kv.free(b)

    c = make_request(list(range(12)) + [7, 7])
    prefix, offloaded = admit(kv, c)
    assert prefix == [] and len(offloaded) == 3
    transfers = kv.take_transfers()
    loads = [t for t in transfers if t.kind == "load"]
    assert len(loads) == 1 and [h for h, _ in loads[0].blocks] == offloaded
    assert [d for _, d in loads[0].blocks] == list(kv.block_table(c.request_id))[:3]
    # The loaded blocks are in the device index again; the tier keeps its copies.
    events = kv.drain_events()
    assert set(d for _, d in events.loaded) <= set(events.cached)
    assert kv.tier.num_cached_blocks >= 3
    kv.check()
    kv.free(c)
    # Dropping them again copies nothing they already hold.
    kv.take_transfers()
    admit(kv, make_request(range(200, 216)))
    assert all(
        t.kind != "spill" or all(d not in dict(loads[0].blocks).values() for d, _ in t.blocks)
        for t in kv.take_transfers()
    )
    kv.check()


def test_the_tier_evicts_with_its_own_policy():
    tier = OffloadTier(2, eviction=FIFOEviction())
    kv = KVCacheManager(num_blocks=2, block_size=2, tier=tier, eviction=LRUEviction())
    for start in (0, 10, 20):
        r = make_request(range(start, start + 4))  # 2 full blocks each
        admit(kv, r)
        kv.free(r)
    events = kv.drain_events()
    assert tier.num_cached_blocks == 2 and len(events.offload_evicted) == 2
    kv.check()


def test_pinned_tier_blocks_survive_spills_of_the_same_allocation():
    tier = OffloadTier(2)
    kv = KVCacheManager(num_blocks=3, block_size=2, tier=tier)
    a = make_request(range(5))  # 2 full blocks + 1 token
    admit(kv, a)
    kv.free(a)
    b = make_request(range(50, 55))
    admit(kv, b)  # evicts a's two cached blocks: they fill the tier
    kv.free(b)
    kv.take_transfers()
    # Loading both tier blocks needs every device block, which evicts b's cached ones;
    # their spill finds every tier block pinned by the load, so it stores nothing.
    c = make_request([0, 1, 2, 3, 9])
    _, offloaded = admit(kv, c)
    assert len(offloaded) == 2
    transfers = kv.take_transfers()
    assert [t.kind for t in transfers] == ["load"]
    assert [h for h, _ in transfers[0].blocks] == offloaded
    assert tier.lookup(c.block_hashes, c.all_token_ids, 2, 0, 2) == offloaded
    kv.check()


def test_reset_prefix_cache_empties_both_tiers_without_spilling():
    kv = KVCacheManager(num_blocks=4, block_size=4, tier=OffloadTier(4))
    a = make_request(range(13))
    admit(kv, a)
    kv.free(a)
    admit(kv, b := make_request(range(100, 116)))
    kv.free(b)
    kv.take_transfers()
    assert kv.reset_prefix_cache()
    assert kv.take_transfers() == [] and kv.tier.num_cached_blocks == 0
    kv.check()


def test_check_catches_a_swap_table_out_of_step_with_its_pool():
    kv = KVCacheManager(num_blocks=8, block_size=4, swap=SwapSpace(4))
    r = make_request(range(10))
    admit(kv, r)
    assert kv.swap_out(r)
    kv.swap.pool.ref_counts[kv.swap.table(r.request_id)[0]] += 1
    with pytest.raises(AssertionError, match="swap block"):
        kv.check()


def test_transfer_kinds_name_their_pools():
    t = KVTransfer("load", ((1, 2),))
    assert (t.source, t.destination) == ("offload", "device")
    assert KVTransfer("spill", ()).destination == "offload"
