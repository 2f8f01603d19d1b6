"""Prepacked oneDNN linears on CPU: same results as ``F.linear``, chosen at load time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmlab import LLM, SamplingParams
from llmlab.kernels.cpu_linear import PackedLinear, onednn_unavailable_reason, prepack_linears

pytestmark = pytest.mark.skipif(
    onednn_unavailable_reason() is not None, reason=str(onednn_unavailable_reason())
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_linear_matches_f_linear(dtype, rows):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=True).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    want = F.linear(x, linear.weight, linear.bias).float()
    got = PackedLinear.from_linear(linear)(x).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=tol, atol=tol)
    # 3-D inputs keep their leading shape.
    assert PackedLinear.from_linear(linear)(x[None]).shape == (1, rows, 200)


def _model(llm: LLM):
    return llm.llm_engine.executor.model


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel",
                                  "OPTForCausalLM"])
def test_onednn_is_the_cpu_default_and_decodes_like_the_plain_path(tiny_model_factory, arch):
    path = tiny_model_factory(arch)
    fast = LLM(path, device="cpu", dtype="float32")
    plain = LLM(path, device="cpu", dtype="float32", cpu_linear="plain")
    fast_model, plain_model = _model(fast), _model(plain)
    assert not any(isinstance(m, nn.Linear) for m in fast_model.modules()
                   if m is not getattr(fast_model, "lm_head", None))
    assert isinstance(fast_model._modules.get("packed_head"), PackedLinear)
    assert plain_model._modules.get("packed_head") is None
    assert any(isinstance(m, nn.Linear) for m in plain_model.modules())
    prompts = [{"prompt_token_ids": [5, 9, 13] * k} for k in (1, 4, 11)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    a = fast.generate(prompts, params, use_tqdm=False)
    b = plain.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            tok = next(iter(lx))
            assert lx[tok].logprob == pytest.approx(ly[tok].logprob, abs=1e-4)


def test_prepack_counts_every_projection_and_the_head(tiny_model_factory):
    llm = LLM(tiny_model_factory("LlamaForCausalLM"), device="cpu", dtype="float32",
              cpu_linear="plain")
    model = _model(llm)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    head_is_module = getattr(model, "lm_head", None) is not None
    assert prepack_linears(model) == linears - head_is_module + 1


def test_cpu_linear_is_checked(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="cpu_linear"):
        LLM(tiny_llama, device="cpu", cpu_linear="fast")
    from llmlab.engine import assembly

    monkeypatch.setattr(assembly, "onednn_unavailable_reason", lambda: "no oneDNN here")
    with pytest.raises(ValueError, match="cpu_linear='onednn' cannot run: no oneDNN here"):
        LLM(tiny_llama, device="cpu", cpu_linear="onednn")
    # "auto" falls back to the plain path.
    plain = LLM(tiny_llama, device="cpu", dtype="float32")
    assert _model(plain)._modules.get("packed_head") is None


def test_auto_packs_float32_and_native_bfloat16(tiny_llama, monkeypatch):
    import llmlab.engine.assembly as assembly

    def packed(llm):
        return _model(llm)._modules.get("packed_head") is not None

    assert packed(LLM(tiny_llama, device="cpu", dtype="float32"))
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packed(LLM(tiny_llama, device="cpu", dtype="bfloat16")) == native
    assert not packed(LLM(tiny_llama, device="cpu", dtype="bfloat16", cpu_linear="plain"))
    # Without native bf16, "auto" leaves bfloat16 models on F.linear; "onednn" still packs.
    monkeypatch.setattr(assembly, "auto_packed_dtypes", lambda: (torch.float32,))
    assert not packed(LLM(tiny_llama, device="cpu", dtype="bfloat16"))
    assert packed(LLM(tiny_llama, device="cpu", dtype="bfloat16", cpu_linear="onednn"))
