from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from llmlab.kernels.fused import apply_rotary
from llmlab.models.layers import (
    RMSNorm,
    RopeSpec,
    RotaryEmbedding,
    get_activation,
)

HEAD_DIM = 16


def _hf_cos_sin(hf_config, positions: torch.Tensor):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(hf_config)
    x = torch.zeros(1, positions.numel(), HEAD_DIM)
    cos, sin = rotary(x, positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
    ids=lambda rope: rope["rope_type"],
)
def test_rotary_angles_match_hf_for_each_rope_type(rope):
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=4096, rope_parameters=rope
    )
    positions = torch.tensor([0, 1, 5, 63, 64, 1000, 4000])
    cos, sin = RotaryEmbedding(RopeSpec.from_config(config, HEAD_DIM)).cos_sin(
        positions, torch.float32
    )
    hf_cos, hf_sin = _hf_cos_sin(config, positions)
    torch.testing.assert_close(cos, hf_cos, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, hf_sin, atol=1e-5, rtol=0)


def test_rope_spec_reads_transformers_4_spellings():
    old_style = types.SimpleNamespace(
        rope_theta=500.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        max_position_embeddings=2048,
    )
    spec = RopeSpec.from_config(old_style, HEAD_DIM)
    assert (spec.rope_type, spec.theta, spec.params["factor"]) == ("linear", 500.0, 2.0)
    plain = RopeSpec.from_config(types.SimpleNamespace(rope_theta=1e6), HEAD_DIM)
    assert (plain.rope_type, plain.theta) == ("default", 1e6)


def test_unsupported_rope_type_is_named_in_the_error():
    config = types.SimpleNamespace(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="'yarn'.*default, linear, llama3"):
        RopeSpec.from_config(config, HEAD_DIM)


def test_partial_rotary_rotates_only_the_leading_channels():
    config = types.SimpleNamespace(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    )
    spec = RopeSpec.from_config(config, HEAD_DIM)
    assert spec.rotary_dim == HEAD_DIM // 2
    positions = torch.arange(5)
    cos, sin = RotaryEmbedding(spec).cos_sin(positions, torch.float32)
    x = torch.randn(5, 3, HEAD_DIM)
    out = apply_rotary(x, cos, sin)
    torch.testing.assert_close(out[..., HEAD_DIM // 2 :], x[..., HEAD_DIM // 2 :])
    rotated = apply_rotary(x[..., : HEAD_DIM // 2], cos, sin)
    torch.testing.assert_close(out[..., : HEAD_DIM // 2], rotated)
    assert not torch.allclose(out[1:], x[1:])


def test_rms_norm_matches_hf_llama_rms_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, theirs = RMSNorm(32, eps=1e-5), LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        weight = torch.randn(32)
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    x = torch.randn(7, 32) * 3
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu"])
def test_activations_match_transformers(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-5, 5, 101)
    torch.testing.assert_close(get_activation(name)(x), ACT2FN[name](x), atol=1e-6, rtol=0)


def test_unknown_activation_lists_supported_names():
    with pytest.raises(ValueError, match="'mish'.*silu"):
        get_activation("mish")


def test_gelu_new_is_the_tanh_approximation():
    x = torch.linspace(-3, 3, 13)
    torch.testing.assert_close(get_activation("gelu_new")(x), F.gelu(x, approximate="tanh"))
