"""Mixture-of-experts members of the Llama family: Mixtral, Qwen3-MoE and OLMoE.

The attention is the family's. In the layers the config names, the gated MLP gives way to
a sparse block: a router (a bias-free linear, one logit per expert) scores each token, the
softmax of those logits (in float32) picks the token's ``top_k`` experts, and the token's
output is their gated MLPs weighted by the picked probabilities, renormalised over the
``top_k`` where the checkpoint says so (Mixtral always, Qwen3-MoE and OLMoE with
``norm_topk_prob``): as transformers computes it, Mixtral weighting in float32, the others
in the activations' dtype.

Each expert is a :class:`~llmlab.models.llama.GatedMLP` (gate and up fused at load time,
split like the dense MLP under tensor parallelism, the experts' sum reduced once). A step
runs each expert that received tokens once, on those tokens gathered: the plain path on
every device; a fused kernel is issue 43's next piece.
"""

from __future__ import annotations

import re

import attrs
import torch
from torch import nn

from llmlab.distributed.parallel_state import TensorParallel
from llmlab.kernels import fused
from llmlab.models.layers import config_value
from llmlab.models.llama import (
    GatedMLP,
    LlamaFamilySpec,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    _base_spec,
)
from llmlab.models.weights import WeightTarget


@attrs.frozen
class MoESpec:
    """A checkpoint's experts: how many, how many per token, each one's inner width, whether
    the picked probabilities are renormalised and weigh in float32, and per layer whether
    it is sparse (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    float32_weights: bool
    sparse_layers: tuple[bool, ...]

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and the number of "
                f"experts ({self.num_experts})"
            )


class SparseMoeBlock(nn.Module):
    """The router and the experts of one layer (see the module docstring)."""

    def __init__(self, spec: LlamaFamilySpec, moe: MoESpec, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = moe.top_k
        self.normalize = moe.normalize
        self.float32_weights = moe.float32_weights
        # Replicated: every rank routes every token the same way.
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        expert = attrs.evolve(spec, intermediate_size=moe.intermediate_size, mlp_bias=False)
        self.experts = nn.ModuleList(GatedMLP(expert, tp) for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, top_k]``: the picked experts and what
        their outputs weigh."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), chosen

    def forward(self, x: torch.Tensor, fuse: bool = False) -> torch.Tensor:
        weights, chosen = self.route(x)
        out = torch.zeros_like(x)
        # Token-expert pairs grouped by expert: each expert runs once, on its tokens.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        flat_weights = weights.reshape(-1)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if not count:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // self.top_k
            gate_up = expert.gate_up_proj(x[tokens])
            if fuse and expert.silu:
                hidden = fused.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = expert.act(gate) * up
            y = expert.down_proj(hidden) * flat_weights[pairs, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return self.tp.all_reduce(out)


_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)$")


class _MoEMixin:
    """What both MoE classes share: the sparse layers, and checkpoint names of the experts
    mapped onto :class:`GatedMLP`'s fused parameters. Subclasses say where the block lives
    in the checkpoint (``_BLOCK``) and what each expert's projections are called
    (``_PROJECTIONS``: gate, up, down)."""

    _BLOCK = "mlp"
    _PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    # Which experts run, and on how many tokens, is read on the host each step: a captured
    # CUDA graph would replay one step's routing. Decode runs eagerly until a fused kernel.
    cuda_graphs = False

    def __init__(self, hf_config: object, tp: TensorParallel | None = None) -> None:
        super().__init__(hf_config, tp)
        self.moe = moe = self.moe_from_config(hf_config)
        if len(moe.sparse_layers) != self.spec.num_layers:
            raise ValueError(
                f"{len(moe.sparse_layers)} layer flags for {self.spec.num_layers} layers"
            )
        for layer, sparse in zip(self.layers, moe.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoeBlock(self.spec, moe, self.tp)

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        raise NotImplementedError

    def fused_sizes(self) -> dict[str, int]:
        sizes = super().fused_sizes()
        sizes["inner"] = self.moe.intermediate_size // self.tp.size
        return sizes

    def _layer_target(self, layer: str, module: str, leaf: str,
                      intermediate_size: int | None = None) -> WeightTarget | None:
        prefix = f"{self._BLOCK}."
        if module.startswith(prefix):
            inner = module[len(prefix):]
            expert = _EXPERT.match(inner)
            if expert is not None:
                index, projection = expert.groups()
                names = dict(zip(self._PROJECTIONS, ("gate_proj", "up_proj", "down_proj"),
                                 strict=True))
                if projection not in names:
                    return None
                # An expert is a GatedMLP of the expert width: the dense MLP's mapping,
                # under the expert's name.
                dense = f"mlp.{names[projection]}"
                target = super()._layer_target(
                    layer, dense, leaf, self.moe.intermediate_size,
                ) or WeightTarget(f"{layer}{dense}.{leaf}")
                param = target.param.replace(f"{layer}mlp.", f"{layer}mlp.experts.{index}.", 1)
                return attrs.evolve(target, param=param)
            if inner == "gate":
                return WeightTarget(f"{layer}mlp.gate.{leaf}")
        return super()._layer_target(layer, module, leaf, intermediate_size)


class MixtralForCausalLM(_MoEMixin, LlamaForCausalLM):
    """Mixtral 8x7B / 8x22B (Jiang et al., 2024): every layer sparse, the picked
    probabilities always renormalised; experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)
    under ``block_sparse_moe``; Mistral's optional sliding window."""

    _BLOCK = "block_sparse_moe"
    _PROJECTIONS = ("w1", "w3", "w2")

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        window = config_value(hf_config, "sliding_window")
        return _base_spec(hf_config, layer_windows=(window,) * hf_config.num_hidden_layers)

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        return MoESpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            normalize=True,
            float32_weights=True,
            sparse_layers=(True,) * hf_config.num_hidden_layers,
        )


class Qwen3MoeForCausalLM(_MoEMixin, Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen team, 2025): Qwen3's attention; sparse layers every
    ``decoder_sparse_step`` layers except ``mlp_only_layers`` (those keep a dense MLP of
    ``intermediate_size``), experts of ``moe_intermediate_size``; the picked probabilities
    renormalised when ``norm_topk_prob``."""

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        num_layers = hf_config.num_hidden_layers
        num_experts = hf_config.num_experts
        step = config_value(hf_config, "decoder_sparse_step", default=1) or 1
        dense = set(config_value(hf_config, "mlp_only_layers", default=()) or ())
        return MoESpec(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            normalize=bool(config_value(hf_config, "norm_topk_prob", default=False)),
            float32_weights=False,
            sparse_layers=tuple(
                i not in dense and num_experts > 0 and (i + 1) % step == 0
                for i in range(num_layers)
            ),
        )


class OlmoeForCausalLM(_MoEMixin, LlamaForCausalLM):
    """OLMoE (Muennighoff et al., 2024): every layer sparse; q and k each normalised over
    all heads at once, q, k and v optionally clamped (``clip_qkv``), the picked
    probabilities renormalised when ``norm_topk_prob``."""

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        return _base_spec(hf_config, qk_norm_full=True,
                          clip_qkv=config_value(hf_config, "clip_qkv", default=None))

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        return MoESpec(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            normalize=bool(config_value(hf_config, "norm_topk_prob", default=False)),
            float32_weights=False,
            sparse_layers=(True,) * hf_config.num_hidden_layers,
        )
