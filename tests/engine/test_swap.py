"""Swap preemption (``preemption_mode="swap"``): a preempted request's KV goes to a host
pool and comes back, so it resumes without recomputing; same greedy tokens as
recompute-only; host blocks never leak; a full swap space falls back to recompute."""

from __future__ import annotations

import random

import pytest

from llmlab import LLM, SamplingParams
from llmlab.errors import ComponentError
from llmlab.scheduler.policies import FCFS

COMMON = dict(dtype="float64", block_size=4, max_model_len=128, max_num_seqs=8, seed=0)
# One block of the tiny Llama at float64 and block_size 4: 2 layers x K,V x 2 heads x
# 4 tokens x 16 dims x 8 bytes.
BLOCK_BYTES = 4096


def gib(num_blocks: int) -> float:
    return num_blocks * BLOCK_BYTES / (1 << 30)


def workload(n: int = 12, seed: int = 0):
    rng = random.Random(seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(20, 40))]}
        for _ in range(n)
    ]
    return prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy tokens of the plain engine: roomy cache, recompute only, one tier."""
    prompts, params = workload()
    llm = LLM(tiny_llama, **COMMON)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run(llm, prompts, params):
    """Tokens, and every step event, with the cache manager checked after each step."""
    engine = llm.llm_engine
    events = []

    def watch(event):
        engine.kv_cache.check()
        events.append(event)

    engine.subscribe(watch)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine.unsubscribe(watch)
    return tokens, events


def assert_nothing_held(llm):
    kv = llm.llm_engine.kv_cache
    kv.check()
    assert int(kv.pool.ref_counts.sum()) == 0 and kv.num_free_blocks == kv.num_blocks
    if kv.swap is not None:
        assert kv.swap.num_used_blocks == 0 and kv.swap.tables() == {}


def test_swap_preemption_matches_recompute_and_skips_the_recompute(tiny_llama, reference):
    prompts, params = workload()
    swap = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
               swap_space=gib(256), **COMMON)
    tokens, events = run(swap, prompts, params)
    assert tokens == reference
    swapped_out = [s for e in events for s in e.swapped_out]
    swapped_in = [s for e in events for s in e.swapped_in]
    assert len(swapped_out) >= 3 and sorted(swapped_out) == sorted(swapped_in)
    assert all(rid in e.preempted for e in events for rid, _ in e.swapped_out)
    resumed = [a for e in events for a in e.admitted if a.num_swapped_tokens]
    assert len(resumed) == len(swapped_in)
    assert all(a.resumed and a.num_cached_tokens == 0 for a in resumed)
    assert_nothing_held(swap)

    # The same tiny cache preempting by recompute prefills the victims' tokens again.
    recompute = LLM(tiny_llama, num_gpu_blocks_override=40, **COMMON)
    tokens_r, events_r = run(recompute, prompts, params)
    assert tokens_r == reference
    assert sum(len(e.preempted) for e in events_r) > 0
    prefill = sum(e.num_prefill_tokens for e in events)
    prefill_r = sum(e.num_prefill_tokens for e in events_r)
    assert prefill < prefill_r


def test_a_full_swap_space_falls_back_to_recompute(tiny_llama, reference):
    prompts, params = workload()
    # Room for 9 blocks: one long victim at most; the others are recomputed.
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
              swap_space=gib(9), **COMMON)
    tokens, events = run(llm, prompts, params)
    assert tokens == reference
    preempted = [rid for e in events for rid in e.preempted]
    swapped = [rid for e in events for rid, _ in e.swapped_out]
    assert swapped and len(swapped) < len(preempted)  # both kinds happened
    assert max(e.num_swap_blocks_used for e in events) <= 9
    assert_nothing_held(llm)


def test_abort_while_swapped_out_frees_its_host_blocks(tiny_llama):
    prompts, params = workload()
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
              swap_space=gib(256), **COMMON)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    victim = None
    while engine.has_unfinished_requests() and victim is None:
        engine.step()
        swapped = engine.kv_cache.swap.tables()
        victim = next(iter(swapped), None)
    assert victim is not None, "no request was swapped out"
    used = engine.kv_cache.swap.num_used_blocks
    events = []
    engine.subscribe(events.append)
    engine.abort_request(victim)
    engine.kv_cache.check()
    assert not engine.kv_cache.swap.holds(victim)
    assert engine.kv_cache.swap.num_used_blocks == used - len(swapped[victim])
    while engine.has_unfinished_requests():
        engine.step()
    assert victim in events[0].aborted
    assert_nothing_held(llm)


class RecomputeAlways(FCFS):
    name = "recompute_always"

    def __init__(self):
        super().__init__()
        self.asked = 0

    def preemption_mode(self, victim):
        self.asked += 1
        return "recompute"


class Undecided(FCFS):
    name = "undecided"

    def preemption_mode(self, victim):
        return "sometimes"


def test_a_policy_chooses_the_preemption_mode_per_victim(tiny_llama, reference):
    prompts, params = workload()
    policy = RecomputeAlways()
    llm = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
              swap_space=gib(256), scheduling_policy=policy, **COMMON)
    tokens, events = run(llm, prompts, params)
    assert tokens == reference
    assert policy.asked == sum(len(e.preempted) for e in events) > 0
    assert not any(e.swapped_out for e in events)

    bad = LLM(tiny_llama, num_gpu_blocks_override=40, preemption_mode="swap",
              swap_space=gib(256), scheduling_policy=Undecided(), **COMMON)
    with pytest.raises(ComponentError, match="preemption_mode"):
        bad.generate(prompts, params, use_tqdm=False)
    assert_nothing_held(bad)


def test_swap_space_too_small_for_one_block_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="swap_space.*holds no KV block"):
        LLM(tiny_llama, preemption_mode="swap", swap_space=gib(1) / 2, **COMMON)
