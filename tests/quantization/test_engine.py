"""Quantized engines on CPU: int8 tokens against float32, saved checkpoints, hard edges."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmlab import LLM
from llmlab.builtin import ensure_builtin_model
from llmlab.models import loader
from llmlab.models.weights import WeightTarget, load_mapped_weights
from llmlab.quantization import Int8Linear, save_quantized
from llmlab.quantization import int8 as int8_module
from llmlab.quantization.checkpoint import checkpoint_weights
from tests.conftest import ARCHITECTURES
from tests.quantization.agreement import agreement, greedy_continuations

SETTINGS = dict(device="cpu", seed=0, dtype="float32", cpu_threads=1)


def _model(llm: LLM):
    return llm.llm_engine.executor.model


@pytest.fixture(scope="module")
def saved_int8(tiny_model_factory, tmp_path_factory):
    """``arch -> folder`` of the tiny model saved by ``save_quantized(..., "int8")``."""
    saved = {}

    def get(arch):
        if arch not in saved:
            out = tmp_path_factory.mktemp(f"{arch}-int8")
            saved[arch] = str(save_quantized(tiny_model_factory(arch), out, "int8"))
        return saved[arch]

    return get


@pytest.mark.parametrize("arch", [*ARCHITECTURES, "builtin"])
def test_int8_agrees_with_float32_teacher_forced(tiny_model_factory, arch):
    """>= 90% of float32's greedy positions keep their argmax under int8 (see
    tests/quantization/agreement.py for the teacher-forced scoring)."""
    path = str(ensure_builtin_model()) if arch == "builtin" else tiny_model_factory(arch)
    reference = LLM(path, **SETTINGS)
    quantized = LLM(path, quantization="int8", **SETTINGS)
    linears = [m for m in _model(quantized).modules() if isinstance(m, Int8Linear)]
    assert len(linears) >= 4  # every block's projections run in int8
    assert agreement(reference, quantized) >= 0.9


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "GPT2LMHeadModel"])  # GPT-2: [in, out]
def test_a_saved_int8_checkpoint_loads_as_it_is(tiny_model_factory, saved_int8, arch,
                                                 monkeypatch):
    at_load = LLM(tiny_model_factory(arch), quantization="int8", **SETTINGS)
    expected = greedy_continuations(at_load)
    path = saved_int8(arch)
    config = json.loads((pathlib.Path(path) / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"

    def no_requantizing(*args, **kwargs):
        raise AssertionError("a quantized checkpoint must not be quantized again")

    monkeypatch.setattr(int8_module, "quantize_int8", no_requantizing)
    for quantization in (None, "int8"):  # None: the checkpoint's own scheme, as vLLM
        loaded = LLM(path, quantization=quantization, **SETTINGS)
        assert greedy_continuations(loaded) == expected
        for (name, a), (_, b) in zip(_model(at_load).named_parameters(),
                                     _model(loaded).named_parameters(), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name


def test_the_saved_layout_is_compressed_tensors(saved_int8):
    tensors = load_file(pathlib.Path(saved_int8("LlamaForCausalLM")) / "model.safetensors")
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    scale = tensors["model.layers.0.self_attn.q_proj.weight_scale"]
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.shape == (q.shape[0], 1)
    # Embeddings, norms and the head keep the checkpoint's float.
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert tensors[name].dtype == torch.float32 and name + "_scale" not in tensors


def _refuse_weight_reads(monkeypatch):
    def read(*args, **kwargs):
        raise AssertionError("weights were read before the setting was refused")

    monkeypatch.setattr(loader, "iterate_weights", read)


def test_fp8_on_cpu_is_refused_before_any_weight_loads(tiny_llama, monkeypatch):
    _refuse_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"quantization='fp8' is not supported on device 'cpu'"):
        LLM(tiny_llama, quantization="fp8", device="cpu")
    with pytest.raises(ValueError, match="quantization must be one of 'int8', 'fp8'.*"
                       "'bitsandbytes'"):
        LLM(tiny_llama, quantization="bitsandbytes", device="cpu")


def _with_quantization_config(source: str, out: pathlib.Path, config: dict) -> str:
    shutil.copytree(source, out)
    meta = json.loads((out / "config.json").read_text())
    meta["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(meta))
    return str(out)


def test_unsupported_checkpoint_formats_are_refused_by_name(tiny_llama, tmp_path, monkeypatch):
    awq = _with_quantization_config(tiny_llama, tmp_path / "awq", {"quant_method": "awq"})
    block = _with_quantization_config(
        tiny_llama, tmp_path / "block", {"quant_method": "fp8", "weight_block_size": [128, 128]}
    )
    _refuse_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match="quant_method='awq'"):
        LLM(awq, device="cpu")
    with pytest.raises(ValueError, match="weight_block_size"):
        LLM(block, device="cpu")


def test_a_checkpoint_in_another_scheme_than_asked_is_refused(saved_int8, monkeypatch):
    path = saved_int8("LlamaForCausalLM")
    _refuse_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match="quantization='fp8' does not match.*'int8'"):
        LLM(path, quantization="fp8", device="cpu")


def test_per_tensor_scales_are_spread_over_their_rows(tiny_llama, tmp_path):
    """vLLM's per-tensor layout (``quant_method: "int8"`` here, one scale per q/k/v
    tensor, static ``input_scale``s that llmlab drops) loads into the fused qkv rows."""
    tensors = load_file(pathlib.Path(tiny_llama) / "model.safetensors")
    scales = {}
    for name in list(tensors):
        if ".layers." in name and name.endswith("proj.weight"):
            w = tensors[name]
            scale = w.abs().max() / 127
            tensors[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            tensors[name + "_scale"] = scale.reshape(1)
            tensors[name.replace(".weight", ".input_scale")] = torch.ones(1)
            scales[name] = float(scale)
    out = pathlib.Path(_with_quantization_config(tiny_llama, tmp_path / "pt",
                                                 {"quant_method": "int8"}))
    save_file(tensors, str(out / "model.safetensors"))
    llm = LLM(str(out), **SETTINGS)
    attn = _model(llm).layers[0].self_attn
    q_rows = attn.split_sizes[0]
    got = attn.qkv_proj.weight_scale
    layer = "model.layers.0.self_attn"
    assert torch.allclose(got[:q_rows], torch.tensor(scales[f"{layer}.q_proj.weight"]))
    assert torch.allclose(got[q_rows:], torch.cat([
        torch.full((attn.split_sizes[1],), scales[f"{layer}.{p}_proj.weight"]) for p in "kv"
    ]))
    assert agreement(LLM(tiny_llama, **SETTINGS), llm) >= 0.8


def test_checkpoint_weights_refuses_asymmetric_zero_points(tiny_llama):
    stream = [("x.weight_zero_point", torch.tensor([0, 3]))]
    with pytest.raises(ValueError, match="asymmetric"):
        list(checkpoint_weights(iter(stream), tiny_llama))


def test_float_weights_never_cast_into_a_quantized_parameter():
    module = Int8Linear(8, 4, bias=False, dtype=torch.float32)
    with pytest.raises(ValueError, match="holds quantized torch.int8"):
        load_mapped_weights(module, [("weight", torch.randn(4, 8))], WeightTarget)
