"""The scheduler's side of a KV press: when a request keeps queries and compacts, and into
how many blocks.

Mechanism only; the press decides what is kept (:mod:`llmlab.kvpress.base`).
:class:`PressSchedule` is the press's scheduler plugin (:mod:`llmlab.plugin`, named
``kv_press``): it keeps each request's press state, and plans a :class:`PressStep` per entry
(its side map):

* a request compacts when its span computes through its last known token for the first
  time since it was (re)started (the prompt, or the prompt and outputs after a preemption
  by recompute), and again every ``compress_every`` decode steps; the budget counts the
  whole context (its ``keep`` fraction of it), capped at what each layer holds;
* it keeps the queries of the last ``press.query_span`` positions before that point;
* the kept tokens go to fresh blocks reserved here (``KVCacheManager.begin_compaction``);
  in a full pool, to the request's own first blocks when it alone holds them (they leave
  the prefix index first); else the compaction waits for a later step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs

from llmlab.errors import component_name
from llmlab.kvpress.base import KVPress
from llmlab.plugin import SchedulerPlugin, StepPlan

if TYPE_CHECKING:
    from llmlab.cache.kv_cache_manager import KVCacheManager
    from llmlab.request import Request

logger = logging.getLogger(__name__)


class PressStep(NamedTuple):
    """A KV press's part in one entry (its side map's item): plain data.

    Attributes:
        capture_from: keep the queries of this span's positions from here on (the press
            reads the most recent ones at its next compaction); -1: keep none.
        budgets: when set, compact the row after this step's forward: each layer keeps
            this many of its cached tokens (the KV written this step included).
        targets: fresh blocks the kept tokens move into (their table replaces the row's
            on success; on failure the row stays as it was).
        context_len: the request's context after this step (what the budgets count).
        is_prompt: the compaction follows the prompt (else a periodic one).
        window: how many recent queries to keep per row (-1: every captured one).
        in_place: ``targets`` are the row's own first blocks (a full pool): the executor
            selects every layer's tokens before it writes any, so a failure leaves them
            as they were.
        kv_dropped: positions no longer in the row's KV cache (it was compacted):
            position ``p`` is written at cache index ``p - kv_dropped``, and attention
            reads ``end - kv_dropped`` cached tokens; positions (rotary) stay the original.
        kv_layer_shift: per layer, how many fewer tokens that layer holds than the
            largest (per-layer budgets); None when every layer holds as many.
    """

    capture_from: int = -1
    budgets: tuple[int, ...] | None = None
    targets: tuple[int, ...] = ()
    context_len: int = 0
    is_prompt: bool = True
    window: int = 0
    in_place: bool = False
    kv_dropped: int = 0
    kv_layer_shift: tuple[int, ...] | None = None


class CompactionResult(NamedTuple):
    """How a row's compaction went (the press runner's output item): per layer the tokens
    kept (``kept``) of ``before``, or why the press failed (``error``; the row then keeps
    its uncompressed blocks)."""

    before: tuple[int, ...] = ()
    kept: tuple[int, ...] = ()
    error: str | None = None


@attrs.define
class PressState:
    """One request's press state: the fraction of its context it keeps, how many fewer
    tokens each layer holds than the largest (None: as many), the context length at its
    last compaction, and why the press failed for it (it then stays uncompressed)."""

    keep: float
    layer_shift: tuple[int, ...] | None = None
    compacted_at: int = 0
    error: str | None = None


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
class PressSchedule(SchedulerPlugin):
    """Plans each entry's capture and compaction (see the module docstring).

    Args:
        press: the engine's press (its ``compression_ratio``, ``compress_every``,
            ``window`` and ``layer_budgets`` are read here; ``score`` runs in the executor).
        num_layers: the model's layers (``layer_budgets`` gives one budget each).
    """

    name = "kv_press"

    press: KVPress
    num_layers: int
    # Compactions since the engine last took them (for its step event).
    log: list[Compaction] = attrs.field(factory=list)
    # Per pressed request (by id): its state.
    states: dict[str, PressState] = attrs.field(factory=dict)
    _kv: Any = None

    def take_log(self) -> list[Compaction]:
        log, self.log = self.log, []
        return log

    # -- the plugin hooks ------------------------------------------------------------------

    def bind(self, scheduler: Any) -> None:
        self._kv = scheduler.kv

    def added(self, request: Request) -> None:
        keep = self.keep_for(request)
        if keep is not None:
            self.states[request.request_id] = PressState(keep)

    def begin_step(self) -> None:
        # Reservations of a step whose outputs never came back (it failed): planned again.
        self._kv.cancel_compactions()

    def plan(self, step: StepPlan) -> dict[str, PressStep] | None:
        side = {}
        for entry in step.entries:
            request = step.requests[entry.request_id]
            state = self.states.get(entry.request_id)
            if state is None:
                continue
            planned = self.step(request, entry.start, entry.start + len(entry.token_ids),
                                step.kv)
            if planned is None and not request.kv_dropped and state.layer_shift is None:
                continue
            side[entry.request_id] = (planned or PressStep())._replace(
                kv_dropped=request.kv_dropped, kv_layer_shift=state.layer_shift
            )
        return side

    def check(self, batch: Any, output: Any) -> None:
        results = output.side(self.name)
        if results is None:
            return
        sent = batch.side(self.name) or {}
        for entry, result in zip(batch.entries, results, strict=True):
            step = sent.get(entry.request_id)
            if result is not None and (step is None or step.budgets is None):
                raise ValueError(
                    f"entry {entry.request_id!r} was not asked to compact, but the executor "
                    "returned a compaction result for it"
                )

    def settle(self, request: Request, sent: Any, returned: Any) -> None:
        """Apply a compaction's outcome: the reserved blocks become the request's table,
        or go back (the press failed: the request goes on uncompressed)."""
        if sent is None or sent.budgets is None:
            return
        kept = None if returned is None or returned.error is not None else tuple(returned.kept)
        if kept is not None and len(kept) == len(sent.budgets) and all(
            0 < k <= b for k, b in zip(kept, sent.budgets, strict=True)
        ):
            self._kv.commit_compaction(request)
            self.committed(request, sent.context_len, returned.before, kept)
            return
        self._kv.cancel_compaction(request)
        reason = "the executor did not compact it" if returned is None else (
            returned.error or f"kept {returned.kept!r} for budgets {sent.budgets!r}"
        )
        self.fail(request, reason, sent.context_len)

    def forked(self, leader: Request, member: Request) -> None:
        state = self.states.get(leader.request_id)
        if state is not None:
            self.states[member.request_id] = attrs.evolve(state)

    def recompute_only(self, request: Request) -> bool:
        return request.kv_compressed  # its blocks hold the press's selection

    def preempted(self, request: Request, recomputed: bool) -> None:
        state = self.states.get(request.request_id)
        if state is not None and recomputed:  # recomputed in full, then compacted again
            state.layer_shift = None
            state.compacted_at = 0

    def finished(self, request: Request) -> None:
        self.states.pop(request.request_id, None)

    def report(self) -> list[Compaction]:
        return self.take_log()

    # -- planning ------------------------------------------------------------------------

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
        if request.request_id not in self.states:
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
        return every is not None and end - self.states[request.request_id].compacted_at >= every

    def step(self, request: Request, start: int, end: int, kv: KVCacheManager) -> PressStep | None:
        """The entry's :class:`PressStep` for span ``[start, end)``, reserving blocks for a
        compaction that is due; None when the request has nothing to do with the press."""
        state = self.states.get(request.request_id)
        if state is None or state.error is not None:
            return None
        window = self.press.query_span
        if not request.kv_compressed:
            point = request.num_tokens
            capture_from = 0 if window < 0 else max(0, point - window)
        else:
            every = self.press.compress_every
            if every is None:
                return None
            point = state.compacted_at + every
            capture_from = state.compacted_at if window < 0 else max(0, point - window)
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
        state = self.states[request.request_id]
        try:
            raw = list(press.layer_budgets(end, state.keep, self.num_layers))
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
        shift = state.layer_shift or (0,) * self.num_layers
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
        state = self.states[request.request_id]
        state.error = message
        logger.warning("%s; the request continues uncompressed", message)
        held = (context_len or request.num_computed_tokens) - request.kv_dropped
        shift = state.layer_shift or (0,) * self.num_layers
        before = tuple(held - s for s in shift)
        self.log.append(Compaction(request.request_id, context_len, before, before, message))

    def committed(
        self, request: Request, context_len: int, before: tuple[int, ...], kept: tuple[int, ...]
    ) -> None:
        """The executor compacted the request to ``kept`` tokens per layer."""
        self.log.append(Compaction(request.request_id, context_len, tuple(before), tuple(kept)))
        top = max(kept)
        state = self.states[request.request_id]
        request.kv_dropped = context_len - top
        shift = tuple(top - k for k in kept)
        state.layer_shift = shift if any(shift) else None
        request.kv_compressed = True
        state.compacted_at = context_len
