"""Where PEFT's LoRA targets land in llmlab's models: the per-layer projections that can
carry an adapter, with the output slice of each fused projection a PEFT module maps to.

llmlab fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (see
:mod:`llmlab.models.llama`), so PEFT's ``q_proj`` adapter updates the first
``num_heads * head_dim`` outputs of ``qkv_proj``, ``k_proj`` the next ``kv`` ones, and so on.
"""

from __future__ import annotations

import attrs
from torch import nn

# PEFT's module names llmlab applies, in the order of their fused module's output slices.
SUPPORTED_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
)


@attrs.frozen
class LoRATarget:
    """One linear module that may carry adapters.

    Attributes:
        path: its name in the model (``layers.3.self_attn.qkv_proj``).
        in_features: its input width.
        slices: per PEFT module it hosts, ``(peft name, first output, number of outputs)``,
            in output order (one entry for an unfused projection).
    """

    path: str
    in_features: int
    slices: tuple[tuple[str, int, int], ...]

    @property
    def out_features(self) -> int:
        return sum(size for _, _, size in self.slices)


@attrs.frozen
class LoRATargets:
    """Every module of a model that may carry an adapter, and how PEFT names map to them.

    ``by_peft_name[f"layers.{i}.self_attn.q_proj"] = (target, slice index)``.
    """

    targets: tuple[LoRATarget, ...]
    by_peft_name: dict[str, tuple[LoRATarget, int]] = attrs.field(eq=False)
    num_layers: int

    @classmethod
    def of(cls, model: nn.Module) -> LoRATargets:
        """The targets of a Llama-family model (Llama, Mistral, Qwen2, Qwen3, and the
        attention and dense MLPs of its mixture-of-experts members: an expert carries no
        adapter). Raises ``ValueError`` for any other architecture (``enable_lora`` cannot
        serve it) or a tensor-parallel shard."""
        from llmlab.models.llama import LlamaForCausalLM

        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(
                f"enable_lora=True supports the Llama family (Llama, Mistral, Qwen2, Qwen3); "
                f"this model is {type(model).__name__}"
            )
        spec = model.spec
        if model.tp.is_parallel:
            raise ValueError("enable_lora=True does not support tensor_parallel_size > 1")
        q, kv, inner = spec.q_size, spec.kv_size, spec.intermediate_size
        targets = []
        for i, layer in enumerate(model.layers):
            pre = f"layers.{i}."
            targets += [
                LoRATarget(f"{pre}self_attn.qkv_proj", spec.hidden_size, (
                    ("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))),
                LoRATarget(f"{pre}self_attn.o_proj", q, (("o_proj", 0, spec.hidden_size),)),
            ]
            if hasattr(layer.mlp, "experts"):  # a sparse MoE layer: no adapter on experts
                continue
            targets += [
                LoRATarget(f"{pre}mlp.gate_up_proj", spec.hidden_size, (
                    ("gate_proj", 0, inner), ("up_proj", inner, inner))),
                LoRATarget(f"{pre}mlp.down_proj", inner, (("down_proj", 0, spec.hidden_size),)),
            ]
        by_peft_name = {}
        for target in targets:
            parent = target.path.rsplit(".", 1)[0]
            for j, (name, _, _) in enumerate(target.slices):
                by_peft_name[f"{parent}.{name}"] = (target, j)
        return cls(tuple(targets), by_peft_name, spec.num_layers)
