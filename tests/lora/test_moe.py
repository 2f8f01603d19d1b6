"""LoRA on mixture-of-experts models: adapters on the attention and on the dense MLP layers a
config keeps equal HF transformers + PEFT token for token; an adapter on the experts (PEFT's
``target_parameters``, or per-expert modules) is refused naming what it adapts."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from safetensors.torch import load_file, save_file

from llmlab import LLM, LoRARequest
from llmlab.testing import build_tiny_model
from tests.lora.conftest import build_adapter, peft_greedy
from tests.lora.test_parity import NEW_TOKENS, prompts_for, run

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def qwen3_moe_with_a_dense_layer(tmp_path_factory) -> str:
    """Qwen3-MoE whose layer 0 keeps a dense MLP (``mlp_only_layers``): PEFT names its
    gate/up/down projections as a dense model's."""
    path = tmp_path_factory.mktemp("qwen3moe-dense0")
    return str(build_tiny_model(path, "Qwen3MoeForCausalLM", mlp_only_layers=[0]))


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_an_attention_adapter_on_an_moe_model_equals_hf_peft(
    tiny_model_factory, adapter_factory, arch
):
    base = tiny_model_factory(arch)
    adapter = adapter_factory(base, f"attn-{arch}", targets=ATTENTION)
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8,
              max_num_batched_tokens=32)
    prompts = prompts_for()
    got = run(llm, prompts, LoRARequest("attn", 1, adapter))
    assert got == peft_greedy(base, adapter, prompts, NEW_TOKENS)
    assert got != run(llm, prompts), "the adapter changes nothing: the test proves nothing"


def _merged_greedy(base: str, adapter: str, prompts, max_new_tokens: int) -> list[list[int]]:
    """HF transformers greedy on the base weights plus each adapter's ``scale * B @ A``,
    merged by hand (PEFT would re-target an MoE model's ``down_proj`` onto its experts)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = json.loads((pathlib.Path(adapter) / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(pathlib.Path(adapter) / "adapter_model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        for key, a in tensors.items():
            if ".lora_A." not in key:
                continue
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            module = key.removeprefix("base_model.model.").rsplit(".lora_A.", 1)[0]
            model.get_submodule(module).weight += scale * (b @ a)
        outs = []
        for p in prompts:
            gen = model.generate(
                input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p):].tolist())
    return outs


def test_the_dense_mlp_of_an_moe_model_takes_an_adapter(
    qwen3_moe_with_a_dense_layer, tmp_path
):
    """Layer 0 of this Qwen3-MoE is dense: an adapter on its ``down_proj`` applies (written
    by hand: PEFT re-targets ``down_proj`` onto the experts of this architecture)."""
    import torch

    base = qwen3_moe_with_a_dense_layer
    adapter = pathlib.Path(build_adapter(base, tmp_path / "mlp", targets=("q_proj",), seed=2))
    config = json.loads((adapter / "adapter_config.json").read_text())
    hf = json.loads((pathlib.Path(base) / "config.json").read_text())
    gen = torch.Generator().manual_seed(5)
    tensors = load_file(adapter / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.mlp.down_proj"
    tensors[f"{prefix}.lora_A.weight"] = 0.1 * torch.randn(
        config["r"], hf["intermediate_size"], generator=gen)
    tensors[f"{prefix}.lora_B.weight"] = 0.1 * torch.randn(
        hf["hidden_size"], config["r"], generator=gen)
    save_file(tensors, adapter / "adapter_model.safetensors")
    config["target_modules"] = ["q_proj", "down_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))

    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    prompts = prompts_for(seed=4)
    got = run(llm, prompts, LoRARequest("mlp", 1, str(adapter)))
    assert got == _merged_greedy(base, str(adapter), prompts, NEW_TOKENS)
    # The down_proj part matters: without it the tokens differ.
    del tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
    attention_only = tmp_path / "attention-only"
    shutil.copytree(adapter, attention_only)
    save_file(tensors, attention_only / "adapter_model.safetensors")
    assert got != run(llm, prompts, LoRARequest("attn", 2, str(attention_only)))


def test_an_adapter_on_the_experts_is_refused_naming_them(tiny_model_factory, tmp_path):
    base = tiny_model_factory("Qwen3MoeForCausalLM")
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=16)
    prompts = prompts_for()
    # PEFT adapts fused expert weights through target_parameters.
    experts = build_adapter(base, tmp_path / "experts", targets=("q_proj", "gate_proj", "up_proj"))
    config = json.loads((pathlib.Path(experts) / "adapter_config.json").read_text())
    assert config.get("target_parameters"), "PEFT no longer adapts experts by parameter"
    with pytest.raises(ValueError, match="target_parameters.*experts"):
        run(llm, prompts, LoRARequest("experts", 1, experts))
    # Per-expert modules (older transformers' layout: experts.N.gate_proj).
    attn = build_adapter(base, tmp_path / "attn", targets=("q_proj",))
    per_expert = tmp_path / "per-expert"
    shutil.copytree(attn, per_expert)
    weights_file = per_expert / "adapter_model.safetensors"
    tensors = {
        k.replace("self_attn.q_proj", "mlp.experts.0.gate_proj"): v
        for k, v in load_file(weights_file).items()
    }
    save_file(tensors, weights_file)
    with pytest.raises(ValueError, match=r"expert .*mlp\.experts\.0\.gate_proj"):
        run(llm, prompts, LoRARequest("per-expert", 2, str(per_expert)))
    # The engine goes on serving.
    assert run(llm, prompts) == run(llm, prompts)
