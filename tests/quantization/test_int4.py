"""4-bit checkpoints (GPTQ, AWQ, compressed-tensors W4A16) against the spec's own numbers.

Each checkpoint is packed by ``int4_reference`` from a tiny float model; the reference is
the same checkpoint dequantized by ``int4_reference``'s reader (written from the format's
specification, not from llmlab's loader) and run by transformers in float32. llmlab, in
float32, must give logits within 1e-4 (relative to the largest logit) and the same greedy
tokens, with both kernels: ``"dequantize"`` (llmlab's own) and ``"int4"``
(:mod:`llmlab.kernels.int4`: on CPU in float32 its chunked dequantize-matmul).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import transformers
from safetensors.torch import load_file

from llmlab import LLM
from llmlab.models.loader import load_model
from llmlab.quantization import W4A16Linear, resolve_quantization, weight_memory
from llmlab.quantization import w4a16 as w4a16_module
from llmlab.testing import build_tiny_model
from tests.models.conftest import PagedRunner
from tests.quantization.agreement import PROMPTS, agreement, greedy_continuations
from tests.quantization.int4_reference import Case, write_checkpoint, write_float_checkpoint

REL_TOL = 1e-4
SETTINGS = dict(device="cpu", seed=0, dtype="float32", cpu_threads=1)
# Tiny float models: the suite's Llama (hidden 64) for groups 32 / 64, a wider one for
# group 128, and two MoE models whose expert widths the groups divide.
MODELS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-wide": ("LlamaForCausalLM", {"hidden_size": 128, "intermediate_size": 256}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"moe_intermediate_size": 64}),
    "mixtral": ("MixtralForCausalLM", {}),
    # Biases on q/k/v (Qwen2) or everywhere (OPT) beside 4-bit weights; GPT-2's Conv1D.
    "qwen2": ("Qwen2ForCausalLM", {}),
    "opt": ("OPTForCausalLM", {}),
    "gpt2": ("GPT2LMHeadModel", {}),
}
LOGIT_CASES = [
    ("llama", Case("gptq", 32, symmetric=True)),
    ("llama", Case("gptq", 32, act_order=True)),
    ("llama", Case("gptq", 64, write_g_idx=False)),
    ("llama", Case("gptq", None)),
    ("llama", Case("gptq", 32, act_order=True, gptq_v2=True)),
    ("llama-wide", Case("gptq", 128, act_order=True)),
    ("llama-wide", Case("gptq", 128, symmetric=True)),
    ("llama", Case("awq", 32)),
    ("llama-wide", Case("awq", 128)),
    ("llama", Case("compressed-tensors", 32, symmetric=True)),
    ("llama", Case("compressed-tensors", 64)),
    ("llama", Case("compressed-tensors", None)),
    ("llama", Case("compressed-tensors", 32, act_order=True)),
    ("qwen3-moe", Case("gptq", 32, act_order=True)),
    ("qwen3-moe", Case("awq", 64)),
    ("qwen3-moe", Case("compressed-tensors", 32, symmetric=True)),
    ("mixtral", Case("gptq", 32, symmetric=True, act_order=True)),
    ("qwen2", Case("gptq", 32, act_order=True)),
    ("opt", Case("awq", 32)),
    ("gpt2", Case("gptq", 32, act_order=True)),
]
# The Llama family's checkpoint names (q/k/v, gate/up; experts).
FUSED_CASES = [c for c in LOGIT_CASES if c[0] not in ("opt", "gpt2")]
GREEDY_CASES = [
    ("llama", Case("gptq", 32, act_order=True)),
    ("llama", Case("awq", 32)),
    ("llama", Case("compressed-tensors", 32, act_order=True)),
    ("qwen3-moe", Case("gptq", 32, act_order=True)),
]


def _ids(cases):
    return [f"{model}-{case.name}" for model, case in cases]


@pytest.fixture(scope="session")
def int4_checkpoint(tmp_path_factory):
    """``(model, case) -> (4-bit checkpoint dir, its float reference dir)``, cached."""
    root = tmp_path_factory.mktemp("int4")
    floats: dict[str, pathlib.Path] = {}
    built: dict[tuple[str, Case], tuple[pathlib.Path, pathlib.Path]] = {}

    def get(model: str, case: Case):
        if model not in floats:
            arch, overrides = MODELS[model]
            floats[model] = build_tiny_model(root / model, arch, seed=0, **overrides)
        if (model, case) not in built:
            name = f"{model}-{case.name}"
            quantized = write_checkpoint(floats[model], root / name, case)
            built[model, case] = quantized, write_float_checkpoint(quantized, root / f"{name}-ref")
        return built[model, case]

    return get


@pytest.fixture
def dequantize_kernel(monkeypatch):
    """Run the 4-bit layers through llmlab's own dequantize-then-matmul."""
    monkeypatch.setattr(w4a16_module, "_int4_kernels", lambda: None)


