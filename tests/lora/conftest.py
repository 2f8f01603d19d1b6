"""Random PEFT LoRA adapters for the tiny models, built on the fly with ``peft``."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    base_path: str,
    out_dir: pathlib.Path,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    targets: tuple[str, ...] | str = ALL_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.1,
) -> str:
    """Save a PEFT adapter of ``base_path`` with random, non-zero A and B (PEFT starts B at
    zero, which would change nothing). ``targets``: module names, or one regex (PEFT's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, lora_dropout=0.0,
        target_modules=targets if isinstance(targets, str) else list(targets),
        use_rslora=use_rslora, init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(str(out_dir))
    return str(out_dir)


def peft_greedy(base_path: str, adapter_dir: str, prompts, max_new_tokens: int, merged=False):
    """HF transformers + PEFT greedy continuations of ``prompts`` (token id lists)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, adapter_dir).eval()
    if merged:
        model = model.merge_and_unload()
    outs = []
    for p in prompts:
        with torch.no_grad():
            gen = model.generate(
                input_ids=torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                do_sample=False, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, pad_token_id=0,
            )
        outs.append(gen[0, len(p):].tolist())
    return outs


def edit_config(adapter_dir: str, **changes) -> None:
    path = pathlib.Path(adapter_dir) / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory):
    """``factory(base_path, name, **build_adapter options) -> adapter dir`` (cached)."""
    built: dict[tuple, str] = {}

    def factory(base_path: str, name: str, **options) -> str:
        key = (base_path, name, tuple(sorted(options.items())))
        if key not in built:
            built[key] = build_adapter(base_path, tmp_path_factory.mktemp(name), **options)
        return built[key]

    return factory
