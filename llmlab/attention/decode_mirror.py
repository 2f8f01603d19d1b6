"""A dense per-request copy of decoding sequences' KV, so CPU decode reads without gathering.

On CPU, decode attention is bound by memory bandwidth: gathering every sequence's context
out of the paged cache (read + write) and then attending over the copy (read again) costs
about three passes over the KV per layer per step. The mirror keeps each decoding request's
keys and values in a stable row of a dense ``[rows, kv_heads, columns, head_dim]`` buffer
per layer. A step then only appends the new token to each row (the paged cache is still
written first and stays the source of truth) and attends over a view of the buffer: one
pass.

A row is filled from the paged cache once, when a request starts decoding (or comes back
after preemption); it is released when the scheduler frees the request's row. When many rows
have left, the remaining ones are moved down so attention does not compute over holes.
The price is memory: the mirror duplicates the decode batch's KV.
"""

from __future__ import annotations

import heapq

import attrs
import torch

from llmlab.attention.backend import token_slots


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``visible``, -inf elsewhere: the CPU SDPA kernel is markedly faster with an
    additive float mask than with a boolean one."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, float("-inf"))


_COLUMN_CHUNK = 256  # columns grow in chunks so most steps reuse the buffer as is


def _round_columns(num_tokens: int) -> int:
    return -(-num_tokens // _COLUMN_CHUNK) * _COLUMN_CHUNK


@attrs.frozen
class MirrorPlan:
    """What one step does to the mirror; built once, applied by every layer."""

    rows: torch.Tensor  # [B] row of each decode sequence, in batch order
    new_cols: torch.Tensor  # [B] column of each sequence's new token
    move_src: torch.Tensor | None  # rows copied down to ``move_dst`` before anything else
    move_dst: torch.Tensor | None
    fresh_rows: torch.Tensor | None  # rows filled from the paged cache this step
    fresh_slots: torch.Tensor | None  # [F * fresh_len] paged slots of their whole context
    fresh_len: int
    span: int  # attention runs over rows [0, span)
    max_ctx: int  # and columns [0, max_ctx)
    max_rows: int  # buffers may grow to this many rows (the size cap) ...
    max_cols: int  # ... or to this many columns
    row_ctx: torch.Tensor  # [span] context length per row (1 for holes)
    masks: dict = attrs.field(factory=dict)

    def mask_for(self, sliding_window: int | None, dtype: torch.dtype) -> torch.Tensor:
        key = (sliding_window, dtype)
        cached = self.masks.get(key)
        if cached is None:
            cols = torch.arange(self.max_ctx, device=self.row_ctx.device)
            visible = cols[None, :] < self.row_ctx[:, None]
            if sliding_window is not None:
                visible &= (self.row_ctx[:, None] - 1 - cols[None, :]) < sliding_window
            cached = additive_mask(visible, dtype)[:, None, None, :]  # [span, 1, 1, C]
            self.masks[key] = cached
        return cached


@attrs.define
class DecodeMirror:
    """Row bookkeeping (``plan``) and the per-layer dense buffers (``attend``).

    Keyed by the scheduler's rows: a row's mirror copy lives from the first decode after
    the row was assigned until the engine says the row was freed (:meth:`release`), so a
    request id reused later, or a row handed to a new request, always starts fresh. The
    mirror keeps its own dense slot per row so it can compact holes away.
    """

    # The buffers may hold at most this many rows x columns (the paged cache's token slots).
    max_cells: int
    _slot_of: dict[int, int] = attrs.field(factory=dict)  # scheduler row -> mirror slot
    _len_of: dict[int, int] = attrs.field(factory=dict)  # scheduler row -> context mirrored
    _free_slots: list[int] = attrs.field(factory=list)  # a heap: lowest slot first
    _next_slot: int = 0
    num_compactions: int = 0  # for tests and curiosity
    num_fills: int = 0  # rows (re)filled from the paged cache
    _buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)

    def release(self, rows) -> None:
        """Forget rows the scheduler freed (finished, preempted, aborted requests)."""
        for row in rows:
            if row in self._slot_of:
                self._release(row)

    def plan(
        self,
        rows: list[int],
        ctx_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        device: torch.device,
    ) -> MirrorPlan | None:
        """Assign mirror slots for this step's decode sequences (given in batch order).

        ``block_tables`` holds those sequences' block tables (``[len(rows), max_blocks]``).
        Returns ``None`` (and forgets every row) when the buffer would need more than
        ``max_cells`` rows x columns: the caller then gathers from the paged cache instead.
        With ``max_cells`` = the paged cache's slots, the mirror stays within the paged
        cache's size (up to a third more while rows have holes awaiting compaction).
        """
        max_cells = self.max_cells
        if len(rows) * _round_columns(max(ctx_lens)) > max_cells:
            self.reset()
            return None
        continuing = {row for row, n in zip(rows, ctx_lens) if self._len_of.get(row) == n - 1}
        # A live row whose context did not grow by exactly one token since the last step
        # (the step in between failed, or a request computed several tokens at once) is
        # refilled from the paged cache, which is always right.
        for row in [r for r in rows if r in self._slot_of and r not in continuing]:
            self._release(row)
        move_src, move_dst = self._compact(len(rows))
        fresh = [i for i, row in enumerate(rows) if row not in continuing]
        for i in fresh:
            self._slot_of[rows[i]] = self._take_slot()
        self.num_fills += len(fresh)
        for row, n in zip(rows, ctx_lens):
            self._len_of[row] = n

        slots = [self._slot_of[row] for row in rows]
        span = max(slots) + 1
        row_ctx = [1] * span  # holes see one (finite) column so no row is all -inf
        for slot, n in zip(slots, ctx_lens):
            row_ctx[slot] = n
        fresh_len = max((ctx_lens[i] for i in fresh), default=0)
        fresh_slots = None
        if fresh:
            # Paged slots of each fresh row's context, padded with its first slot.
            pos = torch.arange(fresh_len)
            picked = torch.tensor(fresh, dtype=torch.long)
            paged = token_slots(block_tables, picked[:, None], pos[None, :], block_size)
            lens = torch.tensor([ctx_lens[i] for i in fresh])
            paged = torch.where(pos[None, :] < lens[:, None], paged, paged[:, :1])
            fresh_slots = paged.reshape(-1).to(device)

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return MirrorPlan(
            rows=tensor(slots),
            new_cols=tensor([n - 1 for n in ctx_lens]),
            move_src=tensor(move_src) if move_src else None,
            move_dst=tensor(move_dst) if move_dst else None,
            fresh_rows=tensor([slots[i] for i in fresh]) if fresh else None,
            fresh_slots=fresh_slots,
            fresh_len=fresh_len,
            span=span,
            max_ctx=max(ctx_lens),
            max_rows=max(span, max_cells // _round_columns(max(ctx_lens))),
            max_cols=max(_round_columns(max(ctx_lens)), max_cells // span),
            row_ctx=tensor(row_ctx),
        )

    def reset(self) -> None:
        """Forget all rows and free the buffers (also the recovery after a failed step)."""
        self._slot_of.clear()
        self._len_of.clear()
        self._free_slots.clear()
        self._next_slot = 0
        self._buffers.clear()

    def _release(self, row: int) -> None:
        heapq.heappush(self._free_slots, self._slot_of.pop(row))
        self._len_of.pop(row, None)

    def _take_slot(self) -> int:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        self._next_slot += 1
        return self._next_slot - 1

    def _compact(self, num_rows_needed: int) -> tuple[list[int], list[int]]:
        """Move slots down when holes would make attention compute over > 1/4 waste."""
        if self._next_slot <= max(8, num_rows_needed * 4 // 3):
            return [], []
        kept = sorted(self._slot_of.items(), key=lambda item: item[1])
        self.num_compactions += 1
        src, dst = [], []
        for target, (row, slot) in enumerate(kept):
            if slot != target:
                src.append(slot)
                dst.append(target)
                self._slot_of[row] = target
        self._next_slot = len(kept)
        self._free_slots = []
        return src, dst

    def attend(
        self,
        layer_idx: int,
        plan: MirrorPlan,
        queries: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """``queries`` ``[B, Hkv, G, D]``, new K/V ``[B, Hkv, D]``; returns ``[B, Hkv, G, D]``.

        ``key_cache`` / ``value_cache`` are the layer's paged stores ``[Hkv, slots, D]``,
        already holding this step's tokens.
        """
        keys, values = self._buffer(layer_idx, plan, key_cache)
        for buf, paged, new in ((keys, key_cache, new_keys), (values, value_cache, new_values)):
            if plan.move_src is not None:
                buf[plan.move_dst] = buf[plan.move_src]
            if plan.fresh_rows is not None:
                filled = paged.index_select(1, plan.fresh_slots).to(buf.dtype)
                filled = filled.view(paged.shape[0], -1, plan.fresh_len, paged.shape[2])
                buf[plan.fresh_rows, :, : plan.fresh_len] = filled.transpose(0, 1)
            buf[plan.rows, :, plan.new_cols] = new.to(buf.dtype)

        _, num_kv_heads, group, head_dim = queries.shape
        q_rows = queries.new_zeros(plan.span, num_kv_heads, group, head_dim)
        q_rows[plan.rows] = queries
        attended = torch.nn.functional.scaled_dot_product_attention(
            q_rows,
            keys[: plan.span, :, : plan.max_ctx],
            values[: plan.span, :, : plan.max_ctx],
            attn_mask=plan.mask_for(sliding_window, queries.dtype),
            scale=scale,
        )
        return attended[plan.rows]

    def _buffer(
        self, layer_idx: int, plan: MirrorPlan, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_kv_heads, _, head_dim = like.shape
        current = self._buffers.get(layer_idx)
        rows_cap = current[0].shape[0] if current else 0
        cols_cap = current[0].shape[2] if current else 0
        if rows_cap >= plan.span and cols_cap >= plan.max_ctx:
            return current
        # Grow geometrically (each growth copies every layer's buffers), within the cap.
        rows, cols = rows_cap, cols_cap
        if rows_cap < plan.span:
            rows = max(plan.span, min(max(2 * rows_cap, 8), plan.max_rows))
        if cols_cap < plan.max_ctx:
            cols = max(_round_columns(plan.max_ctx), min(2 * cols_cap, plan.max_cols))
        grown = []
        for old in current or (None, None):
            # Zeroed, not empty: SDPA still multiplies masked-out columns, and garbage there
            # (NaN, inf, denormals) would poison or slow every row.
            buf = like.new_zeros(rows, num_kv_heads, cols, head_dim)
            if old is not None:
                buf[:rows_cap, :, :cols_cap] = old
            grown.append(buf)
        self._buffers[layer_idx] = (grown[0], grown[1])
        return self._buffers[layer_idx]