def _load(path, dtype=torch.float32):
    config = transformers.AutoConfig.from_pretrained(path)
    spec = resolve_quantization(None, config, torch.device("cpu"))
    if spec is None:
        return load_model(path, config, dtype, "cpu")
    return spec.load_model(path, config, dtype, torch.device("cpu"))


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _relative_error(ours: torch.Tensor, expected: torch.Tensor) -> float:
    return float((ours.float() - expected).abs().max() / expected.abs().max())


def _logit_errors(model, reference, vocab_size: int) -> list[float]:
    """Relative errors of a 37-token prefill's logits and two decode steps' against the
    reference run from scratch."""
    tokens = torch.randint(2, vocab_size, (39,), generator=torch.Generator().manual_seed(1))
    tokens = tokens.tolist()
    runner = PagedRunner(model)
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0]
    errors = [_relative_error(runner.step({0: tokens[:37]})[0], expected[:37])]
    for length in (38, 39):
        errors.append(_relative_error(runner.step({0: [tokens[length - 1]]})[0],
                                      expected[length - 1:length]))
    return errors


@pytest.mark.parametrize("kernel", ["dequantize", "int4"])
@pytest.mark.parametrize(("model", "case"), LOGIT_CASES, ids=_ids(LOGIT_CASES))
def test_float32_logits_match_transformers_on_the_spec_dequantized_weights(
    int4_checkpoint, model, case, kernel, monkeypatch
):
    if kernel == "dequantize":
        monkeypatch.setattr(w4a16_module, "_int4_kernels", lambda: None)
    elif w4a16_module._int4_kernels() is None:
        pytest.skip("llmlab.kernels.int4 is not there")
    quantized, reference = int4_checkpoint(model, case)
    ours = _load(quantized)
    layers = [m for m in ours.modules() if isinstance(m, W4A16Linear)]
    assert layers and all(m.kernel == kernel for m in layers)
    errors = _logit_errors(ours, _hf(reference), ours.vocab_size)
    assert max(errors) <= REL_TOL, errors


