"""OPT (Zhang et al., "OPT: Open Pre-trained Transformer Language Models", 2022).

Quirks carried over from fairseq/metaseq, each a config switch here:

* learned positions are looked up at ``position + 2`` (fairseq reserved the first rows
  for padding);
* ``do_layer_norm_before=False`` (opt-350m) makes the blocks post-norm and drops the
  decoder's final LayerNorm;
* ``word_embed_proj_dim != hidden_size`` (opt-350m again) embeds tokens in a smaller
  space, with ``project_in``/``project_out`` around the decoder; the head then works in
  that smaller space, so ``forward`` returns ``[T, word_embed_proj_dim]``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.attention.backend import AttentionContext
from llmlab.distributed.parallel_state import TensorParallel, vocab_parallel_embed
from llmlab.models.base import KVLayout, PagedCausalLMBase
from llmlab.models.layers import config_value, get_activation
from llmlab.models.weights import WeightTarget, strip_prefixes

# fairseq's learned-position table starts after two reserved (padding) rows.
POSITION_OFFSET = 2

_FUSED_SLICES = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def _layer_norm(hf_config: object, dim: int) -> nn.LayerNorm:
    affine = config_value(hf_config, "layer_norm_elementwise_affine", default=True)
    return nn.LayerNorm(dim, elementwise_affine=affine)


class OPTAttention(nn.Module):
    """Under tensor parallelism: this rank's heads (``qkv_proj`` column-parallel) and
    ``out_proj`` row-parallel, summed over the ranks."""

    def __init__(self, hf_config: object, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        bias = config_value(hf_config, "enable_bias", default=True)
        self.tp = tp
        self.layer_idx = layer_idx
        self.num_heads = tp.split(hf_config.num_attention_heads, "attention heads")
        self.head_dim = hidden // hf_config.num_attention_heads
        self.scale = self.head_dim**-0.5
        local = self.num_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * local, bias=bias)
        self.out_proj = nn.Linear(local, hidden, bias=bias)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=1)
        out = attn.attend(self.layer_idx, q, k, v, scale=self.scale)
        return self.tp.all_reduce(self.out_proj(out.reshape(num_tokens, -1)))


class OPTDecoderLayer(nn.Module):
    def __init__(self, hf_config: object, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        bias = config_value(hf_config, "enable_bias", default=True)
        self.tp = tp
        self.pre_norm = config_value(hf_config, "do_layer_norm_before", default=True)
        self.self_attn = OPTAttention(hf_config, layer_idx, tp)
        self.self_attn_layer_norm = _layer_norm(hf_config, hidden)
        ffn = tp.split(hf_config.ffn_dim, "ffn_dim")
        self.fc1 = nn.Linear(hidden, ffn, bias=bias)
        self.fc2 = nn.Linear(ffn, hidden, bias=bias)
        # Named as in the checkpoint: this is the MLP's norm, not the decoder's final one.
        self.final_layer_norm = _layer_norm(hf_config, hidden)
        act_name = config_value(hf_config, "activation_function", default="relu")
        self.act = get_activation(act_name)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.self_attn(self.self_attn_layer_norm(x), attn)
            return x + self._mlp(self.final_layer_norm(x))
        x = self.self_attn_layer_norm(x + self.self_attn(x, attn))
        return self.final_layer_norm(x + self._mlp(x))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.fc2(self.act(self.fc1(x))))


class OPTForCausalLM(PagedCausalLMBase):
    """OPT-125m ... OPT-66B and checkpoints fine-tuned from them."""

    def __init__(self, hf_config: object, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel.single()
        hidden = hf_config.hidden_size
        embed_dim = config_value(hf_config, "word_embed_proj_dim", default=hidden)
        num_layers = hf_config.num_hidden_layers
        heads = hf_config.num_attention_heads
        self.vocab_size = hf_config.vocab_size
        self.max_positions = hf_config.max_position_embeddings
        self.kv_layout = KVLayout(num_layers, tp.split(heads, "attention heads"), hidden // heads)
        self.hidden_size, self.ffn_dim = hidden, hf_config.ffn_dim
        vocab_rows = self.local_vocab_size()
        self.embed_tokens = nn.Embedding(vocab_rows, embed_dim)
        self.embed_positions = nn.Embedding(
            hf_config.max_position_embeddings + POSITION_OFFSET, hidden
        )
        projected = embed_dim != hidden
        self.project_in = nn.Linear(embed_dim, hidden, bias=False) if projected else None
        self.project_out = nn.Linear(hidden, embed_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(hf_config, i, tp) for i in range(num_layers)
        )
        # Post-norm OPT (350m) has no final norm; _remove_final_layer_norm keeps checkpoints
        # fine-tuned before transformers 4.20 loading.
        has_final_norm = config_value(hf_config, "do_layer_norm_before", default=True) and not (
            config_value(hf_config, "_remove_final_layer_norm", default=False)
        )
        self.final_layer_norm = _layer_norm(hf_config, hidden) if has_final_norm else None
        tied = config_value(hf_config, "tie_word_embeddings", default=True)
        # See LlamaForCausalLM: a tied head reads embed_tokens.weight rather than sharing it.
        self.lm_head = None if tied else nn.Linear(embed_dim, vocab_rows, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        hidden = vocab_parallel_embed(self.embed_tokens, input_ids, self.tp, self.vocab_size)
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, attn)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden

    def input_embedding(self) -> nn.Embedding:
        return self.embed_tokens

    def _map_weight_name(self, name: str) -> WeightTarget | None:
        name = strip_prefixes(name, ("model.", "decoder."))
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return self.vocab_target(name)
        tp = self.tp
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        slot = _FUSED_SLICES.get(proj)
        if slot is not None and parent.endswith("self_attn"):
            rows = self.kv_layout.num_kv_heads * self.kv_layout.head_dim
            return WeightTarget(f"{parent}.qkv_proj.{leaf}", row_offset=slot * rows,
                                shard=tp.shard(0, tp.rank * rows, rows))
        if not tp.is_parallel:
            return WeightTarget(name)
        if proj == "fc1":  # column-parallel
            ffn = self.ffn_dim // tp.size
            return WeightTarget(name, shard=(0, tp.rank * ffn, ffn))
        if proj in ("out_proj", "fc2"):  # row-parallel; the bias is added once (rank 0)
            if leaf == "bias":
                return WeightTarget(name, zero=tp.rank != 0)
            width = (self.hidden_size if proj == "out_proj" else self.ffn_dim) // tp.size
            return WeightTarget(name, shard=(1, tp.rank * width, width))
        return WeightTarget(name)
