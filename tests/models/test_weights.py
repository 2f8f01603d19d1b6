"""load_weights accepts real checkpoint naming variants and rejects anything off."""

from __future__ import annotations

import pytest
import torch
import transformers

from llmlab.models import get_model_class, iterate_weights


def _fresh_model(path):
    config = transformers.AutoConfig.from_pretrained(path)
    return get_model_class(config.architectures)(config)


def _checkpoint(path) -> dict[str, torch.Tensor]:
    return dict(iterate_weights(path))


def test_unexpected_weight_name_raises(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    weights = _checkpoint(path)
    weights["model.layers.0.self_attn.surprise.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.surprise"):
        _fresh_model(path).load_weights(weights.items())


def test_missing_weight_raises_naming_the_parameter(tiny_model_dirs):
    path = tiny_model_dirs["llama"]
    weights = _checkpoint(path)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match=r"norm\.weight \(0/64 rows\)"):
        _fresh_model(path).load_weights(weights.items())


def test_missing_slice_of_a_fused_projection_raises(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    weights = _checkpoint(path)
    del weights["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.bias"):
        _fresh_model(path).load_weights(weights.items())


def test_shape_mismatch_raises(tiny_model_dirs):
    path = tiny_model_dirs["gpt2"]
    weights = _checkpoint(path)
    weights["transformer.ln_f.weight"] = torch.ones(65)
    with pytest.raises(ValueError, match="ln_f.weight"):
        _fresh_model(path).load_weights(weights.items())


def _logits(model, paged_runner, tokens):
    return paged_runner(model).step({0: tokens})[0]


def test_legacy_llama_names_with_rotary_buffers_load(tiny_model_dirs, paged_runner, load_pair):
    path = tiny_model_dirs["llama-biases-tied"]
    weights = _checkpoint(path)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # tied, stored
    model = _fresh_model(path).eval()
    model.load_weights(weights.items())
    reference, _ = load_pair("llama-biases-tied")
    tokens = list(range(2, 30))
    torch.testing.assert_close(
        _logits(model, paged_runner, tokens), _logits(reference, paged_runner, tokens)
    )


def test_original_gpt2_names_without_prefix_and_with_mask_buffers_load(
    tiny_model_dirs, paged_runner, load_pair
):
    # The "gpt2" repo on the Hub has bare names (h.0.attn.c_attn.weight) and saves the
    # causal-mask buffers h.N.attn.bias / h.N.attn.masked_bias.
    path = tiny_model_dirs["gpt2"]
    weights = {k.removeprefix("transformer."): v for k, v in _checkpoint(path).items()}
    for layer in range(2):
        weights[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 512, 512, dtype=torch.bool)
        weights[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    model = _fresh_model(path).eval()
    model.load_weights(weights.items())
    reference, _ = load_pair("gpt2")
    tokens = list(range(2, 30))
    torch.testing.assert_close(
        _logits(model, paged_runner, tokens), _logits(reference, paged_runner, tokens)
    )


@pytest.mark.parametrize("prefix", ["decoder.", "model.decoder."])
def test_opt_names_with_either_prefix_load(tiny_model_dirs, paged_runner, load_pair, prefix):
    path = tiny_model_dirs["opt"]
    weights = {prefix + k.removeprefix("model.decoder."): v for k, v in _checkpoint(path).items()}
    model = _fresh_model(path).eval()
    model.load_weights(weights.items())
    reference, _ = load_pair("opt")
    tokens = list(range(2, 30))
    torch.testing.assert_close(
        _logits(model, paged_runner, tokens), _logits(reference, paged_runner, tokens)
    )


@pytest.mark.parametrize("variant", ["llama-biases-tied", "qwen3", "gpt2", "opt"])
def test_tied_head_uses_the_embedding_matrix(variant, tiny_model_dirs, load_pair):
    ours, reference = load_pair(variant)
    assert ours.lm_head is None
    hf_embed = reference.get_input_embeddings().weight
    hf_head = reference.get_output_embeddings().weight
    assert hf_head.data_ptr() == hf_embed.data_ptr()
    hidden = torch.randn(3, hf_embed.shape[1])
    embed = ours.wte.weight if hasattr(ours, "wte") else ours.embed_tokens.weight
    torch.testing.assert_close(ours.compute_logits(hidden), hidden @ embed.T)
    torch.testing.assert_close(embed, hf_embed)
    assert not any(name.startswith("lm_head") for name in _checkpoint(tiny_model_dirs[variant]))


def test_untied_head_is_loaded_separately(load_pair):
    ours, reference = load_pair("llama")
    torch.testing.assert_close(ours.lm_head.weight, reference.lm_head.weight)
    assert not torch.equal(ours.lm_head.weight, ours.embed_tokens.weight)
