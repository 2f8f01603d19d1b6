"""The batched LoRA computation on the torch path.

A step's tokens are described once per step (:class:`~llmlab.lora.layer.LoRAStep`, built
by :func:`~llmlab.lora.slots.group_tokens`), then every wrapped linear adds
``y[t] += (x[t] A[slot]^T) B[slot]`` for each token ``t`` with an adapter slot, as one
matmul pair per run of rows that share a slot (segment-wise, as Punica's SGMV; Chen et al.,
2023), never one forward per adapter:

* **in place**: a request's span of at least :data:`LONG_RUN` tokens (a prefill chunk),
  ``y[a:b] += (x[a:b] A[slot]^T) B[slot]`` on its own rows, with no gather, scatter or
  large temporary; so are the short spans of a step whose every token is short, has an
  adapter and already sits in slot order (a decode step of one adapter);
* **gathered**: the other short spans' rows with an adapter (decodes, short chunks),
  sorted by slot into one block, run as one matmul pair per slot in use on that slot's
  rows, then added back by index: ``2 + k (1 + n)`` ops for ``k`` adapters however the
  rows interleave, reading each slot's weights once, as any batched form must.

Each row's update comes from its own slot's weights alone, by construction: no matmul
mixes two slots' rows or weights. (An earlier form multiplied every row by every slot's
weights and zeroed the others with a 0/1 mask; ``0 * inf`` is NaN, so one adapter's
overflow reached every row of the step, base-model rows included.) Rows without an
adapter are never touched.

``A`` is ``[slots, n R, in]`` (``R = max_lora_rank``, ``n`` the PEFT modules a fused
projection hosts) and ``B`` ``[slots, R, out]``, each slice's B in its own output columns
(no block-diagonal zeros: the expand runs one matmul per slice, on that slice's columns);
B holds the adapter's scale. :mod:`llmlab.lora.triton_ops` does the same on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Spans at least this long run in place as their own matmul pair; shorter ones are
# gathered, so that interleaved decode rows cost one matmul pair per adapter, not per row.
LONG_RUN = 16


def lora_update(
    x: torch.Tensor,
    y: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slices: Sequence[tuple[int, int]],
    runs: Sequence[tuple[int, int, int]],
    gather_index: torch.Tensor | None = None,
    gathered_runs: Sequence[tuple[int, int, int]] = (),
) -> torch.Tensor:
    """Add each token's adapter update to ``y`` in place and return it.

    Args:
        x: ``[T, in]``; ``y``: ``[T, out]`` (the base layer's output, contiguous rows).
        lora_a: ``[slots, n * R, in]``: slice ``j``'s A in rows ``[j R, (j + 1) R)``.
        lora_b: ``[slots, R, out]``: slice ``j``'s B (transposed) in its output columns.
        slices: ``(first output, size)`` of each of the ``n`` slices, in order.
        runs: ``(start, end, slot)``: rows of ``x`` run in place as one matmul pair.
        gather_index: the rows ``gathered_runs`` index, sorted by slot.
        gathered_runs: ``(start, end, slot)`` over the gathered rows, one per slot.
    """
    for start, end, slot in runs:
        _run(x[start:end], y[start:end], lora_a[slot], lora_b[slot], slices)
    if gathered_runs:
        xs = x.index_select(0, gather_index)
        ys = torch.zeros((xs.shape[0], y.shape[1]), dtype=y.dtype, device=y.device)
        for start, end, slot in gathered_runs:
            _run(xs[start:end], ys[start:end], lora_a[slot], lora_b[slot], slices)
        y.index_add_(0, gather_index, ys)
    return y


def _run(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slices) -> None:
    """``y[:, slice j] += (x a_j^T) b[:, slice j]`` for each slice, in place: rows of one
    slot (``a``: ``[n R, in]``, ``b``: ``[R, out]``)."""
    h = torch.mm(x, a.t())
    if len(slices) == 1:
        y.addmm_(h, b)
        return
    rank = b.shape[0]
    for j, (first, size) in enumerate(slices):
        end = first + size
        y[:, first:end].addmm_(h[:, j * rank : (j + 1) * rank], b[:, first:end])


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
