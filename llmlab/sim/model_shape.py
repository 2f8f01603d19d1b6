"""``ModelShape``: a decoder-only transformer's dimensions (from its Hugging Face config)
and the arithmetic on them: parameters, FLOPs per token, KV bytes per token, and for a
mixture-of-experts model the experts a step reads. The roofline cost model
(:mod:`llmlab.sim.roofline`) prices steps with it; the rate measurements
(:mod:`llmlab.sim.measure`) time its linear layers."""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from llmlab.validation import as_bool, as_int


def _positive_int(field: str):
    return functools.partial(as_int, field, min=1)


def _nonnegative_int(field: str):
    return functools.partial(as_int, field, min=0)


# model_type -> the family whose config names (and MLP) it uses: the Llama family's gated
# MLP and grouped KV heads under Llama's names; GPT-2's and OPT's plain MLP under their own.
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "gpt2": "gpt2",
    "opt": "opt",
    # Mixture of experts: the Llama family's attention, gated experts in the sparse layers.
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
    "olmoe": "olmoe",
}
# OPT's learned position table has two reserved (padding) rows before position 0.
_OPT_POSITION_OFFSET = 2
_MISSING = object()


def _config_get(config: Any, key: str, default: Any = _MISSING) -> Any:
    """``config[key]`` for a mapping, ``config.key`` otherwise; a missing key without a
    default is a ValueError naming it."""
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    if value is _MISSING:
        raise ValueError(f"model config has no {key!r}, which ModelShape needs")
    return value


def _moe_fields(family: str, get: Any) -> dict[str, Any]:
    """A mixture-of-experts config's expert fields, read as llmlab's models read them
    (:mod:`llmlab.models.moe`): Mixtral's ``num_local_experts`` and OLMoE's
    ``num_experts``, every layer sparse, experts of ``intermediate_size``; Qwen3-MoE's
    experts of ``moe_intermediate_size`` in every ``decoder_sparse_step``-th layer but
    ``mlp_only_layers`` (those keep a dense MLP of ``intermediate_size``)."""
    num_layers = get("num_hidden_layers")
    # transformers 5 spells every family's count num_local_experts (older Qwen3-MoE and
    # OLMoE configs, num_experts; the config classes map one onto the other).
    num_experts = get("num_local_experts", None)
    if num_experts is None:
        num_experts = get("num_experts", None)
    if num_experts is None:
        raise ValueError("model config has no 'num_local_experts' (or 'num_experts'), which "
                         "ModelShape needs for a mixture of experts")
    if family == "qwen3_moe":
        step = get("decoder_sparse_step", 1) or 1
        dense = set(get("mlp_only_layers", None) or ())
        sparse = sum(1 for i in range(num_layers)
                     if i not in dense and num_experts > 0 and (i + 1) % step == 0)
        expert_width = get("moe_intermediate_size")
    else:
        sparse, expert_width = num_layers, get("intermediate_size")
    return dict(num_experts=num_experts if sparse else 0,
                num_experts_per_tok=get("num_experts_per_tok") if sparse else 0,
                expert_intermediate_size=expert_width, num_sparse_layers=sparse)


def _config_family(config: Any) -> str:
    model_type = _config_get(config, "model_type", None) or ""
    if model_type:
        family = _MODEL_TYPES.get(model_type)
        if family is None:
            known = ", ".join(sorted(_MODEL_TYPES))
            raise ValueError(
                f"ModelShape does not know model_type {model_type!r}; known: {known} (or build "
                "a ModelShape from its dimensions directly)"
            )
        return family
    # A plain dict without model_type: tell the families apart by their key names.
    if _config_get(config, "n_embd", None) is not None:
        return "gpt2"
    if _config_get(config, "ffn_dim", None) is not None:
        return "opt"
    return "llama"