@pytest.mark.parametrize(("model", "case"), FUSED_CASES, ids=_ids(FUSED_CASES))
def test_fused_layers_hold_exactly_the_spec_weights(int4_checkpoint, dequantize_kernel,
                                                     model, case):
    """q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj`` (an expert's too), down_proj:
    the dequantized canonical layout is bit for bit the reference's float weights, in the
    checkpoint's input order (act-order permutations undone)."""
    quantized, reference = int4_checkpoint(model, case)
    ours = _load(quantized)
    expected = load_file(pathlib.Path(reference) / "model.safetensors")
    layer, attention = ours.layers[0], "model.layers.0.self_attn"
    qkv = torch.cat([expected[f"{attention}.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.dequantized_weight(), qkv)
    assert torch.equal(layer.self_attn.o_proj.dequantized_weight(),
                       expected[f"{attention}.o_proj.weight"])
    if hasattr(layer.mlp, "experts"):
        mlp, hf_mlp = layer.mlp.experts[1], (
            "model.layers.0.block_sparse_moe.experts.1" if model == "mixtral"
            else "model.layers.0.mlp.experts.1")
        names = ("w1", "w3", "w2") if model == "mixtral" else ("gate_proj", "up_proj",
                                                                "down_proj")
        assert isinstance(layer.mlp.gate, torch.nn.Linear)  # the router stays float
    else:
        mlp, hf_mlp, names = layer.mlp, "model.layers.0.mlp", ("gate_proj", "up_proj",
                                                                 "down_proj")
    gate_up = torch.cat([expected[f"{hf_mlp}.{n}.weight"] for n in names[:2]])
    assert torch.equal(mlp.gate_up_proj.dequantized_weight(), gate_up)
    assert torch.equal(mlp.down_proj.dequantized_weight(), expected[f"{hf_mlp}.{names[2]}.weight"])
    assert (layer.self_attn.qkv_proj.perm is not None) == (
        case.act_order and (case.group_size or 64) < qkv.shape[1])


def _hf_greedy(reference, prompts, max_tokens=16) -> list[list[int]]:
    found = []
    with torch.no_grad():
        for prompt in prompts:
            tokens = list(prompt)
            for _ in range(max_tokens):
                tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
            found.append(tokens[len(prompt):])
    return found


@pytest.mark.parametrize(("model", "case"), GREEDY_CASES, ids=_ids(GREEDY_CASES))
def test_the_engine_decodes_the_same_greedy_tokens_as_transformers(int4_checkpoint, model,
                                                                    case):
    """``LLM(path)`` on the 4-bit checkpoint (its default kernel) in float32."""
    quantized, reference = int4_checkpoint(model, case)
    llm = LLM(str(quantized), **SETTINGS)
    assert greedy_continuations(llm) == _hf_greedy(_hf(reference), PROMPTS)


def test_bfloat16_through_the_int4_kernels_agrees_with_the_float32_reference(int4_checkpoint):
    """bfloat16 activations (on CPU: ATen's int4 matmul at decode, the chunked
    dequantize-matmul for prefill): the float32 reference's greedy choice kept at >= 90%
    of the positions, teacher-forced (bf16 rounding, not the 4-bit weights, is the error:
    they are the reference's own)."""
    if w4a16_module._int4_kernels() is None:
        pytest.skip("llmlab.kernels.int4 is not there")
    quantized, reference = int4_checkpoint("llama-wide", Case("gptq", 128))
    bf16 = LLM(str(quantized), **{**SETTINGS, "dtype": "bfloat16"})
    assert agreement(LLM(str(reference), **SETTINGS), bf16) >= 0.9


def test_weight_memory_is_about_4_3_bits_per_weight_at_group_128(int4_checkpoint,
                                                                   dequantize_kernel):
    """The canonical layout: 4 bits per weight, a float32 scale and a uint8 zero point per
    group of 128: 4 + 40 / 128 = 4.3125 bits (no act-order permutation here)."""
    quantized, _ = int4_checkpoint("llama-wide", Case("gptq", 128))
    memory = weight_memory(_load(quantized))
    assert memory.schemes == ("w4a16",)
    assert memory.bits_per_quantized_weight == pytest.approx(4 + 40 / 128)
    assert "4.31 bits per weight" in memory.describe()


def test_the_int4_kernels_memory_is_reported_with_their_own_copies(int4_checkpoint):
    """With :mod:`llmlab.kernels.int4` the handle holds the weight (the canonical buffers
    are released, so it is held once): float32 on CPU, its dequantize layout."""
    if w4a16_module._int4_kernels() is None:
        pytest.skip("llmlab.kernels.int4 is not there")
    quantized, _ = int4_checkpoint("llama-wide", Case("gptq", 128))
    model = _load(quantized)
    layers = [m for m in model.modules() if isinstance(m, W4A16Linear)]
    assert all(m.kernel == "int4" and not m.holds_canonical for m in layers)
    handles = sum(m._handle.nbytes for m in layers)
    weights = sum(m.in_features * m.out_features for m in layers)
    memory = weight_memory(model)
    assert memory.quantized_bytes == handles
    # Half a byte per weight plus float32 scales and float32 zero points per group.
    assert memory.bits_per_quantized_weight == pytest.approx(8 * handles / weights)
    assert memory.bits_per_quantized_weight < 5


CUDA = dict(device="cuda", seed=0, gpu_memory_utilization=0.3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("model", "case"), GREEDY_CASES, ids=_ids(GREEDY_CASES))
def test_on_cuda_float32_decodes_transformers_tokens_and_bfloat16_agrees(int4_checkpoint,
                                                                         model, case):
    """The CUDA kernels (:mod:`llmlab.kernels.int4`: the Triton W4A16 GEMM where it takes
    the group size), CUDA graphs for decode included."""
    quantized, reference = int4_checkpoint(model, case)
    llm = LLM(str(quantized), **{**CUDA, "dtype": "float32"})
    layers = [m for m in llm.llm_engine.executor.model.modules() if isinstance(m, W4A16Linear)]
    assert layers and all(m.kernel == "int4" for m in layers)
    assert greedy_continuations(llm) == _hf_greedy(_hf(reference), PROMPTS)
    bf16 = LLM(str(quantized), **{**CUDA, "dtype": "bfloat16"})
    assert agreement(LLM(str(reference), **{**CUDA, "dtype": "float32"}), bf16) >= 0.9


def test_a_pytorch_bin_checkpoint_loads_as_its_safetensors_twin(int4_checkpoint, tmp_path,
                                                               dequantize_kernel):
    """Older GPTQ uploads ship ``pytorch_model.bin``; the same tensors, the same layers."""
    quantized, _ = int4_checkpoint("llama", Case("gptq", 32, act_order=True))
    twin = tmp_path / "bin"
    twin.mkdir()
    for item in pathlib.Path(quantized).iterdir():
        if item.name != "model.safetensors":
            (twin / item.name).write_bytes(item.read_bytes())
    torch.save(load_file(pathlib.Path(quantized) / "model.safetensors"),
               twin / "pytorch_model.bin")
    expected, got = _load(quantized), _load(twin)
    for name, module in expected.named_modules():
        if isinstance(module, W4A16Linear):
            assert torch.equal(got.get_submodule(name).dequantized_weight(),
                               module.dequantized_weight()), name
