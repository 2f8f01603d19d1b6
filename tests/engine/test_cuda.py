"""The same engine on CUDA (skipped without a GPU): parity with HF and memory profiling."""

from __future__ import annotations

import pytest
import torch

from llmlab import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "OPTForCausalLM"])
def test_greedy_matches_hf_on_cuda(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = [[5, 9, 13] * k for k in (1, 4, 11)]
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(path, dtype="float32", device="cuda", gpu_memory_utilization=0.3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_gpu_memory_utilization_sizes_the_cache(tiny_llama):
    small = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.2).llm_engine
    large = LLM(tiny_llama, device="cuda", gpu_memory_utilization=0.4).llm_engine
    assert large.kv_cache.num_blocks > small.kv_cache.num_blocks > 0


# bfloat16 rounds every activation to 8 bits of mantissa, so greedy tokens may differ from
# float32 HF where two logits are nearly tied. Teacher-forced check: HF (float32, same
# weights) scores llmlab's bf16 continuation in one pass; every token llmlab chose must be
# within BF16_LOGIT_TOL of HF's best logit at that position, and at least BF16_MIN_TOP1 of
# them must be HF's top-1 exactly.
BF16_LOGIT_TOL = 0.25
BF16_MIN_TOP1 = 0.9


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_bf16_teacher_forced_top1_agreement(tiny_model_factory, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model_factory(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    prompts = [[5, 9, 13] * k for k in (1, 4, 11, 30)]
    llm = LLM(path, device="cuda", gpu_memory_utilization=0.3)  # dtype auto: bf16 on CUDA
    assert llm.llm_engine.executor.kv_caches[0].dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)
    agree = total = 0
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        ids = torch.tensor([prompt + tokens], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=-1).values - chosen
        assert float(gap.max()) <= BF16_LOGIT_TOL, (prompt, tokens, gap.tolist())
        agree += int((logits.argmax(dim=-1) == torch.tensor(tokens, device="cuda")).sum())
        total += len(tokens)
    assert agree / total >= BF16_MIN_TOP1


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_the_triton_fused_ops_give_the_torch_ops_tokens(tiny_model_factory, arch):
    """``cuda_fused_ops`` (on by default) runs the Llama family's blocks through the Triton
    residual+norm, rotary and SiLU x up kernels; greedy tokens and logprobs are the plain
    torch ops' (float32: equal tokens, logprobs to rounding), with and without graphs."""
    path = tiny_model_factory(arch)
    prompts = [{"prompt_token_ids": [5, 9, 13] * k} for k in (1, 4, 11, 30)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = {}
    for fused in (True, False):
        for eager in (False, True):
            llm = LLM(path, dtype="float32", device="cuda", cuda_fused_ops=fused,
                      enforce_eager=eager)
            assert llm.llm_engine.executor.model.fused_ops is fused
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[fused, eager] = [(o.outputs[0].token_ids,
                                   [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                   o.outputs[0].logprobs)])
                                  for o in outs]
            llm.llm_engine.shutdown()
    plain = runs[False, True]
    for key, got in runs.items():
        assert [t for t, _ in got] == [t for t, _ in plain], key
        for (_, a), (_, b) in zip(got, plain):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, key
