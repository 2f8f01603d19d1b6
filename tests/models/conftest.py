"""Shared fixtures for model tests: tiny checkpoints on disk and a paged-attention driver."""

from __future__ import annotations

import pathlib

import attrs
import pytest
import torch

from llmlab.attention import (
    AttentionContext,
    AttentionInputs,
    TorchPagedAttention,
    block_table_tensor,
)
from llmlab.models import KVLayout
from llmlab.testing import build_tiny_model

# (test id, architecture, config overrides). Defaults already exercise each family's
# quirks; the extra variants cover switches the defaults leave off.
TINY_VARIANTS = [
    ("llama", "LlamaForCausalLM", {}),
    (
        "llama-biases-tied",
        "LlamaForCausalLM",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": True,
            "rope": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
        },
    ),
    ("mistral", "MistralForCausalLM", {}),
    ("qwen2", "Qwen2ForCausalLM", {}),
    ("qwen3", "Qwen3ForCausalLM", {}),
    ("gpt2", "GPT2LMHeadModel", {}),
    (
        "gpt2-unscaled-untied",
        "GPT2LMHeadModel",
        {
            "scale_attn_weights": False,
            "scale_attn_by_inverse_layer_idx": False,
            "tie_word_embeddings": False,
            "activation_function": "relu",
        },
    ),
    ("opt", "OPTForCausalLM", {}),
    ("mixtral", "MixtralForCausalLM", {}),
    ("qwen3-moe", "Qwen3MoeForCausalLM", {}),
    ("olmoe", "OlmoeForCausalLM", {}),
    (
        "qwen3-moe-normalized-every-other",
        "Qwen3MoeForCausalLM",
        {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 2,
         "num_experts_per_tok": 3},
    ),
    (
        "opt-prenorm-nobias",
        "OPTForCausalLM",
        {"word_embed_proj_dim": 64, "do_layer_norm_before": True, "enable_bias": False},
    ),
]
VARIANT_NAMES = [name for name, _, _ in TINY_VARIANTS]


def pytest_generate_tests(metafunc):
    # A test that takes ``tiny_variant`` runs once per variant, without importing
    # anything from this file.
    if "tiny_variant" in metafunc.fixturenames:
        metafunc.parametrize("tiny_variant", VARIANT_NAMES)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {
        name: build_tiny_model(root / name, arch, seed=7, **overrides)
        for name, arch, overrides in TINY_VARIANTS
    }


@attrs.define
class PagedRunner:
    """Drives a model step by step the way an engine would: KV blocks per sequence,
    a flat batch, and deliberately non-contiguous (descending) block ids."""

    model: torch.nn.Module
    block_size: int = 4
    num_blocks: int = 64
    backend: TorchPagedAttention = attrs.field(factory=TorchPagedAttention)
    kv_caches: list[torch.Tensor] = attrs.field(init=False)
    block_tables: dict[int, list[int]] = attrs.field(init=False, factory=dict)
    seq_lens: dict[int, int] = attrs.field(init=False, factory=dict)
    free_blocks: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        layout: KVLayout = self.model.kv_layout
        # The backend owns the per-layer memory layout; a model only sees flat slots.
        shape = self.backend.kv_cache_shape(
            self.num_blocks, self.block_size, layout.num_kv_heads, layout.head_dim
        )
        dtype = next(self.model.parameters()).dtype
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(layout.num_layers)]
        # Pop from the front of an ascending list -> highest ids first, reversed order.
        self.free_blocks = list(range(self.num_blocks))

    def _slot(self, seq_id: int, pos: int) -> int:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size <= pos:
            table.append(self.free_blocks.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed ``chunks[seq_id]`` (new token ids) for each sequence; return each
        sequence's logits for its new tokens, ``[len(chunk), vocab]``."""
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq_id, tokens in chunks.items():
            start = self.seq_lens.get(seq_id, 0)
            for offset, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + offset)
                slots.append(self._slot(seq_id, start + offset))
            self.seq_lens[seq_id] = start + len(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(self.seq_lens[seq_id])
            tables.append(list(self.block_tables[seq_id]))
        inputs = AttentionInputs(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_table_tensor(tables),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=self.block_size,
            device=torch.device("cpu"),
        )
        metadata = self.backend.build_metadata(inputs)
        attn = AttentionContext(self.backend, metadata, self.kv_caches)
        with torch.no_grad():
            input_ids = torch.tensor(ids, dtype=torch.long)
            hidden = self.model(input_ids, torch.tensor(positions, dtype=torch.long), attn)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for seq_id, n in zip(chunks, query_lens):
            out[seq_id] = logits[start : start + n]
            start += n
        return out


@pytest.fixture(scope="session")
def load_pair(tiny_model_dirs):
    """``load_pair(variant)`` -> (our model, HF reference model), both float32, cached."""
    import transformers

    from llmlab.models import load_model

    cache = {}

    def load(variant: str):
        if variant not in cache:
            path = tiny_model_dirs[variant]
            config = transformers.AutoConfig.from_pretrained(path)
            ours = load_model(path, config, torch.float32, "cpu")
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
            cache[variant] = (ours, reference)
        return cache[variant]

    return load


def _hf_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].float()


def _random_tokens(count: int, vocab_size: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (count,), generator=generator).tolist()


# Helpers are handed out as fixtures rather than imported, so this directory needs no
# package __init__ and no sys.path assumptions.
@pytest.fixture(scope="session")
def hf_logits():
    """``hf_logits(reference, token_ids)``: HF logits for every position, from scratch."""
    return _hf_logits


@pytest.fixture(scope="session")
def random_tokens():
    """``random_tokens(count, vocab_size, seed)``: reproducible ids, avoiding <s> and </s>."""
    return _random_tokens


@pytest.fixture(scope="session")
def paged_runner():
    """``paged_runner(model)``: a fresh :class:`PagedRunner` with empty caches."""
    return PagedRunner
