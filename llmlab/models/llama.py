"""The Llama decoder family: Llama, Mistral, Qwen2 and Qwen3.

All four are the same network (pre-norm RMSNorm blocks, rotary GQA attention, gated MLP);
they differ only in a few switches, which :class:`LlamaFamilySpec` collects from each
config. The classes below only decide those switches, so adding a close relative is a
ten-line subclass.

q/k/v are fused into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` at load time,
so each block runs four matmuls instead of seven.
"""

from __future__ import annotations

import re

import attrs
import torch
from torch import nn

from llmlab.attention.backend import AttentionContext
from llmlab.distributed.parallel_state import TensorParallel, vocab_parallel_embed
from llmlab.kernels import fused
from llmlab.kernels.fused import apply_rotary
from llmlab.models.base import KVLayout, PagedCausalLMBase
from llmlab.models.layers import (
    RMSNorm,
    RopeSpec,
    RotaryEmbedding,
    config_value,
    get_activation,
)
from llmlab.models.weights import WeightTarget, strip_prefixes


@attrs.frozen
class LlamaFamilySpec:
    """Everything that distinguishes one member of the family from another.

    Attributes:
        layer_windows: sliding-window size per layer (None: full causal attention).
        qk_norm_full: q and k are normalised over all their heads at once (OLMoE), not
            per head (Qwen3's ``qk_norm``).
        clip_qkv: q, k and v are clamped to ``[-clip_qkv, clip_qkv]`` (OLMoE's option).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    hidden_act: str
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...]
    rope: RopeSpec
    qk_norm_full: bool = False
    clip_qkv: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _base_spec(hf_config: object, **switches: object) -> LlamaFamilySpec:
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    head_dim = config_value(hf_config, "head_dim", default=None) or hidden // heads
    num_layers = hf_config.num_hidden_layers
    fields = {
        "vocab_size": hf_config.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": hf_config.intermediate_size,
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": config_value(hf_config, "num_key_value_heads", default=heads),
        "head_dim": head_dim,
        "rms_norm_eps": config_value(hf_config, "rms_norm_eps", default=1e-6),
        "hidden_act": config_value(hf_config, "hidden_act", default="silu"),
        "qkv_bias": bool(config_value(hf_config, "attention_bias", default=False)),
        "o_bias": bool(config_value(hf_config, "attention_bias", default=False)),
        "mlp_bias": bool(config_value(hf_config, "mlp_bias", default=False)),
        "qk_norm": False,
        "tie_word_embeddings": bool(config_value(hf_config, "tie_word_embeddings", default=False)),
        "layer_windows": (None,) * num_layers,
        "rope": RopeSpec.from_config(hf_config, head_dim),
    }
    fields.update(switches)
    return LlamaFamilySpec(**fields)


def _qwen_layer_windows(hf_config: object) -> tuple[int | None, ...]:
    """Qwen2/3 window only some layers, and only when ``use_sliding_window`` is on.

    Their configs ship ``sliding_window: 4096`` even when it is off, so the size alone
    means nothing. transformers >= 4.5x spells the per-layer choice as ``layer_types``;
    older configs imply it as "layers from ``max_window_layers`` on".
    """
    num_layers = hf_config.num_hidden_layers
    window = config_value(hf_config, "sliding_window")
    if not config_value(hf_config, "use_sliding_window", default=False) or window is None:
        return (None,) * num_layers
    layer_types = config_value(hf_config, "layer_types")
    if layer_types is not None:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    first = config_value(hf_config, "max_window_layers", default=0)
    return tuple(window if i >= first else None for i in range(num_layers))


class LlamaAttention(nn.Module):
    """Under tensor parallelism: this rank's query heads and the KV heads they read
    (``qkv_proj`` column-parallel), and ``o_proj`` row-parallel, summed over the ranks."""

    def __init__(self, spec: LlamaFamilySpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.layer_idx = layer_idx
        self.num_heads = tp.split(spec.num_heads, "attention heads")
        self.num_kv_heads = tp.kv_heads(spec.num_kv_heads, spec.num_heads)[1]
        self.head_dim = spec.head_dim
        q_size = self.num_heads * spec.head_dim
        kv_size = self.num_kv_heads * spec.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.layer_windows[layer_idx]
        self.qkv_proj = nn.Linear(spec.hidden_size, sum(self.split_sizes), bias=spec.qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias)
        # Qwen3 normalises each head of q and k before rotating them; OLMoE all of q and
        # all of k at once (so one rank would need every head: no tensor parallelism).
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.full_norm = spec.qk_norm_full
        if spec.qk_norm_full:
            if tp.is_parallel:
                raise ValueError(
                    "this model normalises q and k across all heads (OLMoE): it runs with "
                    "tensor_parallel_size=1 only"
                )
            self.q_norm = RMSNorm(q_size, spec.rms_norm_eps)
            self.k_norm = RMSNorm(kv_size, spec.rms_norm_eps)
        self.clip_qkv = spec.clip_qkv

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionContext,
        fuse: bool = False,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        if self.full_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            clip = self.clip_qkv
            q, k, v = q.clamp(-clip, clip), k.clamp(-clip, clip), v.clamp(-clip, clip)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.full_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if fuse:  # in place, in the projection's output
            q = fused.rotary_(q, cos, sin)
            k = fused.rotary_(k, cos, sin)
        else:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        out = attn.attend(
            self.layer_idx, q, k, v, scale=self.scale, sliding_window=self.sliding_window
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, -1)))


class GatedMLP(nn.Module):
    """Under tensor parallelism: this rank's slice of the inner width (``gate_up_proj``
    column-parallel, ``down_proj`` row-parallel, summed over the ranks)."""

    def __init__(self, spec: LlamaFamilySpec, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        inner = tp.split(spec.intermediate_size, "intermediate size")
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * inner, bias=spec.mlp_bias)
        self.down_proj = nn.Linear(inner, spec.hidden_size, bias=spec.mlp_bias)
        self.act = get_activation(spec.hidden_act)
        self.silu = spec.hidden_act in ("silu", "swish")

    def forward(self, x: torch.Tensor, fuse: bool = False) -> torch.Tensor:
        if fuse and self.silu:
            return self.tp.all_reduce(self.down_proj(fused.silu_and_mul(self.gate_up_proj(x))))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaFamilySpec, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = LlamaAttention(spec, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = GatedMLP(spec, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with the residual stream carried separately (``residual`` is
        None at the first layer), so each residual add fuses with the norm after it; the
        same values, fewer passes (:mod:`llmlab.kernels.fused`). Returns ``(block output,
        residual)``: the next layer's input is their sum."""
        norm = self.input_layernorm
        h, residual = fused.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, cos, sin, attn, fuse=True)
        norm = self.post_attention_layernorm
        h, residual = fused.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, fuse=True), residual


