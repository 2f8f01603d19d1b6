"""The batched LoRA computation on the torch path.

A step's tokens are described once per step (:class:`~llmlab.lora.layer.LoRAStep`, built
by :func:`~llmlab.lora.slots.group_tokens`), then every wrapped linear adds
``y[t] += (x[t] A[slot]^T) B[slot]`` for each token ``t`` with an adapter slot, in two
parts that never run one forward per adapter:

* **long runs** (a prefill chunk: a request's contiguous span of at least
  :data:`LONG_RUN` tokens): one matmul pair on the run's rows, in place,
  ``y[a:b] += (x[a:b] A[slot]^T) B[slot]`` (segment-wise, as Punica's SGMV; Chen et al.,
  2023), with no gather, scatter or large temporary;
* **short spans** (decodes, short chunks): one matmul pair for all of them at once over
  the slots in use, ``h = x_s [A_0; A_1; ...]^T``, ``h *= mask`` (each token keeps only its
  own slot's columns), ``y_s += h [B_0; B_1; ...]`` (per slice): a few ops whatever the mix
  of adapters, which is what a decode step needs (reading every slot's weights once, as any
  batched form must). ``x_s`` is ``x`` itself when every span is short (a pure decode
  step); otherwise its rows are gathered and scattered back.

``A`` is ``[slots, n R, in]`` (``R = max_lora_rank``, ``n`` the PEFT modules a fused
projection hosts) and ``B`` ``[slots, R, out]``, each slice's B in its own output columns
(no block-diagonal zeros: the expand runs one matmul per slice, on that slice's columns);
B holds the adapter's scale. :mod:`llmlab.lora.triton_ops` does the same on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Spans at least this long run as their own matmul pair; shorter ones share the dense pair.
LONG_RUN = 16


def lora_update(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slices: Sequence[tuple[int, int]],
    long_runs: Sequence[tuple[int, int, int]],
    short_index: torch.Tensor | None,
    short_mask: torch.Tensor | None,
    num_short_slots: int,
) -> torch.Tensor:
    """Add each token's adapter update to ``y`` in place and return it.

    Args:
        x: ``[T, in]``; ``y``: ``[T, out]`` (the base layer's output, contiguous rows).
        lora_a: ``[slots, n * R, in]``: slice ``j``'s A in rows ``[j R, (j + 1) R)``.
        lora_b: ``[slots, R, out]``: slice ``j``'s B (transposed) in its output columns.
        slices: ``(first output, size)`` of each of the ``n`` slices, in order.
        long_runs: ``(start, end, slot)`` spans handled as their own matmul pair.
        short_index: rows of the short spans (None: every row of ``x``, in order).
        short_mask: ``[num short rows, num_short_slots * n * R]``: 1 in the columns of the
            row's slot, 0 elsewhere (all 0 for a row without an adapter); None when no
            short row has an adapter.
        num_short_slots: slots ``0 .. num_short_slots - 1`` cover every short row's slot.
    """
    rank = lora_b.shape[1]
    for a, b, slot in long_runs:
        h = torch.mm(x[a:b], lora_a[slot].t())
        _expand(y[a:b], h.unsqueeze(1) if len(slices) == 1 else h.view(b - a, -1, rank),
                lora_b[slot], slices)
    if short_mask is not None:
        k, n = num_short_slots, len(slices)
        a_all = lora_a[:k].reshape(-1, lora_a.shape[2])
        b_all = lora_b[:k].reshape(k * rank, lora_b.shape[2])
        xs = x if short_index is None else x.index_select(0, short_index)
        h = torch.mm(xs, a_all.t()).mul_(short_mask)
        rows = h.shape[0]
        # Columns (slot, slice, rank) -> per slice, (slot, rank): B's stacked rows.
        h = h.view(rows, 1, k * rank) if n == 1 else (
            h.view(rows, k, n, rank).transpose(1, 2).reshape(rows, n, k * rank)
        )
        if short_index is None:
            _expand(y, h, b_all, slices)
        else:
            ys = torch.zeros((rows, y.shape[1]), dtype=y.dtype, device=y.device)
            _expand(ys, h, b_all, slices)
            y.index_add_(0, short_index, ys)
    return y


def _expand(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, slices) -> None:
    """``y[:, slice j] += h[:, j] @ b[:, slice j]`` for each slice (``h``: ``[rows, n, K]``,
    ``b``: ``[K, out]``)."""
    if len(slices) == 1:
        y.addmm_(h[:, 0], b)
        return
    for j, (first, size) in enumerate(slices):
        end = first + size
        y[:, first:end].addmm_(h[:, j], b[:, first:end])


def reference_lora(
    x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    token_slots: torch.Tensor, slices: Sequence[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The plain definition, one token at a time (tests): for each token ``t`` with slot
    ``s >= 0`` and each slice ``j``, ``y[t, slice j] += x[t] A_j[s]^T B_j[s]`` (layouts as
    :func:`lora_update`; ``slices`` default: one slice, all of ``y``)."""
    slices = slices or [(0, y.shape[1])]
    rank = lora_b.shape[1]
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        h = lora_a[slot].float() @ x[t].float()
        for j, (first, size) in enumerate(slices):
            b = lora_b[slot, :, first : first + size].float()
            out[t, first : first + size] += (h[j * rank : (j + 1) * rank] @ b).to(y.dtype)
    return out
