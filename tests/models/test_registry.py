from __future__ import annotations

import pytest

from llmlab.models import (
    MODEL_REGISTRY,
    CausalLM,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    get_model_class,
    register_model,
)


def test_first_supported_architecture_wins():
    assert get_model_class(["SomethingElse", "Qwen3ForCausalLM"]) is Qwen3ForCausalLM


@pytest.mark.parametrize("architectures", [["MambaForCausalLM"], None, []])
def test_unsupported_architecture_error_names_it_and_lists_supported(architectures):
    with pytest.raises(ValueError) as excinfo:
        get_model_class(architectures)
    message = str(excinfo.value)
    assert repr(architectures) in message
    for name in ("LlamaForCausalLM", "GPT2LMHeadModel", "OPTForCausalLM", "Qwen2ForCausalLM"):
        assert name in message


def test_register_model_adds_a_researcher_architecture():
    class MyLlama(LlamaForCausalLM):
        pass

    register_model("MyLlamaForCausalLM", MyLlama)
    try:
        assert get_model_class(["MyLlamaForCausalLM"]) is MyLlama
    finally:
        MODEL_REGISTRY.pop("MyLlamaForCausalLM")


def test_register_model_rejects_non_classes():
    with pytest.raises(ValueError, match="needs a class"):
        register_model("Broken", object())


def test_models_follow_the_causal_lm_protocol(load_pair):
    ours, _ = load_pair("qwen3")
    assert isinstance(ours, CausalLM)
    assert ours.kv_layout.head_dim == 32  # Qwen3's explicit head_dim, not hidden / heads
