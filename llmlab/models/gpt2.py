"""GPT-2 (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).

Pre-norm LayerNorm blocks, learned absolute positions, a plain GELU MLP and a head tied to
the token embedding. Hugging Face stores its projections as ``Conv1D`` with ``[in, out]``
weights; we transpose them once at load time so the hot path is ordinary ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.attention.backend import AttentionContext
from llmlab.models.base import KVLayout, PagedCausalLMBase
from llmlab.models.layers import config_value, get_activation
from llmlab.models.weights import WeightTarget, strip_prefixes

# Conv1D modules, whose checkpoint weights are [in, out].
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2Attention(nn.Module):
    def __init__(self, hf_config: object, layer_idx: int) -> None:
        super().__init__()
        hidden = hf_config.n_embd
        self.layer_idx = layer_idx
        self.num_heads = hf_config.n_head
        self.head_dim = hidden // self.num_heads
        # Some checkpoints skip 1/sqrt(d); Stanford CRFM's "Mistral" GPT-2 runs (unrelated
        # to Mistral AI) also divide by the 1-based layer index for fp16 stability.
        scaled = config_value(hf_config, "scale_attn_weights", default=True)
        scale = self.head_dim**-0.5 if scaled else 1.0
        if config_value(hf_config, "scale_attn_by_inverse_layer_idx", default=False):
            scale /= float(layer_idx + 1)
        self.scale = scale
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.c_attn(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=1)
        out = attn.attend(self.layer_idx, q, k, v, scale=self.scale)
        return self.c_proj(out.reshape(num_tokens, -1))


class GPT2MLP(nn.Module):
    def __init__(self, hf_config: object) -> None:
        super().__init__()
        hidden = hf_config.n_embd
        inner = config_value(hf_config, "n_inner", default=4 * hidden)
        self.c_fc = nn.Linear(hidden, inner)
        self.c_proj = nn.Linear(inner, hidden)
        act_name = config_value(hf_config, "activation_function", default="gelu_new")
        self.act = get_activation(act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, hf_config: object, layer_idx: int) -> None:
        super().__init__()
        eps = config_value(hf_config, "layer_norm_epsilon", default=1e-5)
        self.ln_1 = nn.LayerNorm(hf_config.n_embd, eps=eps)
        self.attn = GPT2Attention(hf_config, layer_idx)
        self.ln_2 = nn.LayerNorm(hf_config.n_embd, eps=eps)
        self.mlp = GPT2MLP(hf_config)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(PagedCausalLMBase):
    """GPT-2 and its many re-trainings (DistilGPT2, tiny test checkpoints, ...)."""

    def __init__(self, hf_config: object) -> None:
        super().__init__()
        if config_value(hf_config, "add_cross_attention", default=False):
            raise ValueError(
                "GPT2LMHeadModel with add_cross_attention=True is an encoder-decoder "
                "component; only decoder-only GPT-2 is supported"
            )
        hidden = hf_config.n_embd
        self.vocab_size = hf_config.vocab_size
        self.max_positions = hf_config.n_positions
        self.kv_layout = KVLayout(hf_config.n_layer, hf_config.n_head, hidden // hf_config.n_head)
        self.wte = nn.Embedding(hf_config.vocab_size, hidden)
        self.wpe = nn.Embedding(hf_config.n_positions, hidden)
        self.h = nn.ModuleList(GPT2Block(hf_config, i) for i in range(hf_config.n_layer))
        eps = config_value(hf_config, "layer_norm_epsilon", default=1e-5)
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        tied = config_value(hf_config, "tie_word_embeddings", default=True)
        # See LlamaForCausalLM: a tied head reads wte.weight rather than sharing it.
        self.lm_head = None if tied else nn.Linear(hidden, hf_config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden, attn)
        return self.ln_f(hidden)

    def input_embedding(self) -> nn.Embedding:
        return self.wte

    def _map_weight_name(self, name: str) -> WeightTarget | None:
        name = strip_prefixes(name, ("transformer.",))
        # attn.bias / attn.masked_bias are the causal-mask buffers old checkpoints saved.
        if name.endswith((".attn.bias", ".attn.masked_bias")):
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None
        module, _, leaf = name.rpartition(".")
        transpose = leaf == "weight" and module.endswith(_CONV1D)
        return WeightTarget(name, transpose=transpose)
