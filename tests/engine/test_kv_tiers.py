"""The prefix cache's second tier (``kv_offloading_size``): blocks the device pool drops
spill to it, prefix hits past the device's load back; same greedy tokens as a single-tier
engine, with swap preemption on too; the disk backend gives the cpu backend's tokens; a
soak keeps every pool consistent after every step."""

from __future__ import annotations

import os
import random

import pytest

from llmlab import LLM, SamplingParams
from llmlab.cache import FIFOEviction
from llmlab.cache.transfers import KVTransfer
from llmlab.config import EngineConfig
from llmlab.engine.builder import EngineBuilder
from llmlab.runner.executor import VirtualClock
from llmlab.scheduler.batch import ScheduledBatch, ScheduledRequest
from tests.engine.test_swap import COMMON, assert_nothing_held, gib, run

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def conversations(n: int = 10, seed: int = 1):
    """Two turns of ``n`` chats: the second turn's prompt extends the first one's."""
    rng = random.Random(seed)
    first = [[rng.randrange(3, 500) for _ in range(rng.randrange(24, 40))] for _ in range(n)]
    second = [p + [rng.randrange(3, 500) for _ in range(6)] for p in first]
    return first, second


def two_turns(llm):
    """Both turns on one engine (the second after the first finished), checked after
    every step; returns the tokens and the events."""
    first, second = conversations()
    tokens, events = run(llm, [{"prompt_token_ids": p} for p in first], PARAMS)
    more, events2 = run(llm, [{"prompt_token_ids": p} for p in second], PARAMS)
    return tokens + more, events + events2


@pytest.fixture(scope="module")
def single_tier(tiny_llama):
    tokens, _ = two_turns(LLM(tiny_llama, **COMMON))
    return tokens


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_offload_tier_matches_the_single_tier_engine(tiny_llama, single_tier, policy):
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, kv_offloading_size=gib(512),
              kv_offloading_eviction_policy=policy, **COMMON)
    tokens, events = two_turns(llm)
    assert tokens == single_tier
    spilled = [p for e in events for p in e.blocks_spilled]
    loaded = [p for e in events for p in e.blocks_loaded]
    assert spilled and loaded
    offloaded = sum(a.num_offloaded_tokens for e in events for a in e.admitted)
    assert offloaded == len(loaded) * COMMON["block_size"]
    assert llm.llm_engine.kv_cache.tier.eviction.name == policy
    assert_nothing_held(llm)


def test_swap_and_tier_together_match_recompute_only(tiny_llama, single_tier):
    llm = LLM(tiny_llama, num_gpu_blocks_override=32, max_num_batched_tokens=64,
              preemption_mode="swap", swap_space=gib(256), kv_offloading_size=gib(128),
              **{**COMMON, "max_num_seqs": 10})
    tokens, events = two_turns(llm)
    assert tokens == single_tier
    assert any(e.swapped_out for e in events) and any(e.swapped_in for e in events)
    assert any(e.blocks_spilled for e in events) and any(e.blocks_loaded for e in events)
    assert_nothing_held(llm)


def test_disk_backend_gives_the_cpu_backend_tokens(tiny_llama, tmp_path):
    def tokens_of(**tier):
        llm = LLM(tiny_llama, num_gpu_blocks_override=40, kv_offloading_size=gib(512),
                  **tier, **COMMON)
        tokens, events = two_turns(llm)
        assert any(e.blocks_loaded for e in events)
        return llm, tokens

    _, cpu = tokens_of()
    disk, tokens = tokens_of(kv_offloading_backend="disk", kv_offloading_dir=str(tmp_path))
    assert tokens == cpu
    path = disk.llm_engine.executor.host_kv.path
    assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 0

    temp, tokens = tokens_of(kv_offloading_backend="disk")
    assert tokens == cpu
    directory = os.path.dirname(temp.llm_engine.executor.host_kv.path)
    assert os.path.isdir(directory)
    temp.llm_engine.shutdown()
    assert not os.path.exists(directory)  # the temporary directory goes at shutdown


def test_an_instance_from_the_builder_orders_the_tier(tiny_llama):
    policy = FIFOEviction()
    config = EngineConfig(model=tiny_llama, kv_offloading_size=gib(64), **COMMON)
    engine = EngineBuilder(config).with_offload_eviction_policy(policy).build()
    assert engine.kv_cache.tier.eviction is policy
    assert engine.kv_cache.eviction is not policy


def test_per_tier_hit_rates_in_get_metrics(tiny_llama):
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, kv_offloading_size=gib(512),
              disable_log_stats=False, **COMMON)
    two_turns(llm)
    metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    assert metrics["llmlab:external_prefix_cache_hits"] > 0
    assert (metrics["llmlab:external_prefix_cache_queries"]
            >= metrics["llmlab:external_prefix_cache_hits"])
    assert metrics["llmlab:prefix_cache_queries"] > 0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kv_offloading_size": 0.01, "enable_prefix_caching": False},
         "enable_prefix_caching=False"),
        ({"kv_offloading_size": 0.01, "kv_offloading_dir": "/tmp"}, "kv_offloading_backend"),
        ({"kv_offloading_size": gib(1) / 2}, "kv_offloading_size.*holds no KV block"),
        ({"kv_offloading_size": 0.01, "kv_offloading_eviction_policy": "nope"}, "nope"),
    ],
)
def test_bad_tier_settings_are_refused(tiny_llama, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_llama, **{**COMMON, **settings})


