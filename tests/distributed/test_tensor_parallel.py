"""Tensor parallelism on CPU (gloo): the same tokens as one rank, hard edges, dead workers.

Every test here starts worker processes (spawned: each imports torch, ~3 s); an engine with
``tensor_parallel_size=2`` is built once per architecture and runs one workload that goes
through chunked prefill, prefix hits, preemption, parallel sampling (n > 1, seeded) and a
grammar, compared with the same workload on one rank.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.config import EngineConfig
from llmlab.distributed.parallel_state import TensorParallel
from llmlab.runner.build import check_parallel_devices
from llmlab.errors import ExecutorDeadError
from llmlab.sampling.params import StructuredOutputsParams
from tests.conftest import ARCHITECTURES
from tests.helpers import slow_after_first

# Small pool and budget: 6 prompts of up to 40 tokens preempt each other in 32 blocks of 4,
# and prompts longer than 24 tokens are prefilled in chunks.
SETTINGS = dict(
    device="cpu", block_size=4, max_model_len=128, num_gpu_blocks_override=32,
    max_num_batched_tokens=24, max_num_seqs=8, seed=0, cpu_threads=1,
)
PREFIX = list(range(10, 30))
PROMPTS = [PREFIX + [40, 41], [5, 6, 7], list(range(3, 43)), [9] * 30, [100, 7, 12, 13], [2] * 17]


_EARLIER: set[int] = set()


@pytest.fixture(autouse=True)
def _earlier_children():
    """Spawned children alive before this test (another test's replicas still exiting, in
    the same xdist worker) are not this test's ranks."""
    _EARLIER.clear()
    _EARLIER.update(p.pid for p in psutil.Process().children(recursive=True))
    yield


def _tp_children() -> list[psutil.Process]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if (child.pid not in _EARLIER and child.status() != psutil.STATUS_ZOMBIE
                    and "spawn" in " ".join(child.cmdline())):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def workload(llm: LLM):
    """Outputs of a workload covering the engine's mechanisms, and the step events."""
    events = []
    llm.llm_engine.subscribe(events.append)
    greedy = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    token_prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outputs = list(llm.generate(token_prompts, greedy, use_tqdm=False))
    # The shared prefix is cached now: these hit it.
    follow_ups = [{"prompt_token_ids": PREFIX + [50 + i]} for i in range(3)]
    outputs += llm.generate(follow_ups, greedy, use_tqdm=False)
    sampled = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=8, logprobs=1)
    outputs += llm.generate([{"prompt_token_ids": PROMPTS[1]}], sampled, use_tqdm=False)
    grammar = SamplingParams(
        max_tokens=10, temperature=0,
        structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,4}"),
    )
    outputs += llm.generate(["Once upon a time"], grammar, use_tqdm=False)
    llm.llm_engine.unsubscribe(events.append)
    return outputs, events


def assert_same(reference, got):
    assert len(reference) == len(got)
    for ref, out in zip(reference, got, strict=True):
        assert len(ref.outputs) == len(out.outputs)
        for a, b in zip(ref.outputs, out.outputs, strict=True):
            assert a.token_ids == b.token_ids, (ref.request_id, a.token_ids, b.token_ids)
            assert a.text == b.text
            for la, lb, token in zip(a.logprobs or (), b.logprobs or (), a.token_ids):
                assert abs(la[token].logprob - lb[token].logprob) < 1e-5


