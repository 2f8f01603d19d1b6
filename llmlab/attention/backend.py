"""The attention-backend interface and the backend-agnostic description of a batch.

The model runner describes each step's batch once, as :class:`AttentionInputs` (which
sequences, how many new tokens each, where their KV lives). A backend turns that into its
own metadata once per step (``build_metadata``) and then serves every layer's
``forward`` from it, so per-layer work is only the attention itself.

Models never see a backend directly: they receive an :class:`AttentionContext` and call
``attn.attend(layer_idx, q, k, v)``. The context carries the backend, the step's metadata
and the per-layer KV tensors, so there is no module-global state.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import torch


def token_slots(
    block_tables: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Flat KV slot (``block_id * block_size + offset``) of each position: the one place
    the paged address formula lives.

    ``block_tables`` is ``[num_seqs, max_blocks]``; ``seq_index`` and ``positions`` are
    equal-shaped (or broadcastable) integer tensors naming a sequence and a (non-negative)
    position in it. numpy arrays work too (the model runner's host-side arithmetic).
    """
    blocks = block_tables[seq_index, positions // block_size]
    return blocks * block_size + positions % block_size


def block_table_tensor(tables, width: int | None = None) -> torch.Tensor:
    """Block tables (sequences of ids) as a zero-padded ``[num_seqs, width]`` long tensor
    on the CPU (``width`` defaults to the longest table; longer tables are cut)."""
    width = max((len(t) for t in tables), default=0) if width is None else width
    array = np.zeros((len(tables), max(width, 1)), dtype=np.int64)
    for row, table in enumerate(tables):
        n = min(len(table), width)
        array[row, :n] = table[:n]
    return torch.from_numpy(array)


@attrs.frozen
class AttentionInputs:
    """One step's batch, as every backend needs to know it.

    Sequences appear in batch order; the new tokens of sequence ``i`` are the flat tokens
    ``query_start_loc[i]:query_start_loc[i + 1]``.

    Attributes:
        query_lens: new tokens per sequence this step (1 for a decode).
        seq_lens: context length per sequence *after* this step (cached + new tokens).
        block_tables: ``[num_seqs, max_blocks]`` long CPU tensor of each sequence's KV
            block ids in position order, zero-padded (see :func:`block_table_tensor`).
        slot_mapping: ``[num_tokens]`` long tensor; flat KV slot that each new token's K/V
            is written to (see :func:`token_slots`).
        block_size: tokens per KV block.
        device: where the step's tensors live.
        rows: the scheduler row of each sequence (stable while the request is admitted).
        state: the backend's per-engine state from ``create_state`` (None if it keeps
            none, or in a profiling pass that must not touch it).
        layer_shift: ``[num_layers, num_seqs]`` ints, or None: how many fewer cached
            tokens layer ``l`` holds of sequence ``i`` than ``seq_lens`` says (a KV press
            with per-layer budgets). Backends never read it: the model runner builds one
            metadata per distinct layer from :meth:`shifted`.
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    device: torch.device
    rows: tuple[int, ...] = ()
    state: Any = None
    layer_shift: Any = None

    def shifted(self, shift: np.ndarray) -> AttentionInputs:
        """The same batch for a layer holding ``shift[i]`` fewer tokens of sequence ``i``:
        shorter contexts, and the new tokens written that many slots earlier. Without the
        backend's per-engine state (a per-row copy of the KV would be per layer too)."""
        query_lens = np.asarray(self.query_lens, dtype=np.int64)
        seq_lens = np.asarray(self.seq_lens, dtype=np.int64) - shift
        seq = np.repeat(np.arange(len(query_lens)), query_lens)
        first = np.cumsum(query_lens) - query_lens
        pos = seq_lens[seq] - query_lens[seq] + np.arange(len(seq)) - first[seq]
        tables = self.block_tables.numpy()
        slots = torch.from_numpy(token_slots(tables, seq, pos, self.block_size))
        return attrs.evolve(
            self, seq_lens=seq_lens.tolist(), slot_mapping=slots.to(self.slot_mapping.device),
            state=None, layer_shift=None,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention: writes new K/V into the cache and attends over each block table.

    The backend chooses the memory layout of one layer's KV tensor (``kv_cache_shape``);
    whatever the layout, flat slot ``block_id * block_size + offset`` names one token.
    ``q`` is ``[num_tokens, num_heads, head_dim]``, ``k`` and ``v`` are ``[num_tokens,
    num_kv_heads, head_dim]``; the result is shaped like ``q``. Attention is causal within
    the new tokens of a sequence, and ``num_heads`` may be a multiple of ``num_kv_heads``
    (grouped-query attention; query head ``h`` reads KV head ``h // group``, as in HF).

    Optional methods, looked up with ``getattr``:

    * ``create_state(*, num_rows, num_slots, device) -> state``: per-engine state keyed by
      scheduler row (e.g. the CPU decode mirror); the runner owns it, passes it in
      ``AttentionInputs.state``, calls ``state.release(rows)`` for rows the scheduler
      freed and ``state.reset()`` after a failed step. One backend instance may then serve
      several engines.
    * ``copy_blocks(kv_caches, copies, block_size)``: copy whole KV blocks
      ``(src, dst)`` in every layer (copy-on-write); required only when blocks are shared
      and then written (fork, truncate).
    * ``check_device(device)`` / ``check_dtype(dtype)``: raise ``ValueError`` saying why the
      backend cannot run there; the builder calls them before loading any weights.
    * ``gather_slots(kv_cache, slots, block_size) -> (keys, values)`` and
      ``scatter_slots(kv_cache, slots, keys, values, block_size)``: read / write one
      layer's tokens at flat ``slots`` (``[n]``, or ``[num_kv_heads, n]`` per head) as
      ``[num_kv_heads, n, head_dim]``; required only by KV presses (:mod:`llmlab.kvpress`).
    """

    name: str

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]: ...

    def build_metadata(self, inputs: AttentionInputs) -> Any: ...

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: Any,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...


@attrs.frozen
class AttentionContext:
    """What a model's forward pass needs for attention in one step.

    ``layer_metadata``: per layer, the metadata that layer reads, when layers hold
    different numbers of a sequence's tokens (a KV press with per-layer budgets); None:
    every layer reads ``metadata``. ``capture``: called with each layer's queries as
    ``capture(layer_idx, q, scale)`` (a KV press keeps some), or None.
    """

    backend: AttentionBackend
    metadata: Any
    kv_caches: list[torch.Tensor]
    layer_metadata: tuple[Any, ...] | None = None
    capture: Any = None

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Store this layer's new K/V and return attention output shaped like ``q``."""
        if self.capture is not None:
            self.capture(layer_idx, q, scale)
        layers = self.layer_metadata
        return self.backend.forward(
            layer_idx,
            q,
            k,
            v,
            self.kv_caches[layer_idx],
            self.metadata if layers is None else layers[layer_idx],
            scale=scale,
            sliding_window=sliding_window,
        )
