"""The interface every model implements, and the shape of the KV cache it needs.

A model sees one step's batch as a flat run of ``T`` tokens from many sequences (no batch
dimension, no padding); all cross-token mixing happens inside ``attn.attend``, which owns
the paged KV cache. So a model is just per-token math plus one ``attend`` call per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from llmlab.attention.backend import AttentionContext
from llmlab.distributed.parallel_state import TensorParallel
from llmlab.models.weights import WeightTarget, load_mapped_weights


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen
class KVLayout:
    """What the model's attention layers store per token: ``num_layers`` KV tensors, each
    holding ``num_kv_heads`` heads of ``head_dim`` (the attention backend's
    ``kv_cache_shape`` decides how those are laid out in memory)."""

    num_layers: int = attrs.field(validator=_positive_int)
    num_kv_heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """KV bytes one token occupies across all layers (keys and values)."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over a flat, paged batch.

    Implementations are built as ``cls(hf_config)`` from a ``transformers`` config object
    (any version: old and new attribute spellings are both accepted). A model that supports
    tensor parallelism also takes ``cls(hf_config, tp=TensorParallel(...))`` and says so with
    a class attribute ``supports_tensor_parallel = True``: it then sizes its parameters
    (and ``kv_layout``) for its rank, maps checkpoint tensors to its slices, and returns
    full-vocabulary logits from ``compute_logits`` on every rank.

    Attributes:
        kv_layout: the per-layer KV shape the model's attention layers expect.
        vocab_size: rows of the logits ``compute_logits`` returns.
    """

    kv_layout: KVLayout
    vocab_size: int

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        """``input_ids`` and ``positions`` are ``[T]`` longs (positions are absolute and
        0-based per sequence); returns final hidden states ``[T, hidden]``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` hidden states (usually one per sequence) to float32
        ``[N, vocab_size]`` logits."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a Hugging Face checkpoint's ``(name, tensor)`` pairs into the model.

        Raises ``ValueError`` on a name the model does not know, a shape mismatch, or a
        parameter that no weight filled.
        """
        ...


class PagedCausalLMBase(nn.Module):
    """What every built-in model shares: the (possibly tied) LM head and weight loading.

    Subclasses set ``self.lm_head`` (``None`` when tied to the input embedding), implement
    ``input_embedding()`` and ``_map_weight_name(name) -> WeightTarget | None``, and keep
    their :class:`~llmlab.distributed.parallel_state.TensorParallel` in ``self.tp`` (the
    embedding and head then hold this rank's rows of the vocabulary).
    """

    lm_head: nn.Linear | None
    supports_tensor_parallel = True
    tp: TensorParallel = TensorParallel()

    def input_embedding(self) -> nn.Embedding:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The LM head in oneDNN's layout, when ``cpu_linear.prepack_linears`` made one.
        packed = self._modules.get("packed_head")
        if packed is not None:
            logits = packed(hidden).float()
        else:
            head = self.input_embedding().weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, head).float()
        # Under tensor parallelism each rank computed its rows of the vocabulary.
        return self.tp.gather_vocab(logits, self.vocab_size)

    def local_vocab_size(self) -> int:
        """Rows of the vocabulary this rank's embedding and head hold."""
        start, end = self.tp.vocab_range(self.vocab_size)
        return end - start

    def vocab_target(self, param: str) -> WeightTarget:
        """Where the embedding's or head's checkpoint rows go: this rank's rows only."""
        if not self.tp.is_parallel:
            return WeightTarget(param)
        start, end = self.tp.vocab_range(self.vocab_size)
        return WeightTarget(param, shard=(0, start, end - start))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_mapped_weights(self, weights, self._map_weight_name)

    def _map_weight_name(self, name: str) -> WeightTarget | None:
        raise NotImplementedError
