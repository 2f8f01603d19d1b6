"""``LoRASlots``: the model runner's side of LoRA: which adapter each row runs, which
adapter each device slot holds, and the step's token grouping.

LoRA's runner plugin (:mod:`llmlab.plugin`, named ``lora``); per-row state like the
runner's others: a row's adapter arrives on its first entry (the ``lora`` side map, from
:class:`~llmlab.lora.schedule.LoRASchedule`) and is dropped when the batch frees the row. Each step, :meth:`activate` puts every adapter the step needs into a device slot
(``max_loras`` of them; a slot not needed this step is reused least recently used first,
its weights taken from the host :class:`~llmlab.lora.store.AdapterStore`), and
:meth:`begin` describes the step's tokens by slot for the wrapped modules
(:class:`~llmlab.lora.layer.LoRAStep`: runs of rows that share a slot, in place or
gathered; or, for the Triton kernels, tokens sorted by slot). The scheduler guarantees at
most ``max_loras`` distinct adapters per step; an adapter that cannot be read back from
disk (dropped from host memory, then its files changed) fails its own requests only.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.lora.layer import LoRAContext, LoRALinear, LoRAStep
from llmlab.lora.ops import LONG_RUN
from llmlab.lora.request import LoRARequest
from llmlab.lora.store import AdapterStore
from llmlab.plugin import RunnerPlugin

logger = logging.getLogger(__name__)


@attrs.define
class LoRASlots(RunnerPlugin):
    """Device slots and per-row adapters of one model runner.

    Attributes:
        store: host-memory adapters (shared with input processing).
        modules: the wrapped linears, by path.
        context: what the wrapped modules read each step.
        kernel: ``"torch"`` or ``"triton"`` (CUDA's default).
        slot_loads: adapters written into a slot so far (for tests and views).
    """

    name = "lora"

    store: AdapterStore
    modules: dict[str, LoRALinear]
    context: LoRAContext
    max_loras: int
    max_num_seqs: int
    device: torch.device
    kernel: str = "torch"
    slot_loads: int = 0
    # Per row: its adapter, or None.
    _rows: list[LoRARequest | None] = attrs.field(init=False)
    # Per row: the slot its adapter holds this step (-1: none).
    _row_slot: np.ndarray = attrs.field(init=False)
    # lora_int_id -> slot, least recently used first.
    _slot_of: collections.OrderedDict[int, int] = attrs.field(
        init=False, factory=collections.OrderedDict
    )
    active: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        self._rows = [None] * self.max_num_seqs
        self._row_slot = np.full(self.max_num_seqs, -1, dtype=np.int64)

    # -- per-row state ------------------------------------------------------------------

    def start_row(self, row: int, entry: Any, side: LoRARequest | None) -> None:
        self._rows[row] = side

    def fork_row(self, leader_row: int, row: int) -> None:
        """A parallel sample's row runs its leader's adapter."""
        self._rows[row] = self._rows[leader_row]

    def release(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._rows[row] = None

    def reset(self) -> None:
        self._rows = [None] * self.max_num_seqs
        self.context.step = None

    def adapter_of(self, row: int) -> LoRARequest | None:
        return self._rows[row]

    @property
    def slots(self) -> dict[int, int]:
        """``lora_int_id -> slot`` of the adapters on the device."""
        return dict(self._slot_of)

    # -- per step -----------------------------------------------------------------------

    def activate(self, entries: Sequence) -> dict[int, str]:
        """Put the adapters of ``entries`` into slots; returns ``{entry index: why}`` for
        entries whose adapter could not be loaded (they fail alone). Clears the step's
        token grouping (:meth:`begin` builds it)."""
        self.context.step = None
        rows = self._rows
        wanted: dict[int, LoRARequest] = {}
        for e in entries:
            lora = rows[e.row]
            if lora is not None:
                wanted.setdefault(lora.lora_int_id, lora)
        self.active = bool(wanted)
        if not wanted:
            return {}
        if len(wanted) > self.max_loras:
            raise ValueError(
                f"the step holds {len(wanted)} LoRA adapters, more than max_loras="
                f"{self.max_loras} (the scheduler must not schedule that)"
            )
        failed_ids: dict[int, str] = {}
        for lora_id, lora in wanted.items():
            if lora_id in self._slot_of:
                self._slot_of.move_to_end(lora_id)
                continue
            try:
                adapter = self.store.get(lora)
            except (ValueError, OSError) as err:
                logger.warning("LoRA adapter %r could not be loaded: %s", lora.lora_name, err)
                failed_ids[lora_id] = str(err)
                continue
            slot = self._free_slot(wanted)
            for path, module in self.modules.items():
                module.set_slot(slot, adapter.weights.get(path))
            self._slot_of[lora_id] = slot
            self.slot_loads += 1
        slot_of = self._slot_of
        failures = {}
        row_slot = self._row_slot
        for i, e in enumerate(entries):
            lora = rows[e.row]
            if lora is None:
                row_slot[e.row] = -1
            elif lora.lora_int_id in failed_ids:
                row_slot[e.row] = -1
                failures[i] = failed_ids[lora.lora_int_id]
            else:
                row_slot[e.row] = slot_of[lora.lora_int_id]
        return failures

    def _free_slot(self, wanted: dict[int, LoRARequest]) -> int:
        """An empty slot, else the least recently used one no adapter of this step holds."""
        taken = set(self._slot_of.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        for lora_id, slot in self._slot_of.items():
            if lora_id not in wanted:
                del self._slot_of[lora_id]
                return slot
        raise AssertionError("more adapters in the step than slots")  # checked above

    def begin(self, entries: Sequence, lens: np.ndarray | None = None) -> None:
        """Group the step's tokens by slot for the wrapped modules (after
        :meth:`activate`; ``entries`` may be the same rows with longer spans, as
        speculative verification sends). ``lens``: tokens per entry."""
        if not self.active:
            self.context.step = None
            return
        if lens is None:
            lens = np.fromiter((len(e.token_ids) for e in entries), np.int64, len(entries))
        entry_slot = self._row_slot[np.fromiter((e.row for e in entries), np.int64, len(entries))]
        self.context.step = group_tokens(entry_slot, lens, self.device, self.kernel)

    def end(self) -> None:
        self.context.step = None

    # -- the plugin's step hooks ----------------------------------------------------------

    def before_forward(self, batch: Any, sides: Any) -> dict[int, str]:
        """The step's adapters into device slots; an adapter that cannot be read back
        fails its own requests (returned, applied after sampling)."""
        return self.activate(batch.entries)

    def eager_only(self, context: dict[int, str]) -> bool:
        return self.active  # the graphs were captured without any slot index

    def forward_begin(self, batch: Any, query_lens: np.ndarray, context: Any) -> None:
        self.begin(batch.entries, query_lens)

    def forward_end(self, context: Any) -> None:
        self.end()

    def after_forward(self, batch: Any, hidden: Any, output: Any, context: dict[int, str]) -> Any:
        return with_failures(output, context) if context else output


def group_tokens(
    entry_slot: np.ndarray,
    lens: np.ndarray,
    device: torch.device,
    kernel: str = "torch",
) -> LoRAStep | None:
    """The :class:`LoRAStep` of a flat batch whose entry ``i`` has ``lens[i]`` consecutive
    tokens in slot ``entry_slot[i]`` (-1: none); None when no token has an adapter."""
    lens = np.asarray(lens, dtype=np.int64)
    entry_slot = np.asarray(entry_slot, dtype=np.int64)
    if not (entry_slot >= 0).any():
        return None
    if kernel == "triton":
        return _grouped_by_slot(entry_slot, lens, device)
    starts = np.cumsum(lens) - lens
    long = lens >= LONG_RUN
    runs: list[tuple[int, int, int]] = []
    for a, n, slot in zip(starts[long].tolist(), lens[long].tolist(),
                          entry_slot[long].tolist()):
        if slot < 0:
            continue
        if runs and runs[-1][1] == a and runs[-1][2] == slot:  # adjacent, same adapter
            runs[-1] = (runs[-1][0], a + n, slot)
        else:
            runs.append((a, a + n, slot))
    short = ~long
    token_slot = np.repeat(entry_slot[short], lens[short])
    rows = np.flatnonzero(np.repeat(short, lens))
    rows, token_slot = rows[token_slot >= 0], token_slot[token_slot >= 0]
    if len(rows) == 0:
        return LoRAStep(kernel, tuple(runs))
    order = np.argsort(token_slot, kind="stable")
    rows, token_slot = rows[order], token_slot[order]
    bounds = [0, *(np.flatnonzero(np.diff(token_slot)) + 1).tolist(), len(rows)]
    by_slot = tuple((a, b, int(token_slot[a])) for a, b in itertools.pairwise(bounds))
    if len(rows) == int(lens.sum()) and (rows == np.arange(len(rows))).all():
        return LoRAStep(kernel, by_slot)  # every row, already in slot order: in place
    index = torch.from_numpy(rows).to(device, non_blocking=True)
    return LoRAStep(kernel, tuple(runs), index, by_slot)


def _grouped_by_slot(entry_slot: np.ndarray, lens: np.ndarray, device: torch.device):
    """The Triton kernels' form: tokens with an adapter sorted by slot, and the segments."""
    token_slot = np.repeat(entry_slot, lens)
    order = np.argsort(token_slot, kind="stable")
    order = order[token_slot[order] >= 0]
    slots_sorted = token_slot[order]
    bounds = np.flatnonzero(np.diff(slots_sorted)) + 1
    starts = np.concatenate(([0], bounds, [len(order)])).astype(np.int64)
    seg_slots = slots_sorted[starts[:-1]]
    return LoRAStep(
        "triton",
        perm=torch.from_numpy(order).to(device, non_blocking=True),
        seg_starts=torch.from_numpy(starts.astype(np.int32)).to(device, non_blocking=True),
        seg_slots=torch.from_numpy(seg_slots.astype(np.int32)).to(device, non_blocking=True),
        max_segment_len=int(np.diff(starts).max()),
        num_lora_tokens=len(order),
    )


def with_failures(output, failures: dict[int, str]):
    """``output`` (a :class:`~llmlab.scheduler.batch.BatchOutput`) with the entries in
    ``failures`` failed: no tokens, and the reason."""
    n = len(output.token_ids)
    failed = list(output.failed or (None,) * n)
    token_ids, logprobs = list(output.token_ids), list(output.logprobs)
    for i, why in failures.items():
        failed[i] = why
        token_ids[i], logprobs[i] = (), ()
    return attrs.evolve(
        output, token_ids=tuple(token_ids), logprobs=tuple(logprobs), failed=tuple(failed)
    )
