"""Policies change order and timing, never results: every scheduling x eviction pair gives
the default's greedy tokens under a KV cache small enough to preempt and evict, and leaks
nothing. Plus a user's own policies, defined inline, registered and run by name."""

from __future__ import annotations

import random

import pytest

from llmlab import LLM, Policy, SamplingParams, register
from llmlab.entrypoints.cli import main as cli_main
from tests.helpers import builtin_names

SCHEDULING = builtin_names("scheduling_policy")
EVICTION = builtin_names("eviction_policy")


@pytest.fixture(scope="module")
def workload(tiny_llama):
    """Prompts sharing prefixes (so eviction matters), with priorities and users."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 200) for _ in range(20)] for _ in range(3)]
    prompts = []
    for i in range(12):
        suffix = [rng.randrange(3, 200) for _ in range(rng.randrange(1, 14))]
        prompts.append({"prompt_token_ids": prefixes[i % 3] + suffix})
    priority = [rng.randrange(3) for _ in prompts]
    user = [("alice", "bob", None)[i % 3] for i in range(len(prompts))]
    return prompts, priority, user


def run(path, workload, **kwargs):
    prompts, priority, user = workload
    llm = LLM(path, dtype="float32", seed=0, **kwargs)
    events = []
    llm.llm_engine.subscribe(events.append)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=priority, user=user)
    return llm, [o.outputs[0].token_ids for o in outs], events


@pytest.fixture(scope="module")
def reference(tiny_llama, workload):
    return run(tiny_llama, workload)[1]


@pytest.mark.parametrize("eviction", EVICTION)
@pytest.mark.parametrize("scheduling", SCHEDULING)
def test_every_policy_pair_gives_the_default_tokens(
    tiny_llama, workload, reference, scheduling, eviction
):
    # 32 blocks of 4 tokens (128 positions) for 12 requests of up to 45 tokens, with a
    # 24-token budget: prompts are chunked, requests preempted, cached blocks evicted.
    llm, got, events = run(
        tiny_llama, workload, scheduling_policy=scheduling, eviction_policy=eviction,
        block_size=4, max_model_len=128, num_gpu_blocks_override=32, max_num_batched_tokens=24,
    )
    assert got == reference
    assert sum(len(e.preempted) for e in events) > 0
    assert sum(len(e.blocks_evicted) for e in events) > 0
    assert sum(len(e.blocks_prefix_hit) for e in events) > 0
    kv = llm.llm_engine.kv_cache
    kv.check()
    snap = kv.snapshot()
    assert snap.block_tables == {} and not snap.ref_counts.any()
    assert snap.num_free_blocks == kv.num_blocks


# -- a researcher's own policies, inline -----------------------------------------------


@register("scheduling_policy", "test_longest_prompt_first")
class LongestPromptFirst(Policy):
    """Admit the longest prompt first (a test policy)."""

    name = "test_longest_prompt_first"

    def key(self, request):
        return -request.num_prompt_tokens


@register("eviction_policy", "test_mru")
class MostRecentlyFreed:
    """Evict the most recently freed block first (a test policy)."""

    name = "test_mru"

    def __init__(self):
        self.stack = {}  # insertion-ordered: the last freed is last

    def on_free(self, block_ids):
        self.stack.update(dict.fromkeys(block_ids))

    def on_hit(self, block_ids):
        for b in block_ids:
            self.stack.pop(b, None)

    def evict(self, n):
        return [self.stack.popitem()[0] for _ in range(n)]


def test_inline_policies_run_by_name_through_llm_and_the_cli(
    tiny_llama, workload, reference, capsys
):
    llm, got, events = run(
        tiny_llama, workload, scheduling_policy="test_longest_prompt_first",
        eviction_policy="test_mru", block_size=4, max_model_len=128,
        num_gpu_blocks_override=32, max_num_batched_tokens=24,
    )
    assert got == reference
    assert isinstance(llm.llm_engine.kv_cache.eviction, MostRecentlyFreed)
    assert sum(len(e.blocks_evicted) for e in events) > 0
    # The longest prompt was admitted first.
    lengths = {str(i): len(p["prompt_token_ids"]) for i, p in enumerate(workload[0])}
    first = events[0].scheduled[0][0]
    assert lengths[first] == max(lengths.values())

    rc = cli_main([
        "generate", "Hello", "--model", tiny_llama, "--max-tokens", "3",
        "--scheduling-policy", "test_longest_prompt_first", "--eviction-policy", "test_mru",
    ])
    assert rc == 0 and "Completion:" in capsys.readouterr().out


def test_unknown_policy_names_list_the_available_ones(tiny_llama):
    with pytest.raises(
        ValueError, match="unknown scheduling_policy 'lifo'; available: fcfs, priority"
    ):
        LLM(tiny_llama, scheduling_policy="lifo")
    with pytest.raises(ValueError, match="unknown eviction_policy 'lifo'; available: lru, fifo"):
        LLM(tiny_llama, eviction_policy="lifo")


def test_a_policy_missing_a_method_fails_at_build_time(tiny_llama, monkeypatch):
    from llmlab.runner import build

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the policy was checked")

    monkeypatch.setattr(build, "load_model", no_loading)

    class NoVictim:
        name = "no_victim"

        def order(self, waiting, now):
            return waiting

    with pytest.raises(TypeError, match="missing method 'victim'"):
        LLM(tiny_llama, scheduling_policy=NoVictim())

    class NoEvict:
        name = "no_evict"

        def on_free(self, ids): ...
        def on_hit(self, ids): ...

    with pytest.raises(TypeError, match="missing method 'evict'"):
        LLM(tiny_llama, eviction_policy=NoEvict())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(priority=[1]), "got 1 values for priority but 2 prompts"),
        (dict(priority=[1, "high"]), r"priority\[1\] must be an int"),
        (dict(priority=2.5), "priority must be a list"),  # a scalar int applies to all
        (dict(user=["a"]), "got 1 values for user but 2 prompts"),
        (dict(user=["a", 7]), r"user\[1\] must be a str or None"),
        (dict(user=7), "user must be a list"),  # a scalar str applies to all
    ],
)
def test_bad_priority_or_user_lists_queue_nothing(tiny_llama, kwargs, match):
    llm = LLM(tiny_llama, dtype="float32")
    with pytest.raises(ValueError, match=match):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, **kwargs)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_priority_and_user_reach_the_policy_and_the_step_events(tiny_llama):
    seen = {}

    class Spy(Policy):
        name = "spy"

        def push(self, request, now):
            seen[request.request_id] = (request.priority, request.user)
            super().push(request, now)

    llm = LLM(tiny_llama, dtype="float32", scheduling_policy=Spy())
    events = []
    llm.llm_engine.subscribe(events.append)
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False,
                 priority=[2, -1], user=["ann", None])
    assert sorted(seen.values(), key=str) == sorted([(2, "ann"), (-1, None)], key=str)
    first = events[0]
    assert len(first.scheduled_users) == len(first.scheduled) == len(first.scheduled_priorities)
    assert set(zip(first.scheduled_users, first.scheduled_priorities)) == {("ann", 2), (None, -1)}
