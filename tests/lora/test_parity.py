"""Outputs with LoRA adapters equal Hugging Face transformers + PEFT token for token
(greedy, float32), alone and mixed in one batch with other adapters and the base model."""

from __future__ import annotations

import random

import pytest

from llmlab import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import peft_greedy

NEW_TOKENS = 8


def prompts_for(seed: int = 0, lengths=(1, 5, 17, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(n)] for n in lengths]


def run(llm: LLM, prompts, lora_request=None) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=lora_request,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module", params=["LlamaForCausalLM", "Qwen3ForCausalLM"])
def arch_llm(request, tiny_model_factory):
    base = tiny_model_factory(request.param)
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=4,
              max_num_batched_tokens=32)  # small budget: prompts prefill in chunks
    return request.param, base, llm


def test_adapter_outputs_equal_hf_peft(arch_llm, adapter_factory):
    arch, base, llm = arch_llm
    adapter = adapter_factory(base, f"all-{arch}", r=8)
    prompts = prompts_for()
    got = run(llm, prompts, LoRARequest("all", 1, adapter))
    assert got == peft_greedy(base, adapter, prompts, NEW_TOKENS)
    assert got != run(llm, prompts), "the adapter changes nothing: the test proves nothing"


def test_rslora_and_partial_targets_equal_hf_peft_merged(arch_llm, adapter_factory):
    arch, base, llm = arch_llm
    adapter = adapter_factory(
        base, f"qv-{arch}", r=16, lora_alpha=8, targets=("q_proj", "v_proj", "down_proj"),
        use_rslora=True, seed=3,
    )
    prompts = prompts_for(seed=1)
    got = run(llm, prompts, LoRARequest("qv", 2, adapter))
    assert got == peft_greedy(base, adapter, prompts, NEW_TOKENS, merged=True)


def test_a_mixed_batch_equals_each_request_alone(arch_llm, adapter_factory):
    """Three adapters (ranks 4, 8, 16; different targets) and the base model in one call:
    every request's tokens equal those it gets alone, and HF + PEFT's."""
    arch, base, llm = arch_llm
    adapters = [
        LoRARequest("r4", 11, adapter_factory(base, f"r4-{arch}", r=4, seed=11)),
        LoRARequest("r8", 12, adapter_factory(
            base, f"r8-{arch}", r=8, seed=12, targets=("o_proj", "gate_proj", "up_proj"))),
        LoRARequest("r16", 13, adapter_factory(base, f"r16-{arch}", r=16, seed=13)),
    ]
    prompts = prompts_for(seed=2, lengths=(3, 9, 20, 33, 2, 15, 26, 8))
    loras = [adapters[i % 4] if i % 4 < 3 else None for i in range(len(prompts))]
    mixed = run(llm, prompts, loras)
    for p, lora, tokens in zip(prompts, loras, mixed, strict=True):
        assert run(llm, [p], lora) == [tokens]
    for lora in adapters:
        mine = [p for p, r in zip(prompts, loras, strict=True) if r is lora]
        expected = peft_greedy(base, lora.lora_path, mine, NEW_TOKENS)
        assert [t for t, r in zip(mixed, loras, strict=True) if r is lora] == expected


def test_parallel_samples_and_chat_run_the_adapter(tiny_llama, adapter_factory):
    llm = LLM(tiny_llama, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, adapter_factory(tiny_llama, "llama-a", r=8))
    prompt = prompts_for(lengths=(12,))
    alone = run(llm, prompt, lora)[0]
    params = SamplingParams(n=3, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt[0]}], params, use_tqdm=False,
                       lora_request=lora)[0]
    assert [list(c.token_ids) for c in out.outputs] == [alone] * 3
    chat = llm.chat([{"role": "user", "content": "hello"}],
                    SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                    use_tqdm=False, lora_request=lora)
    plain = llm.generate(
        [{"prompt_token_ids": chat[0].prompt_token_ids}],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False,
        lora_request=lora,
    )
    assert chat[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


def test_the_triton_kernels_give_hf_peft_tokens(tiny_llama, adapter_factory):
    """The engine with the SGMV kernels (CUDA's default; Triton's interpreter here)."""
    pytest.importorskip("triton")
    llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.llm_engine.executor.plugin("lora").kernel = "triton"
    adapters = [
        LoRARequest("t1", 1, adapter_factory(tiny_llama, "llama-a", r=8)),
        LoRARequest("t2", 2, adapter_factory(tiny_llama, "llama-t2", r=4, seed=7)),
    ]
    prompts = prompts_for(seed=4, lengths=(6, 11, 3))
    loras = [adapters[0], None, adapters[1]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    got = [list(o.outputs[0].token_ids) for o in outs]
    for p, lora, tokens in zip(prompts, loras, got, strict=True):
        if lora is not None:
            assert [tokens] == peft_greedy(tiny_llama, lora.lora_path, [p], 4)


def test_speculative_decoding_keeps_the_adapters_tokens(tiny_llama, adapter_factory):
    """The target verifies drafts with the request's adapter: greedy tokens are unchanged."""
    lora = LoRARequest("a", 1, adapter_factory(tiny_llama, "llama-a", r=8))
    prompts = prompts_for(seed=5, lengths=(12, 30))
    plain = LLM(tiny_llama, enable_lora=True, max_lora_rank=8)
    spec = LLM(tiny_llama, enable_lora=True, max_lora_rank=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert run(spec, prompts, lora) == run(plain, prompts, lora)
