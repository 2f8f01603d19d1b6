"""The ``LLM`` class and ``Engine``: prefix caching, leaks, seeds, bad input, events."""

from __future__ import annotations

import random

import pytest
import torch

from llmlab import LLM, EngineBuilder, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", block_size=4, max_model_len=256, seed=0)


def token_prompts(n, length, seed=0, vocab=500):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)]


def assert_all_blocks_free(engine):
    snap = engine.kv_cache.snapshot()
    assert snap.block_tables == {}
    assert all(c == 0 for c in snap.ref_counts)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_outputs_are_in_input_order_with_vllm_shape(llm):
    prompts = ["Hello there", {"prompt": "The cat"}, {"prompt_token_ids": [5, 6, 7]}]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", "The cat", None]
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7]
    assert outs[2].prompt_token_ids == [5, 6, 7]
    tok = llm.get_tokenizer()
    assert outs[0].prompt_token_ids == tok.encode("Hello there")
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and c.index == 0
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.cumulative_logprob is None and c.logprobs is None  # not asked for (vLLM)


def test_prefix_caching_hits_and_matches_uncached_run(tiny_llama):
    rng = random.Random(1)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    first = [{"prompt_token_ids": shared + [rng.randrange(3, 500) for _ in range(5)]} for _ in range(3)]
    second = [{"prompt_token_ids": shared + [rng.randrange(3, 500) for _ in range(9)]} for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(enable):
        llm = LLM(tiny_llama, dtype="float32", block_size=4, enable_prefix_caching=enable)
        events = []
        llm.generate(first, params, use_tqdm=False)
        llm.llm_engine.subscribe(events.append)
        outs = llm.generate(second, params, use_tqdm=False)
        assert_all_blocks_free(llm.llm_engine)
        assert all(o.num_cached_tokens == (40 if enable else 0) for o in outs)
        return [o.outputs[0].token_ids for o in outs], sum(len(e.blocks_prefix_hit) for e in events)

    cached_tokens, hits = run(True)
    plain_tokens, no_hits = run(False)
    assert hits >= 3 * 10  # 40 shared tokens = 10 full blocks, for each of 3 requests
    assert no_hits == 0
    assert cached_tokens == plain_tokens


def test_abort_mid_generation_frees_everything(llm):
    engine = llm.llm_engine
    for i, p in enumerate(token_prompts(4, 30)):
        engine.add_request(f"abort-{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.has_unfinished_requests()
    engine.abort_request([f"abort-{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert_all_blocks_free(engine)


def test_engine_step_streams_cumulative_outputs(llm):
    engine = llm.llm_engine
    engine.add_request("stream", {"prompt_token_ids": [4, 5, 6]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [len(o.outputs[0].token_ids) for o in engine.step() if o.request_id == "stream"]
    assert seen == [1, 2, 3, 4]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    target = {"prompt_token_ids": [10, 20, 30, 40]}
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=12, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    crowd = token_prompts(5, 17, seed=3)
    mixed = llm.generate(crowd + [target], [noisy] * 5 + [params], use_tqdm=False)
    assert alone == again == mixed[-1].outputs[0].token_ids
    other_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=12, ignore_eos=True)
    assert llm.generate([target], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_engine_seed_makes_unseeded_sampling_reproducible(tiny_llama):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    runs = [
        LLM(tiny_llama, dtype="float32", seed=7).generate(token_prompts(3, 5), params, use_tqdm=False)
        for _ in range(2)
    ]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def test_top_k_one_equals_greedy(llm):
    prompts = token_prompts(4, 12, seed=5)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    top1 = llm.generate(prompts, SamplingParams(temperature=0.9, top_k=1, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ({"prompt_token_ids": list(range(3, 300))}, "max_model_len=256"),
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "1000000.*vocabulary"),
        ({"prompt_token_ids": [1, -1]}, "-1.*vocabulary"),
    ],
)
def test_bad_prompts_are_rejected_and_leave_nothing_behind(llm, prompt, match):
    engine = llm.llm_engine
    good = {"prompt_token_ids": [5, 6, 7]}
    with pytest.raises(ValueError, match=match):
        llm.generate([good, prompt], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(engine)


def test_bad_sampling_params_are_rejected():
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)


def test_unknown_architecture_lists_supported_ones(tmp_path, tiny_llama):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        LLM(str(bad))


def test_bad_engine_settings_are_rejected(tiny_llama):
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        LLM(tiny_llama, block_size=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model=tiny_llama, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(tiny_llama, max_model_len=100000)
    with pytest.raises(ValueError, match="needs .* blocks"):
        LLM(tiny_llama, max_model_len=256, block_size=4, num_gpu_blocks_override=10)
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(tiny_llama, max_num_sequences=4)
    with pytest.raises(ValueError, match="got 2 SamplingParams for 3 prompts"):
        LLM(tiny_llama).generate(["a", "b", "c"], [SamplingParams()] * 2, use_tqdm=False)


def test_step_events_account_for_every_block(llm):
    engine = llm.llm_engine
    events = []
    engine.subscribe(events.append)
    try:
        llm.generate(token_prompts(6, 21, seed=9), SamplingParams(max_tokens=5, ignore_eos=True),
                     use_tqdm=False)
    finally:
        engine.unsubscribe(events.append)
    assert [e.step_index for e in events] == list(range(events[0].step_index, events[0].step_index + len(events)))
    finished = [rid for e in events for rid, _ in e.finished]
    assert len(finished) == 6
    allocated = sum(len(e.blocks_allocated) for e in events)
    freed = sum(len(e.blocks_freed) for e in events)
    hits = sum(len(e.blocks_prefix_hit) for e in events)
    assert allocated > 0 and allocated + hits >= freed
    assert events[-1].kv_usage == 0.0
    assert all(e.wall_time_s >= e.model_time_s >= 0 for e in events)


def test_builder_swaps_a_component(tiny_llama):
    calls = []

    class CountingFCFS:
        name = "counting"

        def order(self, waiting, now):
            calls.append(len(waiting))
            return sorted(waiting, key=lambda r: r.arrival_time)

        def victim(self, candidates):
            return max(candidates, key=lambda r: r.arrival_time)

    engine = EngineBuilder(EngineConfig(model=tiny_llama)).with_scheduling_policy(CountingFCFS()).build()
    llm = LLM.from_engine(engine)
    llm.generate(token_prompts(2, 5), SamplingParams(max_tokens=2), use_tqdm=False)
    assert calls and calls[0] == 2


def test_kv_cache_is_sized_from_the_memory_budget(tiny_llama):
    from llmlab.cache.kv_tensors import bytes_per_block

    engine = LLM(tiny_llama, block_size=8, max_model_len=64, kv_cache_memory_bytes=1 << 20).llm_engine
    model = engine.executor.model
    per_block = bytes_per_block(model.kv_layout, 8, engine.executor.kv_caches[0].dtype)
    assert engine.kv_cache.num_blocks == (1 << 20) // per_block
    cache_bytes = sum(c.numel() * c.element_size() for c in engine.executor.kv_caches)
    assert cache_bytes == engine.kv_cache.num_blocks * per_block
    override = LLM(tiny_llama, block_size=8, max_model_len=64, num_gpu_blocks_override=9).llm_engine
    assert override.kv_cache.num_blocks == 9


def test_generation_config_eos_ids_stop_generation(tmp_path, tiny_llama):
    """Every EOS id of generation_config.json ends a request, as in vLLM (Llama 3 style)."""
    import json
    import shutil

    model = tmp_path / "multi-eos"
    shutil.copytree(tiny_llama, model)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": [7, 8, 9]}
    free_run = LLM(str(model)).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free_run[4]
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], stop_at]
    (model / "generation_config.json").write_text(json.dumps(gen))
    llm = LLM(str(model))
    assert stop_at in llm.llm_engine.eos_token_ids
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    first = free_run.index(stop_at)
    assert out.outputs[0].token_ids == free_run[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_components_by_registered_name(tiny_llama):
    from llmlab.cache import FIFOEviction

    llm = LLM(tiny_llama, eviction_policy="fifo", scheduling_policy="fcfs", attention_backend="torch")
    assert isinstance(llm.llm_engine.kv_cache.eviction, FIFOEviction)
    with pytest.raises(ValueError, match="unknown eviction_policy 'mru'; available: lru, fifo, random"):
        LLM(tiny_llama, eviction_policy="mru")


def test_profiling_pass_runs_the_peak_batch(tiny_llama, monkeypatch):
    """The CUDA profiling forward (run here on CPU with the CUDA calls stubbed)."""
    from llmlab.runner import build

    engine = LLM(tiny_llama, device="cpu", max_model_len=48, max_num_batched_tokens=100).llm_engine
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 10**9)
    seen = []
    model = engine.executor.model
    original = model.forward

    def spy(input_ids, positions, attn):
        seen.append((input_ids.shape[0], int(positions.max())))
        return original(input_ids, positions, attn)

    monkeypatch.setattr(model, "forward", spy)
    import attrs

    def runner_for(caches, num_blocks):
        return attrs.evolve(engine.executor, kv_caches=caches, num_kv_blocks=num_blocks)

    peak = build._profile_peak_bytes(
        runner_for, engine.executor.attention, model.kv_layout, engine.config, 48, torch.float32,
        torch.device("cpu"),
    )
    # 100 tokens as sequences of at most max_model_len=48 (48 + 48 + 4); cache excluded.
    assert seen == [(100, 47)]
    assert 0 < peak < 10**9


def test_a_stop_string_completed_by_the_last_allowed_token_is_a_stop():
    from llmlab.builtin import ensure_builtin_model

    llm = LLM(str(ensure_builtin_model()), dtype="float32")
    text = llm.generate("Once upon a time", SamplingParams(max_tokens=6, temperature=0),
                        use_tqdm=False)[0].outputs[0].text
    assert len(text) > 5
    for max_tokens in (6, 7):  # the 6th token completes the string: at the cap, and before it
        params = SamplingParams(max_tokens=max_tokens, stop=[text], temperature=0)
        out = llm.generate("Once upon a time", params,
                           use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", text), max_tokens
