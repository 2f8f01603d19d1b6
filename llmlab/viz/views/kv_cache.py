"""``KVCacheView``: the block pool as a grid of cells colored by owning request (HTML widget
and matplotlib figure), with the ``_cells`` helper that aggregates large pools."""

from __future__ import annotations

import html
from typing import Any

import numpy as np

from llmlab.observe.events import EngineSnapshot, StepEvent
from llmlab.viz.state import CACHED, EMPTY, SHARED, Frame, KVCacheState
from llmlab.viz.views.base import (
    CACHED_COLOR,
    COMPACTED_MARK,
    EMPTY_COLOR,
    PALETTE,
    PARTIAL_WASH,
    SHARED_MARK,
    _View,
    request_color,
)


class KVCacheView(_View):
    """The block pool as a grid: one cell per block, colored by the request that owns it.

    Shared blocks (prefix hits, parallel samples) carry a dark outline; a partly written
    block (the last of each request) is washed out beyond its filled part; free blocks
    whose KV is still in the prefix cache are gray, empty ones near-white. Blocks of a request
    whose KV a KV press compacted carry a dashed inner outline, and the legend gives each such
    request's kept ratio. Hovering a cell gives
    the block, its owner, tokens stored and ref count. Pools with more than ``max_cells``
    blocks are drawn aggregated: each cell stands for a run of consecutive blocks and shows
    the state most of them are in (and the commonest owner).

    Args:
        source: an ``LLM``, ``Engine`` or ``AsyncEngine`` to watch live, or a
            :class:`~llmlab.observe.recording.Recording` (or its path) to replay.
        max_cells: most cells to draw before aggregating.
        interval: least seconds between two redraws while the engine runs.
        cell_px: cell size in pixels (default: 18 for up to 128 cells, 14 up to 512, else 10).

    ``frame`` is the current :class:`~llmlab.viz.state.Frame`; ``frames`` keeps every
    frame when ``keep_frames=True`` (for tests and analysis).
    """

    _CHECKPOINT_EVERY = 64

    def __init__(
        self,
        source: Any,
        *,
        max_cells: int = 1024,
        interval: float | None = None,
        cell_px: int | None = None,
        keep_frames: bool = False,
    ) -> None:
        for name, value, low in (("max_cells", max_cells, 1), ("cell_px", cell_px, 2)):
            if value is None and name == "cell_px":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        self.max_cells = max_cells
        self.cell_px = cell_px
        self.frames: list[Frame] | None = [] if keep_frames else None
        self._checkpoints: dict[int, KVCacheState] = {}
        super().__init__(source, interval=interval)

    @property
    def frame(self) -> Frame:
        """The pool as last seen."""
        return self._state.frame()

    def _reset(self, snapshot: EngineSnapshot) -> None:
        self._state = KVCacheState(snapshot)
        if self.frames is not None and self.recording is None:
            self.frames.append(self._state.frame())

    def _apply(self, event: StepEvent) -> None:
        self._state.apply(event)
        if self.frames is not None and self.recording is None:
            self.frames.append(self._state.frame())

    def _seek(self, position: int) -> None:
        current = self.position or 0
        # Restart from the latest checkpoint at or before ``position`` when going back, or
        # when it lies ahead of where we are.
        base = max((p for p in self._checkpoints if p <= position), default=0)
        if position < current or base > current:
            self._state = self._checkpoints[base].copy() if base else KVCacheState(self._snapshot)
            current = base
        for i in range(current, position):
            self._state.apply(self._events[i])
            if (i + 1) % self._CHECKPOINT_EVERY == 0 and i + 1 not in self._checkpoints:
                self._checkpoints[i + 1] = self._state.copy()

    def frame_at(self, position: int) -> Frame:
        """The frame after the first ``position`` events of the recording. A seek: the view
        moves there (as :meth:`seek`), so ``html()`` and ``to_png()`` then draw this frame;
        read ``position`` first and seek back to keep the view where it was."""
        self.seek(position)
        return self.frame

    # -- drawing ---------------------------------------------------------------------

    def _build_widget(self, w):
        self._html = w.HTML()
        return w.VBox([self._html])

    def _capture(self) -> Frame:
        return self.frame

    def _show(self, frame: Frame) -> None:
        self._html.value = self.html(frame)

    def html(self, frame: Frame | None = None) -> str:
        """The grid, legend and summary as HTML (what the widget shows)."""
        frame = self.frame if frame is None else frame
        cells = _cells(frame, self.max_cells)
        columns = max(1, min(64, int(np.ceil(np.sqrt(len(cells.color) * 2)))))
        n = len(cells.color)
        px = self.cell_px or (18 if n <= 128 else 14 if n <= 512 else 10)
        out = [
            '<div class="llmlab-kv" style="font-family:sans-serif;font-size:12px">',
            (
                f'<div class="llmlab-kv-grid" style="display:grid;width:max-content;'
                f"grid-template-columns:repeat({columns},{px}px);grid-auto-rows:{px}px;"
                f'gap:1px;margin:4px 0">'
            ),
        ]
        cells_iter = zip(
            cells.color, cells.shared, cells.title, cells.fill, cells.compacted, strict=True
        )
        for color, shared, title, fill, compacted in cells_iter:
            mark = f";box-shadow:{SHARED_MARK}" if shared else ""
            if compacted:
                # An outline, not a box-shadow or a gradient: those mark shared and partly
                # written blocks, and a compacted block may be either too.
                mark += f";outline:{COMPACTED_MARK};outline-offset:-4px"
            if fill < 1.0:
                # The unfilled part of a partly written block, washed out: the slack
                # (internal fragmentation) of the last block of each request.
                pct = round(100 * fill)
                mark += (
                    f";background-image:linear-gradient(to right,transparent {pct}%,"
                    f"{PARTIAL_WASH} {pct}%)"
                )
            out.append(
                f'<div class="llmlab-kv-cell" style="background:{color}{mark}" '
                f'title="{html.escape(title)}"></div>'
            )
        out.append("</div>")
        out.append(self._legend_html(frame, cells.blocks_per_cell))
        out.append(_host_tiers_html(frame))
        out.append("</div>")
        return "".join(out)

    def _legend_html(self, frame: Frame, per_cell: int) -> str:
        counts = frame.counts()
        held = np.bincount(frame.owner[frame.owner >= 0], minlength=len(frame.requests))
        top = np.argsort(-held, kind="stable")[:12]
        top = [int(i) for i in top if held[i] > 0]

        def swatch(color: str, mark: str = "") -> str:
            style = f"background:{color}" + (f";box-shadow:{mark}" if mark else "")
            return (
                f'<span style="display:inline-block;width:10px;height:10px;{style};'
                f'margin:0 3px 0 8px;vertical-align:middle"></span>'
            )

        half_written = (
            f"{PALETTE[0]};background-image:linear-gradient(to right,transparent 50%,"
            f"{PARTIAL_WASH} 50%)"
        )
        parts = [
            f"<div>step {frame.step_index} · {frame.num_in_use}/{frame.num_blocks} blocks in "
            f"use ({counts['shared']} shared) · {counts['cached']} cached free · "
            f"{counts['empty']} empty · {frame.num_running} running, {frame.num_waiting} "
            "waiting"
            + _compacted_note(frame, " · ")
            + (f" · {per_cell} blocks per cell" if per_cell > 1 else "")
            + "</div><div>"
        ]
        for i in top:
            rid = html.escape(frame.requests[i])
            parts.append(f"{swatch(request_color(i))}{rid}: {int(held[i])}{_kept(frame, i)}")
        if len(top) < int(np.count_nonzero(held)):
            parts.append(f" … {int(np.count_nonzero(held)) - len(top)} more")
        compacted = ""
        if frame.compacted.any():  # only with a KV press
            compacted = (
                f'<span style="display:inline-block;width:10px;height:10px;'
                f"background:#ffffff;outline:{COMPACTED_MARK};outline-offset:-2px;"
                f'margin:0 3px 0 8px;vertical-align:middle"></span>compacted by a KV press'
            )
        parts.append(
            f"</div><div>{swatch('#ffffff', SHARED_MARK)}shared"
            f"{swatch(half_written)}partly written"
            f"{compacted}"
            f"{swatch(CACHED_COLOR)}cached free (a prefix hit can revive it)"
            f"{swatch(EMPTY_COLOR)}empty</div>"
        )
        return "".join(parts)

    def figure(self, frame: Frame | None = None):
        """The grid as a matplotlib ``Figure`` (same colors and outlines as the widget)."""
        from matplotlib.collections import PatchCollection
        from matplotlib.colors import to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle

        frame = self.frame if frame is None else frame
        cells = _cells(frame, self.max_cells)
        n = len(cells.color)
        columns = max(1, min(64, int(np.ceil(np.sqrt(n * 2)))))
        rows = -(-n // columns)
        rgb = np.ones((rows * columns, 3))
        fill = np.asarray(cells.fill)[:, None]
        # A partly written block is drawn paler, in proportion to its empty slots.
        rgb[:n] = np.asarray([to_rgb(c) for c in cells.color]) * (0.4 + 0.6 * fill) + (
            0.6 * (1 - fill)
        )
        rgb = rgb.reshape(rows, columns, 3)
        width = min(14.0, 3.5 + columns * 0.2)
        fig = Figure(figsize=(max(7.0, width), 1.4 + rows * 0.2), layout="constrained")
        ax = fig.subplots()
        ax.imshow(rgb, interpolation="nearest", aspect="equal")
        shared = np.flatnonzero(cells.shared)
        if shared.size:
            ax.scatter(
                shared % columns, shared // columns, marker="s", s=40,
                facecolors="none", edgecolors="#111111", linewidths=1.2,
            )  # fmt: skip
        compacted = np.flatnonzero(cells.compacted)
        if compacted.size:
            # A dashed square inside the cell (inside the shared outline, when both).
            ax.add_collection(PatchCollection(
                [Rectangle((c % columns - 0.3, c // columns - 0.3), 0.6, 0.6) for c in compacted],
                **_COMPACTED_STYLE,
            ))  # fmt: skip
        # Thin white lines between cells, as in the widget.
        ax.set_xticks(np.arange(-0.5, columns, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, rows, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="both", length=0, labelbottom=False, labelleft=False)
        counts = frame.counts()
        ax.set_title(
            f"KV cache after step {frame.step_index}\n{frame.num_in_use}/{frame.num_blocks} "
            f"blocks in use, {counts['shared']} shared, {counts['cached']} cached free"
            + _compacted_note(frame, ", ")
            + (f", {cells.blocks_per_cell} blocks per cell" if cells.blocks_per_cell > 1 else "")
            + "".join(f"\n{line}" for line in _host_tier_lines(frame)),
            fontsize="small",
            loc="left",
        )
        held = np.bincount(frame.owner[frame.owner >= 0], minlength=len(frame.requests))
        top = [int(i) for i in np.argsort(-held, kind="stable")[:10] if held[i] > 0]
        handles = [
            Patch(color=request_color(i), label=frame.requests[i] + _kept(frame, i, as_html=False))
            for i in top
        ]
        handles.append(Patch(facecolor="white", edgecolor="#111111", label="shared"))
        if compacted.size:
            handles.append(Patch(facecolor="white", edgecolor=_COMPACTED_STYLE["edgecolor"],
                                 linestyle=_COMPACTED_STYLE["linestyle"],
                                 label="compacted by a KV press"))
        handles += [
            Patch(color=CACHED_COLOR, label="cached free"),
            Patch(color=EMPTY_COLOR, label="empty"),
        ]
        fig.legend(handles=handles, loc="outside right upper", fontsize="small", frameon=False)
        return fig


# The figure's mark of a compacted block (the widget's is COMPACTED_MARK).
_COMPACTED_STYLE = {"facecolor": "none", "edgecolor": "#111111", "linestyle": (0, (2, 1.5)),
                    "linewidth": 1.0}


def _compacted_note(frame: Frame, sep: str) -> str:
    """How many blocks a KV press compacted, for the summary line (nothing without)."""
    n = int(np.count_nonzero(frame.compacted))
    return f"{sep}{n} compacted" if n else ""


def _kept(frame: Frame, index: int, as_html: bool = True) -> str:
    """`` (kept 50%)`` after a compacted request's legend entry, else nothing."""
    ratio = frame.kept_ratio.get(frame.requests[index])
    if ratio is None:
        return ""
    return f" <i>(kept {ratio:.0%})</i>" if as_html else f" (kept {ratio:.0%})"


def _host_tier_lines(frame: Frame) -> list[str]:
    """One line per host pool the engine has: the second tier, the swap space."""
    lines = []
    if frame.num_offload_blocks:
        lines.append(
            f"offload tier: {frame.offload_cached}/{frame.num_offload_blocks} blocks cached"
        )
    if frame.num_swap_blocks:
        lines.append(f"swap space: {frame.swap_used}/{frame.num_swap_blocks} blocks used")
    return lines


def _host_tiers_html(frame: Frame) -> str:
    """The host pools as filled bars under the grid (nothing without host pools)."""
    bars = []
    for line, filled, total, color in (
        ("offload tier", frame.offload_cached, frame.num_offload_blocks, CACHED_COLOR),
        ("swap space", frame.swap_used, frame.num_swap_blocks, PALETTE[0]),
    ):
        if not total:
            continue
        pct = 100 * filled / total
        bars.append(
            f'<div class="llmlab-kv-tier" style="margin-top:3px">'
            f'<span style="display:inline-block;width:220px;height:10px;'
            f'vertical-align:middle;background:linear-gradient(to right,{color} {pct:.1f}%,'
            f'{EMPTY_COLOR} {pct:.1f}%);border:1px solid #ccc"></span> {line}: '
            f"{filled}/{total} blocks {'cached' if line == 'offload tier' else 'used'}</div>"
        )
    return "".join(bars)


class _Cells:
    __slots__ = ("blocks_per_cell", "color", "compacted", "fill", "shared", "title")

    def __init__(self, color, shared, title, blocks_per_cell, fill, compacted) -> None:
        self.color, self.shared, self.title = color, shared, title
        self.blocks_per_cell = blocks_per_cell
        # Fraction of a held block's slots that hold tokens (1.0 when aggregated or free).
        self.fill = [1.0] * len(color) if fill is None else fill
        # Whether a cell holds a block a KV press compacted (any of its blocks, aggregated).
        self.compacted = compacted


def _cells(frame: Frame, max_cells: int) -> _Cells:
    """What each drawn cell shows: one block per cell, or runs of blocks aggregated."""
    n = frame.num_blocks
    per_cell = max(1, -(-n // max_cells))
    if per_cell == 1:
        colors = [
            request_color(o) if o >= 0 else (CACHED_COLOR if s == CACHED else EMPTY_COLOR)
            for o, s in zip(frame.owner.tolist(), frame.state.tolist(), strict=True)
        ]
        shared = (frame.state == SHARED).tolist()
        titles = [frame.describe(b) for b in range(n)]
        held = frame.refs > 0
        fill = np.where(held, frame.tokens / frame.block_size, 1.0).tolist()
        return _Cells(colors, shared, titles, 1, fill, frame.compacted.tolist())
    colors, shared, titles, compacted = [], [], [], []
    for start in range(0, n, per_cell):
        stop = min(n, start + per_cell)
        states = frame.state[start:stop]
        counts = np.bincount(states, minlength=4)
        owners = frame.owner[start:stop]
        held = owners[owners >= 0]
        used = int(counts[2] + counts[3])
        if used * 2 >= len(states) and held.size:
            top = int(np.bincount(held).argmax())
            colors.append(request_color(top))
        elif counts[CACHED] >= counts[EMPTY]:
            colors.append(CACHED_COLOR)
        else:
            colors.append(EMPTY_COLOR)
        shared.append(bool(counts[SHARED]))
        num_compacted = int(np.count_nonzero(frame.compacted[start:stop]))
        compacted.append(num_compacted > 0)
        names = sorted({frame.requests[o] for o in held.tolist()})
        who = f"; {', '.join(names[:4])}" + (" …" if len(names) > 4 else "") if names else ""
        titles.append(
            f"blocks {start}–{stop - 1}: {used} in use ({int(counts[SHARED])} shared"
            + (f", {num_compacted} compacted" if num_compacted else "")
            + f"), {int(counts[CACHED])} cached, {int(counts[EMPTY])} empty{who}"
        )
    return _Cells(colors, shared, titles, per_cell, None, compacted)