_LAYER_NAME = re.compile(r"^(layers\.\d+\.)(.+)\.(weight|bias)$")


class LlamaForCausalLM(PagedCausalLMBase):
    """Llama 1/2/3 (Touvron et al., 2023; Meta, 2024) and the base of the family."""

    def __init__(self, hf_config: object, tp: TensorParallel | None = None) -> None:
        super().__init__()
        spec = self.spec_from_config(hf_config)
        self.spec = spec
        self.tp = tp = tp or TensorParallel.single()
        self.vocab_size = spec.vocab_size
        num_kv_heads = tp.kv_heads(spec.num_kv_heads, spec.num_heads)[1]
        self.kv_layout = KVLayout(spec.num_layers, num_kv_heads, spec.head_dim)
        vocab_rows = self.local_vocab_size()
        self.embed_tokens = nn.Embedding(vocab_rows, spec.hidden_size)
        self.rotary = RotaryEmbedding(spec.rope)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i, tp) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # A tied head reads ``embed_tokens.weight`` directly rather than sharing a
        # Parameter object, because sharing does not survive ``to_empty`` / meta init.
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else nn.Linear(spec.hidden_size, vocab_rows, bias=False)
        )
        # Set by the engine builder (``cpu_fused_ops``, ``cuda_fused_ops``): run the blocks
        # through ``forward_fused``.
        self.fused_ops = False

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        return _base_spec(hf_config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        return self.forward_embeds(self.embed(input_ids), positions, attn)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings ``[T, hidden]`` of ``input_ids`` (a multimodal model writes
        its image rows into them before :meth:`forward_embeds`)."""
        return vocab_parallel_embed(self.embed_tokens, input_ids, self.tp, self.vocab_size)

    def forward_embeds(
        self, hidden: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """:meth:`forward` from input embeddings: the decoder blocks and the final norm."""
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        if self.fused_ops:
            residual = None
            for layer in self.layers:
                hidden, residual = layer.forward_fused(hidden, residual, cos, sin, attn)
            return fused.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, attn)
        return self.norm(hidden)

    def input_embedding(self) -> nn.Embedding:
        return self.embed_tokens

    def fused_sizes(self) -> dict[str, int]:
        """This rank's row widths of the fused ops (``llmlab.kernels.triton_fused``'s check)."""
        attention, mlp = self.layers[0].self_attn, self.layers[0].mlp
        return dict(hidden=self.spec.hidden_size, head_dim=attention.head_dim,
                    rotary_dim=self.rotary.spec.rotary_dim,
                    inner=mlp.gate_up_proj.out_features // 2)

    def _map_weight_name(self, name: str) -> WeightTarget | None:
        if name.endswith("rotary_emb.inv_freq"):
            return None  # a precomputed buffer in old checkpoints; we derive it
        name = strip_prefixes(name, ("model.",))
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # some tied checkpoints store the head anyway
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return self.vocab_target(name)
        match = _LAYER_NAME.match(name)
        if match is None:
            return WeightTarget(name)
        layer, module, leaf = match.groups()
        target = self._layer_target(layer, module, leaf)
        # None: the tensor keeps its name; []: another rank's (an expert it does not hold).
        return WeightTarget(name) if target is None else target

    def _layer_target(self, layer: str, module: str, leaf: str,
                      intermediate_size: int | None = None) -> WeightTarget | None:
        """Where a projection's checkpoint tensor goes in our fused parameters, and which
        slice of it this rank reads (None: a tensor kept whole, as named).
        ``intermediate_size``: the MLP's inner width, if not the spec's (an expert's)."""
        tp, spec = self.tp, self.spec
        hd = spec.head_dim
        q_rows = spec.num_heads // tp.size * hd
        first_kv, num_kv = tp.kv_heads(spec.num_kv_heads, spec.num_heads)
        kv_rows = num_kv * hd
        inner = (intermediate_size or spec.intermediate_size) // tp.size
        # Column-parallel: rows of the checkpoint tensor, into a slice of the fused param.
        column = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, tp.rank * q_rows, q_rows),
            "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, first_kv * hd, kv_rows),
            "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, first_kv * hd, kv_rows),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, tp.rank * inner, inner),
            "mlp.up_proj": ("mlp.gate_up_proj", inner, tp.rank * inner, inner),
        }.get(module)
        if column is not None:
            fused_module, offset, start, rows = column
            return WeightTarget(
                f"{layer}{fused_module}.{leaf}", row_offset=offset,
                shard=tp.shard(0, start, rows),
            )
        # Row-parallel: columns of the weight; the bias is added once (rank 0).
        width = {"self_attn.o_proj": q_rows, "mlp.down_proj": inner}.get(module)
        if width is None or not tp.is_parallel:
            return None
        name = f"{layer}{module}.{leaf}"
        if leaf == "bias":
            return WeightTarget(name, zero=tp.rank != 0)
        return WeightTarget(name, shard=(1, tp.rank * width, width))


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral 7B (Jiang et al., 2023): Llama with sliding-window attention in every layer
    when the config sets ``sliding_window`` (v0.1 does; later versions set it to null)."""

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        window = config_value(hf_config, "sliding_window")
        return _base_spec(hf_config, layer_windows=(window,) * hf_config.num_hidden_layers)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 (Qwen team, 2024): biases on q/k/v (but not o), optional windows."""

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        return _base_spec(
            hf_config,
            qkv_bias=True,
            o_bias=False,
            layer_windows=_qwen_layer_windows(hf_config),
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (Qwen team, 2025): per-head RMSNorm on q and k before rotary, explicit
    ``head_dim`` (often not hidden / heads), no q/k/v bias by default."""

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        return _base_spec(hf_config, qk_norm=True, layer_windows=_qwen_layer_windows(hf_config))


class _ScoreHead:
    """Hugging Face's ``*ForSequenceClassification`` head on a family member: the decoder,
    then a bias-free ``score`` linear from the hidden size to ``num_labels``, applied to a
    pooled hidden state (HF pools the last non-pad token; the engine's ``last`` pooler
    pools the last prompt token, the same position for an unpadded prompt). There is no LM
    head: these models run under ``runner="pooling"`` only."""

    pooling_task = "classify"

    def __init__(self, hf_config: object, tp: TensorParallel | None = None) -> None:
        super().__init__(hf_config, tp)
        self.lm_head = None
        self.num_labels = int(config_value(hf_config, "num_labels"))
        # Replicated on every rank: it reads the full hidden state, after the all-reduce.
        self.score = nn.Linear(self.spec.hidden_size, self.num_labels, bias=False)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """Label logits ``[n, num_labels]`` (float32) of pooled hidden states ``[n, hidden]``."""
        return self.score(pooled.to(self.norm.weight.dtype)).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classify(hidden)


class LlamaForSequenceClassification(_ScoreHead, LlamaForCausalLM):
    """Llama with a sequence-classification (or reward / cross-encoder) head."""


class MistralForSequenceClassification(_ScoreHead, MistralForCausalLM):
    """Mistral with a sequence-classification head."""


class Qwen2ForSequenceClassification(_ScoreHead, Qwen2ForCausalLM):
    """Qwen2 with a sequence-classification head (e.g. Qwen2.5-based rerankers)."""


class Qwen3ForSequenceClassification(_ScoreHead, Qwen3ForCausalLM):
    """Qwen3 with a sequence-classification head (e.g. Qwen3-Reranker converted to one)."""