@attrs.frozen
class ModelShape:
    """The dimensions of a decoder-only transformer that decide its FLOPs and bytes.

    Covers the architectures llmlab runs: Llama, Mistral, Qwen2 and Qwen3 (gated SiLU MLP:
    gate, up and down projections), GPT-2 and OPT (plain two-matmul MLP, full multi-head
    attention), and the mixtures of experts Mixtral, Qwen3-MoE and OLMoE (the Llama
    family's attention; in each sparse layer a router and ``num_experts`` gated MLPs, of
    which each token runs ``num_experts_per_tok``).

    Attributes:
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
            vocab_size: as in the Hugging Face configs (GPT-2's ``n_embd``, ``n_layer``,
            ``n_head``, ``n_inner``; OPT's ``ffn_dim``).
        gated_mlp: the MLP has gate, up and down projections (False: up and down only).
        tie_word_embeddings: the LM head is the input embedding matrix (stored, and read,
            once).
        word_embed_dim: width of the token embeddings and the LM head; OPT-350m's is
            narrower than its layers, with projections in and out (default: hidden_size).
        num_position_embeddings: rows of a learned position table (GPT-2, OPT); 0 for
            rotary models.
        num_experts: experts per sparse layer (0: a dense model).
        num_experts_per_tok: experts each token runs (``top_k``; 0 for a dense model).
        expert_intermediate_size: each expert's inner width (default: intermediate_size;
            Qwen3-MoE's ``moe_intermediate_size``).
        num_sparse_layers: layers whose MLP is the experts (default: every layer of a
            mixture of experts); the others keep a dense MLP of ``intermediate_size``.
    """

    hidden_size: int = attrs.field(converter=_positive_int("hidden_size"))
    num_layers: int = attrs.field(converter=_positive_int("num_layers"))
    num_heads: int = attrs.field(converter=_positive_int("num_heads"))
    num_kv_heads: int = attrs.field(converter=_positive_int("num_kv_heads"))
    head_dim: int = attrs.field(converter=_positive_int("head_dim"))
    intermediate_size: int = attrs.field(converter=_positive_int("intermediate_size"))
    vocab_size: int = attrs.field(converter=_positive_int("vocab_size"))
    gated_mlp: bool = attrs.field(default=True, converter=functools.partial(as_bool, "gated_mlp"))
    tie_word_embeddings: bool = attrs.field(
        default=False, converter=functools.partial(as_bool, "tie_word_embeddings")
    )
    word_embed_dim: int = attrs.field(
        default=attrs.Factory(lambda self: self.hidden_size, takes_self=True),
        converter=_positive_int("word_embed_dim"),
    )
    num_position_embeddings: int = attrs.field(
        default=0, converter=_nonnegative_int("num_position_embeddings")
    )
    num_experts: int = attrs.field(default=0, converter=_nonnegative_int("num_experts"))
    num_experts_per_tok: int = attrs.field(
        default=0, converter=_nonnegative_int("num_experts_per_tok")
    )
    expert_intermediate_size: int = attrs.field(
        default=attrs.Factory(lambda self: self.intermediate_size, takes_self=True),
        converter=_positive_int("expert_intermediate_size"),
    )
    num_sparse_layers: int = attrs.field(
        default=attrs.Factory(lambda self: self.num_layers if self.num_experts else 0,
                              takes_self=True),
        converter=_nonnegative_int("num_sparse_layers"),
    )

    def __attrs_post_init__(self) -> None:
        if not self.num_experts:
            if self.num_experts_per_tok or self.num_sparse_layers:
                raise ValueError(
                    f"num_experts_per_tok={self.num_experts_per_tok} and num_sparse_layers="
                    f"{self.num_sparse_layers} need experts: num_experts is 0 (a dense model)"
                )
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        if not 1 <= self.num_sparse_layers <= self.num_layers:
            raise ValueError(
                f"num_sparse_layers={self.num_sparse_layers} must be between 1 and "
                f"num_layers ({self.num_layers}) for a model with experts"
            )
        if not self.gated_mlp:
            raise ValueError("experts are gated MLPs: a model with experts needs gated_mlp=True")

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """From a ``transformers.PretrainedConfig``, a plain dict of the same keys, or any
        object with them as attributes. The family comes from ``model_type`` (or, in a dict
        without one, from the key names); a missing key that has a default in transformers
        takes that default."""
        family = _config_family(config)
        get = functools.partial(_config_get, config)
        if family == "gpt2":
            hidden, heads = get("n_embd"), get("n_head")
            return cls(
                hidden_size=hidden,
                num_layers=get("n_layer"),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=get("n_inner", None) or 4 * hidden,
                vocab_size=get("vocab_size"),
                gated_mlp=False,
                tie_word_embeddings=bool(get("tie_word_embeddings", True)),
                num_position_embeddings=get("n_positions", 1024),
            )
        hidden, heads = get("hidden_size"), get("num_attention_heads")
        if family == "opt":
            return cls(
                hidden_size=hidden,
                num_layers=get("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=get("ffn_dim"),
                vocab_size=get("vocab_size"),
                gated_mlp=False,
                tie_word_embeddings=bool(get("tie_word_embeddings", True)),
                word_embed_dim=get("word_embed_proj_dim", None) or hidden,
                num_position_embeddings=get("max_position_embeddings", 2048)
                + _OPT_POSITION_OFFSET,
            )
        return cls(
            hidden_size=hidden,
            num_layers=get("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", None) or heads,
            head_dim=get("head_dim", None) or hidden // heads,
            intermediate_size=get("intermediate_size"),
            vocab_size=get("vocab_size"),
            gated_mlp=True,
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            **(_moe_fields(family, get) if family != "llama" else {}),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ModelShape:
        """From a model directory's ``config.json`` (no weights are read). Through
        ``transformers.AutoConfig``, because a saved config leaves out the keys that equal
        its class's defaults."""
        from transformers import AutoConfig

        return cls.from_hf_config(AutoConfig.from_pretrained(os.fspath(path)))

    # -- weights

    @property
    def is_moe(self) -> bool:
        """Whether the model has experts."""
        return self.num_experts > 0

    def _attention_parameters(self) -> int:
        h, q = self.hidden_size, self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h  # q, k, v, o

    def _layer_parameters(self) -> int:
        """A dense layer's: attention and the MLP."""
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size
        return self._attention_parameters() + mlp

    def expert_parameters(self) -> int:
        """One expert's weights (gate, up and down); 0 for a dense model."""
        return 3 * self.hidden_size * self.expert_intermediate_size if self.is_moe else 0

    def _sparse_layer_parameters(self, experts: float) -> float:
        """A sparse layer's weights with ``experts`` of its experts: attention, the router
        (one logit per expert), the experts."""
        router = self.hidden_size * self.num_experts
        return self._attention_parameters() + router + experts * self.expert_parameters()

    def _layers_parameters(self, experts: float) -> float:
        dense = self.num_layers - self.num_sparse_layers
        return (dense * self._layer_parameters()
                + self.num_sparse_layers * self._sparse_layer_parameters(experts))

    def _embed_projection_parameters(self) -> int:
        """OPT-350m's project_in and project_out (word_embed_dim <-> hidden_size)."""
        if self.word_embed_dim == self.hidden_size:
            return 0
        return 2 * self.hidden_size * self.word_embed_dim

    def num_parameters(self) -> int:
        """Weight matrices: embeddings (tokens, learned positions), every layer's projections,
        and the LM head, a tied one counted once. The 1-D parameters (norm scales, biases)
        are left out: under 0.1% of a real model."""
        embedding = self.vocab_size * self.word_embed_dim
        positions = self.num_position_embeddings * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.word_embed_dim
        return (
            embedding
            + positions
            + self._embed_projection_parameters()
            + int(self._layers_parameters(self.num_experts))
            + head
        )

    def num_parameters_read(self) -> int:
        """Weights one forward pass reads in full: :meth:`num_parameters` less the tables it
        only looks rows up in (an untied input embedding, learned positions). A tied table
        stays: the LM head reads all of it. Same rule as the throughput benchmark's
        ``weight_elements_read``."""
        untied_embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.word_embed_dim
        positions = self.num_position_embeddings * self.hidden_size
        return self.num_parameters() - untied_embedding - positions

    def num_active_parameters(self) -> int:
        """What one token runs through: :meth:`num_parameters_read` with only
        ``num_experts_per_tok`` experts per sparse layer (the whole of it for a dense
        model)."""
        idle = self.num_experts - self.num_experts_per_tok
        return self.num_parameters_read() - self.num_sparse_layers * idle * self.expert_parameters()

    def expected_experts_read(self, num_tokens: int,
                              shares: Sequence[Sequence[float]] | None = None) -> float:
        """The experts a step of ``num_tokens`` tokens runs, summed over the sparse layers
        (an expert runs, and its weights are read, when at least one token picks it).
        ``shares``: per sparse layer, the chance that a token picks each expert (a row
        sums to ``num_experts_per_tok``; a recorded load's, see
        :class:`~llmlab.sim.experts.ExpertRouting`); None: uniform routing, each token
        picking ``num_experts_per_tok`` distinct experts at random. Tokens pick
        independently, so an expert of share ``q`` is idle with chance ``(1 - q) ** T``.
        One token reads ``num_experts_per_tok`` experts a layer; many read them all."""
        if not self.is_moe or num_tokens <= 0:
            return 0.0
        if shares is None:
            idle = (1.0 - self.num_experts_per_tok / self.num_experts) ** num_tokens
            return self.num_sparse_layers * self.num_experts * (1.0 - idle)
        if len(shares) != self.num_sparse_layers or any(
                len(row) != self.num_experts for row in shares):
            raise ValueError(
                f"expert shares must be {self.num_sparse_layers} rows (sparse layers) of "
                f"{self.num_experts} (experts), got {len(shares)} rows of "
                f"{sorted({len(row) for row in shares})}"
            )
        return sum(1.0 - (1.0 - min(q, 1.0)) ** num_tokens for row in shares for q in row)

    def parameters_read(self, num_tokens: int,
                        shares: Sequence[Sequence[float]] | None = None) -> float:
        """The weights a step of ``num_tokens`` tokens reads: :meth:`num_parameters_read`
        for a dense model; for one with experts, everything but the experts plus the
        experts that run (:meth:`expected_experts_read`)."""
        if not self.is_moe:
            return self.num_parameters_read()
        all_experts = self.num_sparse_layers * self.num_experts * self.expert_parameters()
        read = self.expected_experts_read(num_tokens, shares) * self.expert_parameters()
        return self.num_parameters_read() - all_experts + read

    # -- FLOPs and bytes

    def layer_linear_flops_per_token(self) -> int:
        """One dense layer's projections: q, k, v, o plus the MLP (gate, up, down, or up,
        down); 2 FLOPs per weight."""
        return 2 * self._layer_parameters()

    def linear_flops_per_token(self) -> int:
        """Every layer's projections, plus OPT-350m's embedding projections in and out; in a
        sparse layer, the router and ``num_experts_per_tok`` experts (its active
        parameters: a dense model of as many prices the same)."""
        return int(
            2 * self._layers_parameters(self.num_experts_per_tok)
            + 2 * self._embed_projection_parameters()
        )

    def expert_flops_per_token(self) -> int:
        """The part of :meth:`linear_flops_per_token` spent in experts (0 for a dense
        model): the part a load imbalance stretches."""
        return 2 * self.num_sparse_layers * self.num_experts_per_tok * self.expert_parameters()

    def lm_head_flops_per_token(self) -> int:
        """One row through the LM head (a sampled position)."""
        return 2 * self.word_embed_dim * self.vocab_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def attention_flops_per_layer(self, context_len: int) -> int:
        """Scores (q @ k^T) and weighted values (p @ v) for one query token over its context."""
        return 2 * 2 * context_len * self.head_dim * self.num_heads

    def attention_flops_per_position(self) -> int:
        """One (query token, attended position) pair in every layer."""
        return self.num_layers * self.attention_flops_per_layer(1)
