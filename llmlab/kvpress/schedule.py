"""The scheduler's side of a KV press: when a request keeps queries and compacts, and into
how many blocks.

Mechanism only; the press decides what is kept (:mod:`llmlab.kvpress.base`). Per entry the
scheduler asks :meth:`PressSchedule.step` for a :class:`~llmlab.scheduler.batch.PressStep`:

* a request compacts when its span computes through its last known token for the first
  time since it was (re)started (the prompt, or the prompt and outputs after a preemption
  by recompute), and again every ``compress_every`` decode steps; the budget counts the
  whole context (``kv_keep`` of it), capped at what each layer holds;
* it keeps the queries of the last ``press.query_span`` positions before that point;
* the kept tokens go to fresh blocks reserved here (``KVCacheManager.begin_compaction``);
  in a full pool, to the request's own first blocks when it alone holds them (they leave
  the prefix index first); else the compaction waits for a later step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import attrs

from llmlab.errors import component_name
from llmlab.kvpress.base import KVPress
from llmlab.scheduler.batch import PressStep

if TYPE_CHECKING:
    from llmlab.cache.kv_cache_manager import KVCacheManager
    from llmlab.request import Request

logger = logging.getLogger(__name__)


@attrs.frozen
class Compaction:
    """One request's KV compaction, as a step event reports it.

    Attributes:
        request_id: the request.
        context_len: its context (prompt and output so far) when compacted.
        before / kept: per layer, the cached tokens before and after.
        error: why the press failed (then nothing was dropped: ``kept == before``, and the
            request goes on uncompressed), else None.
    """

    request_id: str
    context_len: int
    before: tuple[int, ...]
    kept: tuple[int, ...]
    error: str | None = None

    @property
    def tokens_dropped(self) -> int:
        """Cache slots the request gave up (its largest layer's count before and after:
        what sets its blocks)."""
        return max(self.before, default=0) - max(self.kept, default=0)

    @property
    def kept_ratio(self) -> float:
        """Tokens kept per layer on average, as a fraction of the context."""
        if not self.kept or not self.context_len:
            return 1.0
        return sum(self.kept) / (len(self.kept) * self.context_len)


@attrs.define
class PressSchedule:
    """Plans each entry's capture and compaction (see the module docstring).

    Args:
        press: the engine's press (its ``compression_ratio``, ``compress_every``,
            ``window`` and ``layer_budgets`` are read here; ``score`` runs in the executor).
        num_layers: the model's layers (``layer_budgets`` gives one budget each).
    """

    press: KVPress
    num_layers: int
    # Compactions since the engine last took them (for its step event).
    log: list[Compaction] = attrs.field(factory=list)

    def take_log(self) -> list[Compaction]:
        log, self.log = self.log, []
        return log

    def keep_for(self, request: Request) -> float | None:
        """The fraction of its context ``request`` keeps (None: it is not pressed)."""
        if request.pooling_params is not None:
            return None
        extra = request.sampling_params.extra_args or {}
        if extra.get("kv_press") is False:
            return None
        budget = extra.get("kv_budget")
        return float(budget) if budget is not None else self.press.keep_fraction()

    def prefix_limit(self, request: Request) -> int | None:
        """The most prompt tokens a prefix-cache hit may cover, so the press still sees
        the queries it reads (None: no limit; 0: no hit at all)."""
        if request.kv_keep is None:
            return None
        window = self.press.query_span
        if window < 0:
            return 0
        if window == 0:
            return None
        return max(0, request.num_tokens - window)

    def due(self, request: Request, end: int) -> bool:
        """Whether the request compacts after a span ending at ``end``."""
        if not request.kv_compressed:
            return end >= request.num_tokens  # computed through its last known token
        every = self.press.compress_every
        return every is not None and end - request.kv_compacted_at >= every

    def step(self, request: Request, start: int, end: int, kv: KVCacheManager) -> PressStep | None:
        """The entry's :class:`PressStep` for span ``[start, end)``, reserving blocks for a
        compaction that is due; None when the request has nothing to do with the press."""
        if request.kv_keep is None or request.kv_press_error is not None:
            return None
        window = self.press.query_span
        if not request.kv_compressed:
            point = request.num_tokens
            capture_from = 0 if window < 0 else max(0, point - window)
        else:
            every = self.press.compress_every
            if every is None:
                return None
            point = request.kv_compacted_at + every
            capture_from = request.kv_compacted_at if window < 0 else max(0, point - window)
        if window == 0 or end <= capture_from:
            capture_from = -1
        if not self.due(request, end):
            if capture_from < 0:
                return None
            return PressStep(capture_from=capture_from, window=window)
        budgets = self._budgets(request, end)
        if budgets is None:
            return None
        reserved = kv.begin_compaction(request, kv.blocks_needed(max(budgets)))
        if reserved is None:  # no blocks now: keep capturing, compact later
            return PressStep(capture_from=capture_from, window=window) if window else None
        targets, in_place = reserved
        return PressStep(
            capture_from=capture_from, budgets=budgets, targets=targets, context_len=end,
            is_prompt=not request.kv_compressed, window=window, in_place=in_place,
        )

    def _budgets(self, request: Request, end: int) -> tuple[int, ...] | None:
        """Per-layer kept counts, each in ``[1, tokens the layer holds]``; None when the
        press answered nonsense (the request then stays uncompressed, reported)."""
        press = self.press
        try:
            raw = list(press.layer_budgets(end, request.kv_keep, self.num_layers))
            if len(raw) != self.num_layers or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in raw
            ):
                raise ValueError(
                    f"returned {raw!r}, not one int per layer ({self.num_layers})"
                )
        except Exception as err:  # noqa: BLE001 - user code: this request goes on uncompressed
            self.fail(request, f"layer_budgets: {type(err).__name__}: {err}")
            return None
        held = request.num_computed_tokens - request.kv_dropped
        shift = request.kv_layer_shift or (0,) * self.num_layers
        # ``end`` may be past what is computed now (this step's span): the layer holds
        # its current tokens plus the span's.
        span = end - request.num_computed_tokens
        return tuple(
            max(1, min(b, held - s + span)) for b, s in zip(raw, shift, strict=True)
        )

    def fail(self, request: Request, reason: str, context_len: int = 0) -> None:
        """The press failed for ``request``: it stays uncompressed from now on."""
        message = (
            f"kv_press {component_name(self.press)} failed for request "
            f"{request.request_id!r}: {reason}"
        )
        request.kv_press_error = message
        logger.warning("%s; the request continues uncompressed", message)
        held = (context_len or request.num_computed_tokens) - request.kv_dropped
        shift = request.kv_layer_shift or (0,) * self.num_layers
        before = tuple(held - s for s in shift)
        self.log.append(Compaction(request.request_id, context_len, before, before, message))

    def committed(
        self, request: Request, context_len: int, before: tuple[int, ...], kept: tuple[int, ...]
    ) -> None:
        """The executor compacted the request to ``kept`` tokens per layer."""
        self.log.append(Compaction(request.request_id, context_len, tuple(before), tuple(kept)))
        top = max(kept)
        request.kv_dropped = context_len - top
        shift = tuple(top - k for k in kept)
        request.kv_layer_shift = shift if any(shift) else None
        request.kv_compressed = True
        request.kv_compacted_at = context_len
