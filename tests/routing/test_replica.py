"""``EngineReplica``: a running engine as a router sees it (outstanding work, a read-only
probe of its prefix cache), followed from step events only."""

from __future__ import annotations

import attrs

from llmlab import SamplingParams
from llmlab.routing.replica import EngineReplica
from llmlab.sim import BatchShape, sim_engine
from llmlab.sim.roofline import ModelShape

SHAPE = ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=64, vocab_size=100)


@attrs.define
class Fixed:
    def step_time(self, shape: BatchShape) -> float:
        return 0.001


def engine(**kw):
    settings = {"block_size": 4, "max_model_len": 32, "max_num_seqs": 2,
                "num_gpu_blocks_override": 12, "max_num_batched_tokens": 16, **kw}
    return sim_engine(SHAPE, cost_model=Fixed(), **settings)


def run(e, view, requests):
    for rid, prompt, max_tokens in requests:
        view.routed(rid, len(prompt), max_tokens)
        e.add_request(rid, {"prompt_token_ids": prompt},
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    trace = []
    while e.has_unfinished_requests():
        e.step()
        trace.append(view.outstanding_tokens)
    return trace


def test_outstanding_tokens_fall_as_work_is_done_and_reach_zero_through_preemption():
    e = engine()
    view = EngineReplica(0, e)
    requests = [(f"r{i}", [2 + i] * 14, 12) for i in range(4)]
    assert view.num_waiting == view.num_running == 0
    trace = run(e, view, requests)
    assert trace[-1] == 0 and max(trace) <= 4 * (14 + 12)
    assert any(b > a for a, b in zip(trace, trace[1:]))  # a preemption put work back


def test_the_prefix_probe_sees_cached_full_blocks_and_changes_nothing():
    e = engine(num_gpu_blocks_override=40, max_num_seqs=4)
    view = EngineReplica(0, e)
    prompt = list(range(2, 16))  # 14 tokens: 3 full blocks of 4
    assert view.cached_prefix_tokens(prompt) == 0
    run(e, view, [("a", prompt, 2)])
    before = e.kv_cache.snapshot()
    assert view.cached_prefix_tokens(prompt) == 12
    assert view.cached_prefix_tokens(prompt[:9] + [99, 98, 97]) == 8  # diverges in block 3
    assert view.cached_prefix_tokens(prompt[:5]) == 4  # the last token is always computed
    assert view.cached_prefix_tokens([50] + prompt) == 0
    assert e.kv_cache.snapshot() == before
    e.kv_cache.check()


def test_no_prefix_caching_means_no_cached_prefix():
    e = engine(enable_prefix_caching=False)
    view = EngineReplica(0, e)
    prompt = list(range(2, 16))
    run(e, view, [("a", prompt, 2)])
    assert view.cached_prefix_tokens(prompt) == 0
