"""Greedy generation is token-identical to Hugging Face ``generate`` on the same weights.

Covers every supported architecture, two block sizes, chunked prefill (a token budget
smaller than the prompts) and preemption (a KV cache too small for the batch).
"""

from __future__ import annotations

import random

import pytest
import torch

from llmlab import LLM, SamplingParams
from tests.conftest import ARCHITECTURES

NUM_NEW_TOKENS = 10


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 7, 16, 17, 33, 64, 100, 45]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_reference(tiny_model_factory):
    """``arch -> (path, prompts, hf greedy continuations)``, computed once per arch."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_factory(arch)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            prompts = make_prompts(model.config.vocab_size)
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
            cache[arch] = (path, prompts, outs)
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
def test_greedy_matches_hf(hf_reference, arch, block_size):
    path, prompts, expected = hf_reference(arch)
    llm, got = generate(path, prompts, block_size=block_size)
    assert got == expected
    assert_no_leaks(llm)


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