@pytest.fixture(scope="module")
def one_rank_reference(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            llm = LLM(tiny_model_factory(arch), **SETTINGS)
            cache[arch] = workload(llm)[0]
        return cache[arch]

    return get


# OLMoE normalises q and k across all heads, which no rank holds: refused (test below).
SPLITTABLE = [arch for arch in ARCHITECTURES if arch != "OlmoeForCausalLM"]


# 15-25 s per architecture on 2 cores: Llama by default, every architecture in CI.
@pytest.mark.parametrize("arch", slow_after_first(SPLITTABLE))
def test_two_ranks_give_the_tokens_of_one(tiny_model_factory, one_rank_reference, arch):
    reference = one_rank_reference(arch)
    llm = LLM(tiny_model_factory(arch), tensor_parallel_size=2, **SETTINGS)
    try:
        got, events = workload(llm)
        assert_same(reference, got)
        # The workload went where it was meant to.
        assert sum(len(e.preempted) for e in events) > 0
        assert sum(len(e.blocks_prefix_hit) for e in events) > 0
        assert any(1 < n < 40 for e in events for _, n in e.scheduled if n > 4)
        assert llm.llm_engine.kv_cache.num_free_blocks == 32
    finally:
        llm.llm_engine.executor.shutdown()
    assert not _tp_children()


def test_replicated_kv_heads_and_an_uneven_vocabulary(tmp_path):
    """One KV head for two ranks (each rank keeps a copy) and a vocabulary of 509 rows
    (the ranks hold 255 and 254)."""
    from llmlab.testing import build_tiny_model

    path = str(build_tiny_model(tmp_path / "m", "LlamaForCausalLM", vocab_size=509,
                                num_key_value_heads=1))
    settings = dict(device="cpu", seed=0, cpu_threads=1)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    reference = LLM(path, **settings).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tensor_parallel_size=2, **settings)
    try:
        rank0 = llm.llm_engine.executor.runner.model
        assert rank0.kv_layout.num_kv_heads == 1
        assert rank0.embed_tokens.weight.shape[0] == 255
        assert_same(reference, llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.llm_engine.executor.shutdown()


def test_a_worker_killed_mid_generation_fails_the_call_naming_its_rank(tiny_llama):
    llm = LLM(tiny_llama, tensor_parallel_size=2, device="cpu", cpu_threads=1, seed=0)
    executor = llm.llm_engine.executor
    pid = executor.workers.workers[0].process.pid
    killed = threading.Event()

    def kill_at_third_step(event):
        if event.step_index == 3 and not killed.is_set():
            os.kill(pid, signal.SIGKILL)
            killed.set()

    llm.llm_engine.subscribe(kill_at_third_step)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    started = time.monotonic()
    with pytest.raises(ExecutorDeadError, match=r"rank 1 \(killed by SIGKILL\)"):
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert killed.is_set()
    assert time.monotonic() - started < 60
    # The call's requests are gone and their blocks are free; the engine refuses at once.
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    with pytest.raises(ExecutorDeadError, match="rank 1"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], params, use_tqdm=False)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not _tp_children()


# -- refused at build time, before any process starts -----------------------------------


def test_heads_the_size_does_not_divide_are_refused_before_starting(tiny_llama):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide the model's "
                                         r"attention heads \(4\); allowed sizes: 1, 2, 4"):
        LLM(tiny_llama, tensor_parallel_size=3, device="cpu")
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_nccl_on_cpu_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="collective_backend='nccl' needs CUDA devices"):
        LLM(tiny_llama, tensor_parallel_size=2, device="cpu", collective_backend="nccl")


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cfg = EngineConfig(model="m", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 CUDA devices, but 1 "
                                         r"is visible"):
        check_parallel_devices(cfg, torch.device("cuda"))


def test_kv_heads_fewer_than_ranks_must_replicate_evenly():
    assert TensorParallel(3, 4).kv_heads(2, 8) == (1, 1)  # ranks 2, 3 share head 1
    assert TensorParallel(1, 2).kv_heads(4, 8) == (2, 2)
    with pytest.raises(ValueError, match="not a multiple of them"):
        TensorParallel(0, 4).kv_heads(3, 12)
    assert [TensorParallel(r, 3).vocab_range(10) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]


def test_the_async_engine_ends_streams_and_reports_dead_when_a_rank_dies(tiny_llama):
    import asyncio

    from llmlab.entrypoints.async_engine import AsyncEngine, EngineDeadError
    from llmlab.engine.builder import EngineBuilder

    engine = EngineBuilder.from_settings(
        tiny_llama, tensor_parallel_size=2, device="cpu", cpu_threads=1
    ).build()
    pid = engine.executor.workers.workers[0].process.pid
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def run():
        stream = await async_engine.add_request(None, {"prompt_token_ids": [5, 6, 7]}, params)
        received = 0
        with pytest.raises(Exception, match=r"ExecutorDeadError: tensor-parallel worker rank 1"):
            async for _ in stream:
                received += 1
                if received == 3:
                    os.kill(pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="rank 1"):
            await async_engine.check_health()
        with pytest.raises(EngineDeadError, match="rank 1"):
            await async_engine.add_request(None, [1, 2, 3], params)

    try:
        asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert not _tp_children()


def test_speculative_decoding_on_two_ranks_gives_the_plain_tokens(tiny_llama):
    """Every rank drafts (n-gram) and verifies the same way, so the drafts, the verified
    tokens and the batches stay the same on both ranks."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 4}, {"prompt_token_ids": list(range(3, 30)) * 2}]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    plain = LLM(tiny_llama, device="cpu", cpu_threads=1).generate(prompts, params,
                                                                  use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "speculation_length": "fixed"}
    llm = LLM(tiny_llama, device="cpu", cpu_threads=1, speculative_config=spec,
              tensor_parallel_size=2)
    events = []
    llm.llm_engine.subscribe(events.append)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert sum(d for e in events for _, d, _ in e.speculated) > 0  # drafts were verified


def test_a_model_whose_norm_spans_all_heads_is_refused_under_tensor_parallelism(
        tiny_model_factory):
    with pytest.raises(ValueError, match="tensor_parallel_size=1 only"):
        LLM(tiny_model_factory("OlmoeForCausalLM"), tensor_parallel_size=2, **SETTINGS)
    assert not _tp_children()
