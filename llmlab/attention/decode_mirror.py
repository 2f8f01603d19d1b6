"""A dense per-request copy of decoding sequences' KV, so CPU decode reads without gathering.

On CPU, decode attention is bound by memory bandwidth: gathering every sequence's context
out of the paged cache (read + write) and then attending over the copy (read again) costs
about three passes over the KV per layer per step. The mirror keeps each decoding request's
keys and values in a stable row of a dense ``[rows, kv_heads, columns, head_dim]`` buffer
per layer. A step then only appends the new token to each row (the paged cache is still
written first and stays the source of truth) and attends over a view of the buffer: one
pass.

A row is filled from the paged cache once, when a request starts decoding (or comes back
after preemption); it is released when the request leaves the decode batch. When many rows
have left, the remaining ones are moved down so attention does not compute over holes.
The price is memory: the mirror duplicates the decode batch's KV.
"""

from __future__ import annotations

import heapq

import attrs
import torch


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
    """Row bookkeeping (``plan``) and the per-layer dense buffers (``attend``)."""

    _row_of: dict[str, int] = attrs.field(factory=dict)
    _len_of: dict[str, int] = attrs.field(factory=dict)
    _free_rows: list[int] = attrs.field(factory=list)  # a heap: lowest row first
    _next_row: int = 0
    num_compactions: int = 0  # for tests and curiosity
    num_fills: int = 0  # rows (re)filled from the paged cache
    _buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)

    def plan(
        self,
        request_ids: list[str],
        ctx_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        max_cells: int,
    ) -> MirrorPlan | None:
        """Assign rows for this step's decode sequences (given in batch order).

        Returns ``None`` (and forgets every row) when the buffer would need more than
        ``max_cells`` rows x columns: the caller then gathers from the paged cache instead.
        With ``max_cells`` = the paged cache's slots, the mirror stays within the paged
        cache's size (up to a third more while rows have holes awaiting compaction).
        """
        if len(request_ids) * _round_columns(max(ctx_lens)) > max_cells:
            self.reset()
            return None
        active = set(request_ids)
        for rid in [r for r in self._row_of if r not in active]:
            self._release(rid)
        continuing = {
            rid for rid, n in zip(request_ids, ctx_lens) if self._len_of.get(rid) == n - 1
        }
        for rid in [r for r in request_ids if r in self._row_of and r not in continuing]:
            self._release(rid)
        move_src, move_dst = self._compact(len(request_ids))
        fresh = [i for i, rid in enumerate(request_ids) if rid not in continuing]
        for i in fresh:
            self._row_of[request_ids[i]] = self._take_row()
        self.num_fills += len(fresh)
        for rid, n in zip(request_ids, ctx_lens):
            self._len_of[rid] = n

        rows = [self._row_of[rid] for rid in request_ids]
        span = max(rows) + 1
        row_ctx = [1] * span  # holes see one (finite) column so no row is all -inf
        for row, n in zip(rows, ctx_lens):
            row_ctx[row] = n
        fresh_len = max((ctx_lens[i] for i in fresh), default=0)
        fresh_slots = None
        if fresh:
            # Paged slots of each fresh row's context, padded with its first slot.
            pos = torch.arange(fresh_len)
            tables = torch.zeros(len(fresh), -(-fresh_len // block_size), dtype=torch.long)
            for j, i in enumerate(fresh):
                blocks = block_tables[i][: tables.shape[1]]
                tables[j, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
            slots = tables[:, pos // block_size] * block_size + pos % block_size
            lens = torch.tensor([ctx_lens[i] for i in fresh])
            slots = torch.where(pos[None, :] < lens[:, None], slots, slots[:, :1])
            fresh_slots = slots.reshape(-1).to(device)

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        return MirrorPlan(
            rows=tensor(rows),
            new_cols=tensor([n - 1 for n in ctx_lens]),
            move_src=tensor(move_src) if move_src else None,
            move_dst=tensor(move_dst) if move_dst else None,
            fresh_rows=tensor([rows[i] for i in fresh]) if fresh else None,
            fresh_slots=fresh_slots,
            fresh_len=fresh_len,
            span=span,
            max_ctx=max(ctx_lens),
            max_rows=max(span, max_cells // _round_columns(max(ctx_lens))),
            max_cols=max(_round_columns(max(ctx_lens)), max_cells // span),
            row_ctx=tensor(row_ctx),
        )

    def reset(self) -> None:
        """Forget all rows and free the buffers."""
        self._row_of.clear()
        self._len_of.clear()
        self._free_rows.clear()
        self._next_row = 0
        self._buffers.clear()

    def _release(self, rid: str) -> None:
        heapq.heappush(self._free_rows, self._row_of.pop(rid))
        self._len_of.pop(rid, None)

    def _take_row(self) -> int:
        if self._free_rows:
            return heapq.heappop(self._free_rows)
        self._next_row += 1
        return self._next_row - 1

    def _compact(self, num_rows_needed: int) -> tuple[list[int], list[int]]:
        """Move rows down when holes would make attention compute over > 1/4 waste."""
        kept = sorted(self._row_of.items(), key=lambda item: item[1])
        if self._next_row <= max(8, num_rows_needed * 4 // 3):
            return [], []
        self.num_compactions += 1
        src, dst = [], []
        for target, (rid, row) in enumerate(kept):
            if row != target:
                src.append(row)
                dst.append(target)
                self._row_of[rid] = target
        self._next_row = len(kept)
        self._free_rows = []
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
