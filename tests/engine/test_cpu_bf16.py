"""bfloat16 on CPU as a first-class dtype: teacher-forced agreement with HF float32.

bfloat16 keeps 8 bits of mantissa, so greedy tokens may differ from float32 where two
logits are nearly tied. HF (float32, same weights) scores llmlab's bf16 continuation in one
pass: every token llmlab chose must be within ``LOGIT_TOL`` of HF's best logit there, and
at least ``MIN_TOP1`` of them must be HF's top-1 exactly. The tolerances are the CUDA
test's (``tests/engine/test_cuda.py``).
"""

from __future__ import annotations

import pytest
import torch

from llmlab import LLM, SamplingParams

LOGIT_TOL = 0.25
MIN_TOP1 = 0.9


def _teacher_forced(path: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="bfloat16", device="cpu")
    assert llm.llm_engine.executor.kv_caches[0].dtype == torch.bfloat16
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    agree = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        ids = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gap = logits.max(dim=-1).values - chosen
        assert float(gap.max()) <= LOGIT_TOL, (prompt, tokens, gap.tolist())
        agree += int((logits.argmax(dim=-1) == torch.tensor(tokens)).sum())
        total += len(tokens)
    return agree, total


@pytest.mark.parametrize(
    "arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
             "GPT2LMHeadModel", "OPTForCausalLM"],
)
def test_bf16_on_cpu_agrees_with_hf_float32(tiny_model_factory, arch):
    prompts = [[5, 9, 13] * k for k in (1, 4, 11, 30)]
    agree, total = _teacher_forced(tiny_model_factory(arch), prompts, max_tokens=16)
    assert agree / total >= MIN_TOP1, (agree, total)


def test_bf16_on_cpu_agrees_with_hf_on_the_trained_builtin_model():
    from llmlab.builtin import ensure_builtin_model

    path = str(ensure_builtin_model())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(t)["input_ids"] for t in ("Once upon a time", "One day, a little dog",
                                            "Lily and Tom went to the park.")]
    agree, total = _teacher_forced(path, prompts, max_tokens=32)
    assert agree / total >= MIN_TOP1, (agree, total)
