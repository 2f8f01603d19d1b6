"""GPT-2 (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).

Pre-norm LayerNorm blocks, learned absolute positions, a plain GELU MLP and a head tied to
the token embedding. Hugging Face stores its projections as ``Conv1D`` with ``[in, out]``
weights; we transpose them once at load time so the hot path is ordinary ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.attention.backend import AttentionContext
from llmlab.distributed.parallel_state import TensorParallel, vocab_parallel_embed
from llmlab.models.base import KVLayout, PagedCausalLMBase
from llmlab.models.layers import config_value, get_activation
from llmlab.models.weights import WeightTarget, strip_prefixes

# Conv1D modules, whose checkpoint weights are [in, out].
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class GPT2Attention(nn.Module):
    """Under tensor parallelism: this rank's heads of ``c_attn`` (column-parallel) and
    ``c_proj`` row-parallel, summed over the ranks."""

    def __init__(self, hf_config: object, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        hidden = hf_config.n_embd
        self.tp = tp
        self.layer_idx = layer_idx
        self.num_heads = tp.split(hf_config.n_head, "attention heads")
        self.head_dim = hidden // hf_config.n_head
        # Some checkpoints skip 1/sqrt(d); Stanford CRFM's "Mistral" GPT-2 runs (unrelated
        # to Mistral AI) also divide by the 1-based layer index for fp16 stability.
        scaled = config_value(hf_config, "scale_attn_weights", default=True)
        scale = self.head_dim**-0.5 if scaled else 1.0
        if config_value(hf_config, "scale_attn_by_inverse_layer_idx", default=False):
            scale /= float(layer_idx + 1)
        self.scale = scale
        local = self.num_heads * self.head_dim
        self.c_attn = nn.Linear(hidden, 3 * local)
        self.c_proj = nn.Linear(local, hidden)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.c_attn(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(dim=1)
        out = attn.attend(self.layer_idx, q, k, v, scale=self.scale)
        return self.tp.all_reduce(self.c_proj(out.reshape(num_tokens, -1)))


def _inner_size(hf_config: object) -> int:
    return config_value(hf_config, "n_inner", default=None) or 4 * hf_config.n_embd


class GPT2MLP(nn.Module):
    def __init__(self, hf_config: object, tp: TensorParallel) -> None:
        super().__init__()
        hidden = hf_config.n_embd
        self.tp = tp
        inner = tp.split(_inner_size(hf_config), "MLP inner size (n_inner)")
        self.c_fc = nn.Linear(hidden, inner)
        self.c_proj = nn.Linear(inner, hidden)
        act_name = config_value(hf_config, "activation_function", default="gelu_new")
        self.act = get_activation(act_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.c_proj(self.act(self.c_fc(x))))


class GPT2Block(nn.Module):
    def __init__(self, hf_config: object, layer_idx: int, tp: TensorParallel) -> None:
        super().__init__()
        eps = config_value(hf_config, "layer_norm_epsilon", default=1e-5)
        self.ln_1 = nn.LayerNorm(hf_config.n_embd, eps=eps)
        self.attn = GPT2Attention(hf_config, layer_idx, tp)
        self.ln_2 = nn.LayerNorm(hf_config.n_embd, eps=eps)
        self.mlp = GPT2MLP(hf_config, tp)

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(PagedCausalLMBase):
    """GPT-2 and its many re-trainings (DistilGPT2, tiny test checkpoints, ...)."""

    def __init__(self, hf_config: object, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TensorParallel.single()
        self.hf_config = hf_config
        if config_value(hf_config, "add_cross_attention", default=False):
            raise ValueError(
                "GPT2LMHeadModel with add_cross_attention=True is an encoder-decoder "
                "component; only decoder-only GPT-2 is supported"
            )
        hidden = hf_config.n_embd
        self.vocab_size = hf_config.vocab_size
        self.max_positions = hf_config.n_positions
        heads = tp.split(hf_config.n_head, "attention heads")
        self.kv_layout = KVLayout(hf_config.n_layer, heads, hidden // hf_config.n_head)
        vocab_rows = self.local_vocab_size()
        self.wte = nn.Embedding(vocab_rows, hidden)
        self.wpe = nn.Embedding(hf_config.n_positions, hidden)
        self.h = nn.ModuleList(GPT2Block(hf_config, i, tp) for i in range(hf_config.n_layer))
        eps = config_value(hf_config, "layer_norm_epsilon", default=1e-5)
        self.ln_f = nn.LayerNorm(hidden, eps=eps)
        tied = config_value(hf_config, "tie_word_embeddings", default=True)
        # See LlamaForCausalLM: a tied head reads wte.weight rather than sharing it.
        self.lm_head = None if tied else nn.Linear(hidden, vocab_rows, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        hidden = vocab_parallel_embed(self.wte, input_ids, self.tp, self.vocab_size)
        hidden = hidden + self.wpe(positions)
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
        if name in ("wte.weight", "lm_head.weight"):
            return self.vocab_target(name)
        module, _, leaf = name.rpartition(".")
        transpose = leaf == "weight" and module.endswith(_CONV1D)
        tp = self.tp
        if not tp.is_parallel or not module.endswith(_CONV1D):
            return WeightTarget(name, transpose=transpose)
        # Conv1D weights are [in, out]: the output dim is 1 (0 for a bias).
        out_dim = 1 if leaf == "weight" else 0
        if module.endswith("attn.c_attn"):
            # q, k and v side by side: this rank's heads of each.
            hidden = self.hf_config.n_embd
            local = hidden // tp.size
            return [
                WeightTarget(name, row_offset=part * local, transpose=transpose,
                             shard=(out_dim, part * hidden + tp.rank * local, local))
                for part in range(3)
            ]
        if module.endswith("mlp.c_fc"):
            inner = _inner_size(self.hf_config) // tp.size
            return WeightTarget(name, transpose=transpose,
                                shard=(out_dim, tp.rank * inner, inner))
        # attn.c_proj / mlp.c_proj: row-parallel (input rows of [in, out]; bias on rank 0).
        if leaf == "bias":
            return WeightTarget(name, zero=tp.rank != 0)
        width = (self.hf_config.n_embd if module.endswith("attn.c_proj")
                 else _inner_size(self.hf_config)) // tp.size
        return WeightTarget(name, transpose=True, shard=(0, tp.rank * width, width))
