"""KV presses inside the paged engine: compaction against an HF reference, identity at ratio
0, block accounting (check(), preemption, abort, forks), the prefix cache, and failures.

The reference (:mod:`tests.kvpress.hf_reference`) decodes with a transformers cache cut down
per (layer, KV head) by the same selection rule, keeping original positions; the engine must
produce the same greedy tokens on every backend.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.attention.triton_backend import triton_unavailable_reason
from llmlab.kvpress import KnormPress, KVPress, PyramidPress, kept_count
from llmlab.kvpress.base import PressInput
from tests.engine.test_hf_parity import assert_no_leaks
from tests.kvpress.hf_reference import hf_greedy_with_eviction, sinks_and_window

BACKENDS = ["cpu", "torch"] if not torch.cuda.is_available() else ["triton", "torch"]
_TRITON_REASON = triton_unavailable_reason(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
needs_triton = pytest.mark.skipif(_TRITON_REASON is not None, reason=str(_TRITON_REASON))
PRESSES = ["streaming_llm", "h2o", "snapkv", "tova", "knorm", "random", "pyramid"]


def _prompts(vocab: int, lengths=(23, 40, 57)) -> list[list[int]]:
    """Prompts of distinct tokens: a repeated token has the same key norm at layer 0 up to
    rounding (rotary keeps norms), and a near-tie at a press's budget boundary would be
    broken by float noise, differently here and in the HF reference."""
    rng = random.Random(0)
    return [rng.sample(range(3, vocab), n) for n in lengths]


def _llm(path, backend=BACKENDS[0], **settings) -> LLM:
    settings.setdefault("num_gpu_blocks_override", 64)
    settings.setdefault("max_model_len", 256)
    return LLM(
        path, dtype="float32", seed=0, attention_backend=backend, block_size=8,
        enforce_eager=True, **settings,
    )


def _generate(llm, prompts, max_tokens=12, extra_args=None):
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _checked(llm) -> list:
    """Subscribe an observer that checks the cache after every step; returns the events."""
    events = []

    def observe(event):
        llm.llm_engine.kv_cache.check()
        events.append(event)

    llm.llm_engine.subscribe(observe)
    return events


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def baseline(tiny_llama):
    """Greedy tokens without a press, per backend."""
    cache = {}

    def get(backend):
        if backend not in cache:
            prompts = _prompts(_vocab(tiny_llama))
            cache[backend] = _generate(_llm(tiny_llama, backend), prompts)
        return cache[backend]

    return get


def _vocab(path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("press", PRESSES)
def test_ratio_zero_is_token_identical(tiny_llama, baseline, backend, press):
    """Keeping everything still runs the press and moves every token to fresh blocks; the
    tokens must not change."""
    llm = _llm(tiny_llama, backend, kv_press=press, kv_press_config={"compression_ratio": 0.0})
    events = _checked(llm)
    got = _generate(llm, _prompts(_vocab(tiny_llama)))
    assert got == baseline(backend)
    compactions = [c for e in events for c in e.kv_compacted]
    assert len(compactions) == 3 and all(c.error is None for c in compactions)
    assert all(c.kept == c.before for c in compactions)
    assert_no_leaks(llm)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("every", [None, 1, 3])
def test_streaming_llm_matches_hf_sinks_and_window(tiny_llama, hf_model, backend, every):
    n_sink, window = 4, 12
    llm = _llm(
        tiny_llama, backend, kv_press="streaming_llm",
        kv_press_config={"n_sink": n_sink, "window": window, "compress_every": every},
    )
    _checked(llm)
    prompts = _prompts(_vocab(tiny_llama))
    got = _generate(llm, prompts, max_tokens=16)
    expected = [
        hf_greedy_with_eviction(hf_model, p, 16, sinks_and_window(n_sink, window), every)
        for p in prompts
    ]
    assert got == expected
    def keep_all(layer, keys, n):
        return torch.arange(keys.shape[1]).expand(keys.shape[0], -1)

    plain = [hf_greedy_with_eviction(hf_model, p, 16, keep_all) for p in prompts]
    assert got != plain  # the window changed something, so the comparison means something
    assert_no_leaks(llm)


def _lowest_norms(keys: torch.Tensor, budget: int) -> torch.Tensor:
    """Per head, the ``budget`` keys of lowest norm (ties: the later one), ascending."""
    n = keys.shape[1]
    order = keys.float().norm(dim=-1).flip(-1).argsort(dim=-1, stable=True)[:, :budget]
    return (n - 1 - order).sort(dim=-1).values


def _knorm_keep(keep: float):
    def select(layer, keys, context_len):
        return _lowest_norms(keys, kept_count(context_len, keep))

    return select


@pytest.mark.parametrize("backend", BACKENDS)
def test_knorm_per_head_selection_matches_hf(tiny_llama, hf_model, backend):
    """Each KV head keeps its own lowest-norm keys (different tokens per head)."""
    llm = _llm(tiny_llama, backend, kv_press="knorm", kv_press_config={"compression_ratio": 0.5})
    events = _checked(llm)
    prompts = _prompts(_vocab(tiny_llama))
    got = _generate(llm, prompts)
    expected = [hf_greedy_with_eviction(hf_model, p, 12, _knorm_keep(0.5)) for p in prompts]
    assert got == expected
    for c in (c for e in events for c in e.kv_compacted):
        assert c.kept == (kept_count(c.context_len, 0.5),) * len(c.kept)  # exact budget
    assert_no_leaks(llm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_layer_budgets_match_hf(tiny_llama, hf_model, backend):
    """pyramid(knorm): every layer keeps its own count, read through per-layer lengths."""
    press = PyramidPress(press=KnormPress(), compression_ratio=0.5, beta=4)
    llm = _llm(tiny_llama, backend, kv_press=press)
    events = _checked(llm)
    prompts = _prompts(_vocab(tiny_llama))
    got = _generate(llm, prompts)

    def keep(context_len):
        budgets = press.layer_budgets(context_len, 0.5, hf_model.config.num_hidden_layers)

        def select(layer, keys, n):
            return _lowest_norms(keys, budgets[layer])

        return select

    expected = [hf_greedy_with_eviction(hf_model, p, 12, keep(len(p))) for p in prompts]
    assert got == expected
    kept = [c.kept for e in events for c in e.kv_compacted]
    assert kept and all(len(set(k)) > 1 for k in kept)  # the layers really differ
    assert_no_leaks(llm)


@pytest.mark.parametrize("press", ["knorm", "random"])
def test_exact_budget_per_layer_and_head(tiny_llama, press):
    llm = _llm(tiny_llama, kv_press=press, kv_press_config={"compression_ratio": 0.3})
    events = _checked(llm)
    prompts = _prompts(_vocab(tiny_llama))
    _generate(llm, prompts, extra_args={"kv_budget": 0.4})  # the request's own budget wins
    compactions = [c for e in events for c in e.kv_compacted]
    assert len(compactions) == len(prompts)
    for c in compactions:
        assert c.kept == (kept_count(c.context_len, 0.4),) * len(c.kept)
        assert c.tokens_dropped == c.before[0] - c.kept[0] > 0


def test_compaction_frees_blocks(tiny_llama):
    llm = _llm(tiny_llama, kv_press="knorm", kv_press_config={"compression_ratio": 0.75})
    events = _checked(llm)
    _generate(llm, [_prompts(_vocab(tiny_llama), (120,))[0]], max_tokens=2)
    step = next(e for e in events if e.kv_compacted)
    c = step.kv_compacted[0]
    assert c.context_len == 120 and c.kept[0] == 30
    # 120 tokens in 15 blocks of 8 -> 30 kept in 4: 11 blocks back in the pool.
    assert dict(step.block_tables)[step.scheduled[0][0]] and len(
        dict(step.block_tables)[step.scheduled[0][0]]) == 4
    assert step.kv_dropped == (90,)


def test_periodic_compaction_bounds_the_cache(tiny_llama):
    llm = _llm(tiny_llama, kv_press="streaming_llm",
               kv_press_config={"n_sink": 2, "window": 14, "compress_every": 8})
    events = _checked(llm)
    _generate(llm, _prompts(_vocab(tiny_llama), (40,)), max_tokens=40)
    compactions = [c for e in events for c in e.kv_compacted]
    assert len(compactions) == 1 + 40 // 8 - (1 if 40 % 8 == 0 else 0)
    assert all(max(c.kept) == 16 for c in compactions)
    # the cache never holds more than the budget plus the steps between compactions
    held = [n - d for e in events for n, d in zip(e.num_computed, e.kv_dropped)]
    assert max(held) <= 16 + 8


def test_preemption_and_abort_free_every_block(tiny_llama):
    llm = _llm(tiny_llama, kv_press="snapkv", kv_press_config={"compression_ratio": 0.5},
               num_gpu_blocks_override=14, max_num_batched_tokens=32,
               max_model_len=96)
    events = _checked(llm)
    prompts = _prompts(_vocab(tiny_llama), (30, 35, 40, 45))
    outs = _generate(llm, prompts, max_tokens=30)
    assert all(len(o) == 30 for o in outs)
    assert any(e.preempted for e in events)  # the pool was too small: it recomputed
    assert_no_leaks(llm)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    for _ in range(8):
        engine.step()
    assert any(r.kv_compressed for r in engine.scheduler.running)
    engine.abort_request([f"a{i}" for i in range(len(prompts))])
    engine.kv_cache.check()
    assert_no_leaks(llm)


def test_parallel_samples_share_compacted_blocks(tiny_llama):
    llm = _llm(tiny_llama, kv_press="knorm", kv_press_config={"compression_ratio": 0.5})
    _checked(llm)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": _prompts(_vocab(tiny_llama), (40,))[0]}], params,
                       use_tqdm=False)
    assert len(out[0].outputs) == 3 and all(len(o.token_ids) == 10 for o in out[0].outputs)
    assert_no_leaks(llm)


def test_compressed_blocks_never_serve_prefix_hits(tiny_llama):
    """A compressed request's kept blocks never enter the prefix index; an uncompressed
    request with the same prompt afterwards gets exactly its press-less tokens (the only
    blocks it may share are full-fidelity ones computed before the compaction)."""
    prompt = _prompts(_vocab(tiny_llama), (64,))[0]
    plain = _generate(_llm(tiny_llama), [prompt])
    llm = _llm(tiny_llama, kv_press="knorm", kv_press_config={"compression_ratio": 0.5})
    engine = llm.llm_engine
    compacted_blocks: set[int] = set()

    def observe(event):
        engine.kv_cache.check()
        kv = engine.kv_cache
        for request in engine.scheduler.running:
            if request.kv_compressed:
                table = kv.block_table(request.request_id)
                compacted_blocks.update(table)
                assert not kv.pool.cached[list(table)].any()

    engine.subscribe(observe)
    compressed = _generate(llm, [prompt], max_tokens=12)
    assert compressed != plain
    events = _checked(llm)
    again = _generate(llm, [prompt], extra_args={"kv_press": False})
    assert again == plain
    hits = {b for e in events for b in e.blocks_prefix_hit}
    assert hits and not hits & compacted_blocks
    assert_no_leaks(llm)


class _Raises(KVPress):
    name = "raises"

    def score(self, layer: PressInput):
        raise RuntimeError("boom")


class _WrongShape(KVPress):
    name = "wrong_shape"

    def score(self, layer: PressInput):
        return torch.zeros(layer.num_tokens + 1)


@pytest.mark.parametrize("press", [_Raises(compression_ratio=0.5), _WrongShape(compression_ratio=0.5)])
def test_failing_press_is_reported_and_the_request_goes_on(tiny_llama, baseline, press, caplog):
    llm = _llm(tiny_llama, kv_press=press)
    events = _checked(llm)
    with caplog.at_level(logging.WARNING):
        got = _generate(llm, _prompts(_vocab(tiny_llama)))
    assert got == baseline(BACKENDS[0])  # uncompressed, so exactly the press-less tokens
    failures = [c for e in events for c in e.kv_compacted]
    assert len(failures) == 3 and all(c.error and type(press).__name__ in c.error
                                      for c in failures)
    assert all(c.kept == c.before for c in failures)
    assert type(press).__name__ in caplog.text
    assert_no_leaks(llm)


def test_budget_outside_range_is_a_value_error(tiny_llama):
    for bad in (0, 1.5, -0.1, "half"):
        with pytest.raises(ValueError, match=r"kv_budget"):
            SamplingParams(extra_args={"kv_budget": bad})
    with pytest.raises(ValueError, match="compression_ratio"):
        _llm(tiny_llama, kv_press="knorm", kv_press_config={"compression_ratio": 1.0})
    with pytest.raises(ValueError, match="kv_budget"):
        _generate(_llm(tiny_llama), [[5, 6, 7]], extra_args={"kv_budget": 0.5})
    with pytest.raises(ValueError, match="unknown kv_press 'nope'"):
        _llm(tiny_llama, kv_press="nope")
    with pytest.raises(ValueError, match="speculative_config"):
        _llm(tiny_llama, kv_press="knorm",
             speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_swap_preemption_recomputes_compressed_requests(tiny_llama):
    llm = _llm(tiny_llama, kv_press="knorm", kv_press_config={"compression_ratio": 0.5},
               num_gpu_blocks_override=14, max_num_batched_tokens=32, preemption_mode="swap",
               max_model_len=96,
               swap_space=0.01)
    events = _checked(llm)
    outs = _generate(llm, _prompts(_vocab(tiny_llama), (30, 35, 40, 45)), max_tokens=30)
    assert all(len(o) == 30 for o in outs)
    assert any(e.preempted for e in events)
    assert_no_leaks(llm)


@pytest.mark.slow  # about 25 s: nine engines in Triton's interpreter
@needs_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the tests above run triton")
def test_triton_interpreter_ratio_zero_and_compaction_match_hf(tiny_llama, hf_model):
    """The Triton kernels (in the interpreter here) read compacted rows and per-layer lengths
    as the other backends do: identity at ratio 0, and knorm / pyramid(knorm) against HF."""
    prompts = _prompts(_vocab(tiny_llama), (21, 30))
    plain = _generate(_llm(tiny_llama, "triton"), prompts, max_tokens=6)
    for press in PRESSES:
        llm = _llm(tiny_llama, "triton", kv_press=press,
                   kv_press_config={"compression_ratio": 0.0})
        assert _generate(llm, prompts, max_tokens=6) == plain, press
    llm = _llm(tiny_llama, "triton", kv_press="knorm", kv_press_config={"compression_ratio": 0.5})
    _checked(llm)
    expected = [hf_greedy_with_eviction(hf_model, p, 6, _knorm_keep(0.5)) for p in prompts]
    assert _generate(llm, prompts, max_tokens=6) == expected
    press = PyramidPress(press=KnormPress(), compression_ratio=0.5, beta=4)
    llm = _llm(tiny_llama, "triton", kv_press=press)
    _checked(llm)
    got = _generate(llm, prompts, max_tokens=6)

    def keep(context_len):
        budgets = press.layer_budgets(context_len, 0.5, hf_model.config.num_hidden_layers)

        def select(layer, keys, n):
            return _lowest_norms(keys, budgets[layer])

        return select

    assert got == [hf_greedy_with_eviction(hf_model, p, 6, keep(len(p))) for p in prompts]
    assert_no_leaks(llm)


@pytest.mark.parametrize("press", ["snapkv", "h2o", "tova"])
def test_queries_kept_across_prefill_chunks_and_prefix_hits(tiny_llama, press):
    """A press reading queries sees the same ones whether the prompt is computed in one step,
    in chunks, or after a prefix-cache hit (the hit stops before the window)."""
    prompts = _prompts(_vocab(tiny_llama), (70, 90))
    config = {"compression_ratio": 0.5}
    whole = _generate(_llm(tiny_llama, kv_press=press, kv_press_config=config,
                           max_num_batched_tokens=512), prompts)
    llm = _llm(tiny_llama, kv_press=press, kv_press_config=config, max_num_batched_tokens=24)
    events = _checked(llm)
    assert _generate(llm, prompts) == whole  # chunks of 24 tokens
    again = _generate(llm, prompts)  # the same prompts: prefix hits, short of the window
    assert again == whole
    hits = sum(a.num_cached_tokens for e in events for a in e.admitted)
    assert hits > 0 if press != "h2o" else hits == 0  # h2o reads every prompt query


def test_the_command_line_takes_a_press_and_refuses_a_bad_one(tiny_llama, capsys):
    from llmlab.entrypoints.cli import main

    args = ["generate", "Hi there, how are you", "--model", tiny_llama, "--max-tokens", "4",
            "--dtype", "float32"]
    assert main([*args, "--kv-press", "knorm", "--kv-press-config",
                 '{"compression_ratio": 0.0}']) == 0
    pressed = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == pressed  # ratio 0 keeps everything
    assert main([*args, "--kv-press", "knorm", "--kv-press-config",
                 '{"compression_ratio": 2}']) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compression_ratio" in err[0], err
    assert main([*args, "--kv-press-config", '{"compression_ratio": 0.5}']) == 2
    assert "kv_press" in capsys.readouterr().err


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_pool_compacts_in_place(tiny_llama, backend):
    """No free blocks for the kept tokens: the request compacts into its own first blocks
    (it alone holds them) and gives the rest back, with the tokens of a roomy pool."""
    prompt = _prompts(_vocab(tiny_llama), (110,))[0]
    config = {"compression_ratio": 0.5}
    roomy = _generate(_llm(tiny_llama, backend, kv_press="knorm", kv_press_config=config),
                      [prompt])
    llm = _llm(tiny_llama, backend, kv_press="knorm", kv_press_config=config,
               num_gpu_blocks_override=16, max_model_len=128)
    events = _checked(llm)
    assert _generate(llm, [prompt]) == roomy
    step = next(e for e in events if e.kv_compacted)
    assert len(step.blocks_allocated) == -(-110 // 8)  # the prompt's: no fresh targets
    table = dict(step.block_tables)[step.scheduled[0][0]]
    assert len(table) == -(-kept_count(110, 0.5) // 8) and len(step.blocks_freed) > 0
    assert_no_leaks(llm)


def test_in_place_compaction_only_for_blocks_the_request_alone_holds():
    """The cache manager's side: fresh blocks while the pool has them; in a full pool the
    request's own first blocks, de-indexed at once, only if no other request holds any of
    its blocks; cancel keeps the table, commit gives the tail back."""
    from llmlab.cache.kv_cache_manager import KVCacheManager
    from tests.helpers import make_request

    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request(range(1, 25))  # 24 tokens: 6 blocks
    assert kv.allocate(a, 24)
    a.num_computed_tokens = 24
    kv.cache_computed_blocks(a)
    b = make_request(range(1, 9))
    assert kv.lookup_prefix(b) == list(kv.block_table(a.request_id)[:1])
    assert kv.allocate(b, 1, kv.lookup_prefix(b))  # b shares a's first block
    assert kv.begin_compaction(a, 3) is None  # 1 free block, and a block is shared
    kv.free(b)
    table = kv.block_table(a.request_id)
    assert kv.begin_compaction(a, 3) == (table[:3], True)
    assert not kv.pool.cached[list(table)].any()  # nobody can hit what is rewritten
    assert kv.lookup_prefix(make_request(range(1, 9))) == []
    kv.check()
    kv.cancel_compaction(a)
    assert kv.block_table(a.request_id) == table
    assert kv.begin_compaction(a, 3) == (table[:3], True)
    kv.commit_compaction(a)
    assert kv.block_table(a.request_id) == table[:3] and kv.num_free_blocks == 5
    kv.check()
    c = make_request(range(30, 34))
    assert kv.allocate(c, 4)
    targets, in_place = kv.begin_compaction(c, 2)  # 4 free: fresh ones
    assert not in_place and not set(targets) & set(kv.block_table(c.request_id))
    kv.check()
    kv.free(c)
    kv.free(a)
    assert kv.num_free_blocks == 8
    kv.check()


@pytest.mark.parametrize("press", ["knorm", "snapkv"])
def test_a_tight_pool_with_shared_prefixes_stays_consistent(tiny_llama, press):
    """Prompts sharing prefixes, chunked prefill and a pool too small for them: fresh and
    in-place compactions, waits and preemptions; check() after every step, every request
    finishes, nothing leaks."""
    rng = random.Random(3)
    vocab = _vocab(tiny_llama)
    stems = [rng.sample(range(3, vocab), 40) for _ in range(2)]
    prompts = [stems[i % 2] + rng.sample(range(3, vocab), 5 + i) for i in range(8)]
    llm = _llm(tiny_llama, kv_press=press, kv_press_config={"compression_ratio": 0.5},
               num_gpu_blocks_override=20, max_model_len=96, max_num_batched_tokens=40)
    events = _checked(llm)
    got = _generate(llm, prompts, max_tokens=20)
    assert all(len(g) == 20 for g in got)
    assert sum(1 for e in events for a in e.admitted if a.num_cached_tokens) >= 1
    assert sum(1 for e in events for c in e.kv_compacted if c.error is None) >= len(prompts)
    assert_no_leaks(llm)