def test_the_simulator_accepts_batches_with_transfers():
    from llmlab.sim.executor import SimulatedExecutor

    class Flat:
        def step_time(self, shape):
            return 0.001

    clock = VirtualClock()
    executor = SimulatedExecutor(Flat(), clock, vocab_size=100)
    batch = ScheduledBatch(
        (ScheduledRequest("a", 0, 0, (1, 2, 3), 0, (0,), 1),),
        kv_transfers=(KVTransfer("spill", ((0, 0),)), KVTransfer("load", ((0, 1),))),
    )
    assert not batch.is_empty
    assert len(executor.execute(batch).token_ids) == 1


def test_soak_with_swap_tier_and_aborts_keeps_every_pool_consistent(tiny_llama):
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(8, 24))] for _ in range(12)]
    llm = LLM(tiny_llama, num_gpu_blocks_override=24, preemption_mode="swap",
              swap_space=gib(40), kv_offloading_size=gib(48),
              kv_offloading_eviction_policy="s3fifo",
              **{**COMMON, "max_num_seqs": 12, "max_model_len": 64})
    engine = llm.llm_engine
    kv = engine.kv_cache
    seen = {"swapped": 0, "loaded": 0, "spilled": 0, "aborted": 0, "aborted_swapped": 0}

    def watch(event):
        kv.check()
        seen["swapped"] += len(event.swapped_out)
        seen["loaded"] += len(event.blocks_loaded)
        seen["spilled"] += len(event.blocks_spilled)

    engine.subscribe(watch)
    live: list[str] = []
    for i in range(400):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 10))]
        params = SamplingParams(temperature=0, max_tokens=rng.randrange(1, 16), ignore_eos=True,
                                n=rng.choice((1, 1, 1, 2)))
        engine.add_request(f"s{i}", {"prompt_token_ids": prompt}, params)
        live.append(f"s{i}")
        if rng.random() < 0.5:
            engine.step()
        swapped = sorted(kv.swap.tables())
        if swapped and rng.random() < 0.1:  # aborted while swapped out
            engine.abort_request(rng.choice(swapped))
            seen["aborted_swapped"] += 1
            kv.check()
        elif rng.random() < 0.05:  # running, waiting or finished
            engine.abort_request(rng.choice(live))
            seen["aborted"] += 1
            kv.check()
    while engine.has_unfinished_requests():
        engine.step()
    assert min(seen.values()) > 0, seen
    assert_nothing_held(llm)
    assert kv.tier.pool.ref_counts.sum() == 0


def test_two_tensor_parallel_ranks_apply_the_same_transfers(tiny_llama):
    """Each rank moves its own shard of every block: same tokens as one rank."""
    from tests.engine.test_swap import workload

    prompts, params = workload()
    settings = {**COMMON, "device": "cpu", "cpu_threads": 1}
    reference = LLM(tiny_llama, **settings).generate(prompts + prompts, params, use_tqdm=False)
    llm = LLM(tiny_llama, tensor_parallel_size=2, num_gpu_blocks_override=40,
              preemption_mode="swap", swap_space=gib(256), kv_offloading_size=gib(512),
              **settings)
    try:
        tokens, events = run(llm, prompts + prompts, params)
    finally:
        llm.llm_engine.shutdown()
    assert tokens == [o.outputs[0].token_ids for o in reference]
    assert any(e.swapped_out for e in events) and any(e.blocks_loaded for e in events)


def test_the_kv_view_shows_both_tiers_live_and_replayed(tiny_llama, tmp_path):
    from llmlab.viz import KVCacheView, load

    llm = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
              swap_space=gib(256), kv_offloading_size=gib(512), **COMMON)
    first, second = conversations()
    llm.generate([{"prompt_token_ids": p} for p in first], PARAMS, use_tqdm=False)
    live = KVCacheView(llm, keep_frames=True)  # starts from a snapshot with a full tier
    assert live.frame.offload_cached > 0
    path = tmp_path / "tiers.jsonl"
    with llm.llm_engine.record(path):
        llm.generate([{"prompt_token_ids": p} for p in second], PARAMS, use_tqdm=False)
    tier = llm.llm_engine.kv_cache.tier
    assert live.frame.offload_cached == tier.num_cached_blocks
    assert max(f.swap_used for f in live.frames) > 0 and live.frame.swap_used == 0
    replay = KVCacheView(load(path))
    for position in range(len(live.frames)):
        assert replay.frame_at(position) == live.frames[position], position
    html = live.html()
    assert "offload tier" in html and "swap space" in html
