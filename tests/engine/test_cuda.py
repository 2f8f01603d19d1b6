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
