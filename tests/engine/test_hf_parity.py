"""Greedy generation is token-identical to Hugging Face ``generate`` on the same weights.

Covers every supported architecture, two block sizes, chunked prefill (a token budget
smaller than the prompts) and preemption (a KV cache too small for the batch).
"""

from __future__ import annotations

import random

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.attention import CpuPagedAttention, cpu_kernels_unavailable_reason
from tests.conftest import ARCHITECTURES

# On CPU, "auto" is the fast path: the C++ attention kernels (and oneDNN linears).
CPU_KERNELS = cpu_kernels_unavailable_reason() is None

NUM_NEW_TOKENS = 10


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 64, 100, 45]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def hf_greedy(path: str, seed: int):
    """``(path, prompts, HF's greedy continuations)`` for the model at ``path``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(model.config.vocab_size, seed)
    outs = []
    for p in prompts:
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
                pad_token_id=0,
            )
        outs.append(gen[0, len(p) :].tolist())
    return path, prompts, outs


@pytest.fixture(scope="module")
def hf_reference(tiny_model_factory):
    """``arch -> (path, prompts, hf greedy continuations)``, computed once per arch."""
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_factory(arch)
            cache[arch] = hf_greedy(path, seed=0)
        return cache[arch]

    return get


def generate(path, prompts, *, events=None, **llm_kwargs):
    llm = LLM(path, dtype="float32", seed=0, **llm_kwargs)
    if events is not None:
        llm.llm_engine.subscribe(events.append)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm):
    snap = llm.llm_engine.kv_cache.snapshot()
    assert snap.block_tables == {}
    assert all(c == 0 for c in snap.ref_counts)
    assert snap.num_free_blocks == llm.llm_engine.kv_cache.num_blocks


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_greedy_matches_hf(hf_reference, arch, block_size, backend):
    path, prompts, expected = hf_reference(arch)
    llm, got = generate(path, prompts, block_size=block_size, attention_backend=backend)
    assert got == expected
    assert_no_leaks(llm)
    if backend == "auto" and CPU_KERNELS and not torch.cuda.is_available():
        assert isinstance(llm.llm_engine.executor.attention, CpuPagedAttention)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_chunked_prefill_matches_hf(hf_reference, arch):
    path, prompts, expected = hf_reference(arch)
    events = []
    llm, got = generate(path, prompts, block_size=4, max_num_batched_tokens=24, events=events)
    assert got == expected
    prompt_len = {str(i): len(p) for i, p in enumerate(prompts)}
    chunked = [
        (rid, n)
        for e in events
        for rid, n in e.scheduled
        if 1 < n < prompt_len[rid] and e.num_batched_tokens <= 24
    ]
    assert chunked, "no prompt was split across steps"
    assert max(e.num_batched_tokens for e in events) <= 24
    assert_no_leaks(llm)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_preemption_matches_hf(hf_reference, arch):
    path, prompts, expected = hf_reference(arch)
    events = []
    # 128 positions need 32 blocks of 4, the least the engine accepts; the first six
    # prompts admitted together then outgrow it while decoding.
    llm, got = generate(
        path, prompts, block_size=4, max_model_len=128, num_gpu_blocks_override=32, events=events
    )
    assert got == expected
    assert sum(len(e.preempted) for e in events) > 0
    assert_no_leaks(llm)


# The tiny models above have head_dim 16 or 32, which the C++ CPU kernel serves on its
# scalar path; these shapes take its vector path (head_dim 64 or 128, blocks of 16 or 32).
VECTOR_PATH_MODELS = {
    "llama-d64-gqa2": ("LlamaForCausalLM", {"hidden_size": 128, "num_attention_heads": 2,
                                            "num_key_value_heads": 1}),
    "mistral-d64-window": ("MistralForCausalLM", {"hidden_size": 128, "num_attention_heads": 2,
                                                  "num_key_value_heads": 2}),
    "qwen3-d128-gqa4": ("Qwen3ForCausalLM", {"head_dim": 128, "num_attention_heads": 4,
                                             "num_key_value_heads": 1}),
}


@pytest.fixture(scope="module")
def vector_path_reference(tmp_path_factory):
    from llmlab.testing import build_tiny_model

    cache = {}

    def get(name):
        if name not in cache:
            arch, overrides = VECTOR_PATH_MODELS[name]
            path = str(build_tiny_model(tmp_path_factory.mktemp(name), arch, seed=1, **overrides))
            cache[name] = hf_greedy(path, seed=1)
        return cache[name]

    return get


@pytest.mark.skipif(not CPU_KERNELS, reason="llmlab's CPU kernels are unavailable")
@pytest.mark.parametrize("name", list(VECTOR_PATH_MODELS))
@pytest.mark.parametrize(
    "engine_args",
    [
        {"block_size": 16},
        {"block_size": 32, "max_num_batched_tokens": 24},  # chunked prefill
        # preemption: 8 blocks of 16 cannot hold the decoding batch
        {"block_size": 16, "max_model_len": 128, "num_gpu_blocks_override": 8,
         "max_num_batched_tokens": 32},
    ],
    ids=["plain", "chunked", "preempted"],
)
def test_cpu_kernel_vector_path_matches_hf(vector_path_reference, name, engine_args):
    path, prompts, expected = vector_path_reference(name)
    events = []
    llm, got = generate(path, prompts, device="cpu", attention_backend="cpu", events=events,
                        **engine_args)
    assert got == expected
    if "num_gpu_blocks_override" in engine_args:
        assert sum(len(e.preempted) for e in events) > 0
    assert_no_leaks(llm)
