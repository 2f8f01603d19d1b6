"""A 2,000-request soak through a tiny KV cache: hundreds of preemptions and evictions,
the same tokens as a roomy cache, nothing leaked, memory flat across repeated calls."""

from __future__ import annotations

import gc
import random

import pytest

from llmlab import LLM, SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    # Shared prefixes so prefix caching hits, and a cache small enough that it must evict.
    prefixes = [[rng.randrange(3, 500) for _ in range(16)] for _ in range(24)]
    prompts, params = [], []
    for _ in range(n):
        prefix = rng.choice(prefixes)[: rng.randrange(0, 17)]
        prompts.append({"prompt_token_ids": prefix + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 12))]})
        params.append(SamplingParams(temperature=0, max_tokens=rng.randrange(1, 10), ignore_eos=True))
    return prompts, params


@pytest.mark.slow
def test_soak_tiny_cache_matches_roomy_cache_and_leaks_nothing(tiny_llama):
    prompts, params = workload(2000)
    common = dict(dtype="float64", block_size=4, max_model_len=64, max_num_seqs=32, seed=0)
    roomy = LLM(tiny_llama, **common)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]

    tiny = LLM(tiny_llama, num_gpu_blocks_override=20, **common)
    engine = tiny.llm_engine
    stats = {"preempted": 0, "evicted": 0, "hits": 0}

    def count(event):
        stats["preempted"] += len(event.preempted)
        stats["evicted"] += len(event.blocks_evicted)
        stats["hits"] += len(event.blocks_prefix_hit)

    engine.subscribe(count)
    got, rss = [], []
    for start in range(0, 2000, 400):  # repeated calls on one engine
        chunk = slice(start, start + 400)
        got += [o.outputs[0].token_ids for o in tiny.generate(prompts[chunk], params[chunk], use_tqdm=False)]
        gc.collect()
        rss.append(rss_bytes())
        kv = engine.kv_cache
        kv.check()
        assert not engine.has_unfinished_requests() and engine._requests == {}
        # Every block is free: empty or cached (findable by prefix), none held.
        assert int(kv.pool.ref_counts.sum()) == 0 and kv.num_free_blocks == kv.num_blocks

    assert got == expected
    assert stats["preempted"] >= 100 and stats["evicted"] >= 100 and stats["hits"] > 0
    # Flat memory: after warm-up, repeated calls grow RSS by less than 24 MiB in total.
    assert max(rss[1:]) - rss[1] < 24 << 20, [r >> 20 for r in rss]
