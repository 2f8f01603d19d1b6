"""What the views draw, computed from step events alone (no widgets, no engine access).

:class:`KVCacheState` starts from an :class:`~llmlab.observe.events.EngineSnapshot` and
applies each :class:`~llmlab.observe.events.StepEvent`; its :meth:`~KVCacheState.frame` is an
immutable picture of the block pool. Live views and replays of a recording run exactly this
code on exactly these inputs, so a replayed frame equals the live one.

:class:`SchedulerSeries` and :class:`MetricSeries` do the same for the timeline and the
metrics panel: per-step rows, and per-request latencies.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import attrs
import numpy as np

from llmlab.observe.events import EngineSnapshot, StepEvent

# Block states in a frame.
EMPTY, CACHED, USED, SHARED = 0, 1, 2, 3
STATE_NAMES = ("empty", "cached", "used", "shared")


def _array_eq(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


@attrs.frozen(eq=False)
class Frame:
    """The block pool after one step.

    Attributes:
        step_index: the step the frame follows (``-1``: the snapshot a view started from).
        time_s: the engine clock at the end of that step.
        block_size: tokens per block.
        state: per block, :data:`EMPTY` (holds nothing), :data:`CACHED` (free, but its KV is
            still in the prefix cache and can be hit), :data:`USED` (held by one request)
            or :data:`SHARED` (held by several: a prefix hit or a parallel sample).
        owner: per block, index into ``requests`` of the request that has held it longest
            (``-1``: none).
        refs: per block, how many requests hold it.
        tokens: per block, tokens of KV it stores (a cached block is full).
        indexed: per block, whether the prefix cache can find it.
        requests: request ids by index; an id keeps its index (and so its color) for the
            whole run.
        num_running / num_waiting: queue lengths after the step.
        num_offload_blocks / offload_cached: the prefix cache's second tier (host memory
            or disk): its size and how many of its blocks hold content (0 / 0: none).
        num_swap_blocks / swap_used: the swap space of preempted requests and how many of
            its blocks hold swapped KV (0 / 0: none).
        compacted: per block, whether a request holding it had its KV compacted by a KV
            press (:mod:`llmlab.kvpress`): the block holds the press's selection, not every
            position (all False without a press).
        kept_ratio: per compacted request, the tokens its KV cache holds over its context
            (``(num_computed - kv_dropped) / num_computed``, in the layer that keeps most:
            what its blocks hold); a request absent keeps everything.
        context_tokens: per compacted request, its context (``num_computed``): the
            denominator of ``kept_ratio``.
    """

    step_index: int
    time_s: float
    block_size: int
    state: np.ndarray
    owner: np.ndarray
    refs: np.ndarray
    tokens: np.ndarray
    indexed: np.ndarray
    requests: tuple[str, ...]
    num_running: int = 0
    num_waiting: int = 0
    num_offload_blocks: int = 0
    offload_cached: int = 0
    num_swap_blocks: int = 0
    swap_used: int = 0
    compacted: np.ndarray = attrs.field(
        default=attrs.Factory(lambda self: np.zeros(self.state.shape, bool), takes_self=True)
    )
    kept_ratio: dict[str, float] = attrs.field(factory=dict)
    context_tokens: dict[str, int] = attrs.field(factory=dict)

    @property
    def num_blocks(self) -> int:
        return int(self.state.shape[0])

    def counts(self) -> dict[str, int]:
        """Blocks per state: ``{"empty": .., "cached": .., "used": .., "shared": ..}``."""
        bins = np.bincount(self.state, minlength=4)
        return {name: int(bins[i]) for i, name in enumerate(STATE_NAMES)}

    @property
    def num_in_use(self) -> int:
        """Blocks held by at least one request (the colored cells)."""
        return int(np.count_nonzero(self.refs))

    def owner_ids(self) -> list[str | None]:
        """The owning request's id per block (None when free)."""
        return [self.requests[o] if o >= 0 else None for o in self.owner.tolist()]

    def blocks_of(self, request_id: str) -> list[int]:
        """Blocks whose owner is ``request_id`` (shared blocks it joined later excluded)."""
        try:
            index = self.requests.index(request_id)
        except ValueError:
            return []
        return np.flatnonzero(self.owner == index).tolist()

    def describe(self, block: int) -> str:
        """One line about a block, as the hover text shows it."""
        state = int(self.state[block])
        owner = int(self.owner[block])
        parts = [f"block {block}"]
        if owner >= 0:
            refs = int(self.refs[block])
            who = self.requests[owner]
            parts.append(who if refs == 1 else f"{who} (+{refs - 1} sharing)")
        else:
            parts.append("free, in the prefix cache" if state == CACHED else "empty")
        if state != EMPTY:
            parts.append(f"{int(self.tokens[block])}/{self.block_size} tokens")
            parts.append(f"refs {int(self.refs[block])}")
        if self.indexed[block] and owner >= 0:
            parts.append("in the prefix cache")
        if self.compacted[block]:
            parts.append(self._compaction_note(block))
        return " · ".join(parts)

    def _compaction_note(self, block: int) -> str:
        """``compacted (kept 42% of 120 tokens)``: the owner's ratio (a compacted block's
        first holder is the compacted request, then the parallel samples that share it)."""
        owner = int(self.owner[block])
        rid = self.requests[owner] if owner >= 0 else None
        if rid in self.kept_ratio and rid in self.context_tokens:
            ratio, context = self.kept_ratio[rid], self.context_tokens[rid]
            return f"compacted (kept {ratio:.0%} of {context} tokens)"
        return "compacted"  # a sample not scheduled yet: its counts are not known

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return (
            self.step_index == other.step_index
            and self.block_size == other.block_size
            and _array_eq(self.state, other.state)
            and _array_eq(self.refs, other.refs)
            and _array_eq(self.tokens, other.tokens)
            and _array_eq(self.indexed, other.indexed)
            and (self.offload_cached, self.swap_used) == (other.offload_cached, other.swap_used)
            # Compare owners by id: two views may have met requests in a different order.
            and self.owner_ids() == other.owner_ids()
            and _array_eq(self.compacted, other.compacted)
            and self.kept_ratio == other.kept_ratio
            and self.context_tokens == other.context_tokens
        )

    __hash__ = None  # mutable arrays inside


class KVCacheState:
    """The block pool followed through step events (the model behind ``KVCacheView``).

    Cost per event is proportional to the blocks and requests the event touches, not to
    the pool size, so watching a large pool stays cheap.

    KV presses: a request counts as compacted from a ``kv_compacted`` entry without error
    (a press at ratio 0 compacts and drops nothing), a positive ``kv_dropped``, or the
    snapshot's ``kv_dropped``; a parallel sample that takes a compacted block by reference
    is compacted too (compacted blocks never enter the prefix index, so a fork is the only
    way to share one). It is forgotten when it holds no blocks any more or is preempted (it
    is recomputed uncompressed, and compacted again later).
    """

    def __init__(self, snapshot: EngineSnapshot) -> None:
        n = snapshot.num_blocks
        self.block_size = snapshot.block_size
        self.step_index = snapshot.step_index - 1
        self.time_s = snapshot.time_s
        self.num_running = snapshot.num_running
        self.num_waiting = snapshot.num_waiting
        self.refs = np.zeros(n, np.int32)
        self.indexed = np.asarray(snapshot.kv.cached, bool).copy()
        self.tokens = np.zeros(n, np.int32)
        self.owner = np.full(n, -1, np.int32)
        self.requests: list[str] = []
        self._index: dict[str, int] = {}
        # Holders of each held block, in the order they took it (the first is the owner).
        self._holders: dict[int, list[int]] = {}
        self._tables: dict[str, tuple[int, ...]] = {}
        self._computed: dict[str, int] = dict(snapshot.num_computed)
        self._arange = np.arange(0, 1, dtype=np.int64)
        # KV presses: positions each compacted request's cache no longer holds (only the
        # nonzero ones), the compacted requests, and per block how many of them hold it.
        self._dropped: dict[str, int] = {}
        self._compacted: set[str] = set()
        self._compacted_refs = np.zeros(n, np.int32)
        self._apply_tables(snapshot.kv.block_tables.items())
        for rid, dropped in snapshot.kv_dropped.items():  # every compacted request
            if rid in self._tables:
                if dropped:
                    self._dropped[rid] = dropped
                self._mark(rid)
        self._inherit(snapshot.kv.block_tables)
        self._refill(snapshot.kv.block_tables)
        self.tokens[(self.refs == 0) & self.indexed] = self.block_size
        # The host tiers: which second-tier blocks hold content; swap space in use.
        self.offload_indexed = np.zeros(snapshot.num_offload_blocks, bool)
        self.offload_indexed[list(snapshot.offload_cached)] = True
        self.num_swap_blocks = snapshot.num_swap_blocks
        self.swap_used = snapshot.num_swap_blocks_used

    # -- applying events ---------------------------------------------------------------

    def apply(self, event: StepEvent) -> None:
        """Move the state past one step."""
        if event.blocks_evicted:
            self.indexed[list(event.blocks_evicted)] = False
        if event.blocks_cached:
            self.indexed[list(event.blocks_cached)] = True
        # Press bookkeeping around the tables: a preempted request is recomputed in full
        # (forget it first; today its table also empties in this event, which forgets it
        # too, but a swap that kept its table must not keep the mark); a compaction is
        # marked on the table it had, which the new table then replaces block by block.
        for rid in event.preempted:
            self._unmark(rid)
            self._dropped.pop(rid, None)
        for compaction in event.kv_compacted:
            if compaction.error is None:
                self._mark(compaction.request_id)
        touched = self._apply_tables(event.block_tables)
        # ``kv_dropped`` is empty on a step where no scheduled request had dropped any.
        dropped = event.kv_dropped or (0,) * len(event.scheduled)
        for (rid, _), n, d in zip(event.scheduled, event.num_computed, dropped, strict=False):
            if rid in self._tables:
                self._computed[rid] = n
                if d:
                    self._dropped[rid] = d
                    self._mark(rid)
                else:
                    self._dropped.pop(rid, None)
                touched.add(rid)
        self._inherit(touched)
        self._refill(touched)
        # Freed blocks: a cached one keeps its (full) content; the others are empty.
        changed = list(event.blocks_freed) + list(event.blocks_evicted)
        if changed:
            ids = np.asarray(changed, np.int64)
            free = ids[self.refs[ids] == 0]
            self.tokens[free] = np.where(self.indexed[free], self.block_size, 0)
        self.step_index = event.step_index
        self.time_s = event.end_time_s
        self.num_running = event.num_running
        self.num_waiting = event.num_waiting
        if event.offload_blocks_evicted:
            self.offload_indexed[list(event.offload_blocks_evicted)] = False
        if event.blocks_spilled:
            self.offload_indexed[[tier for _, tier in event.blocks_spilled]] = True
        self.swap_used = event.num_swap_blocks_used

    def _apply_tables(self, tables: Iterable[tuple[str, tuple[int, ...]]]) -> set[str]:
        """Swap each request's old table for its new one; return the requests to refill."""
        touched: set[str] = set()
        for rid, table in tables:
            index = self._index.get(rid)
            if index is None:
                index = self._index[rid] = len(self.requests)
                self.requests.append(rid)
            old = self._tables.pop(rid, ())
            # Only the difference moves: a request keeps its place among a block's holders
            # (and so its ownership) while its table grows.
            kept = set(old).intersection(table)
            if rid in self._compacted:
                self._compacted_refs[[b for b in old if b not in kept]] -= 1
                self._compacted_refs[[b for b in table if b not in kept]] += 1
            for block in old:
                if block in kept:
                    continue
                holders = self._holders[block]
                holders.remove(index)
                self.refs[block] -= 1
                if holders:
                    if self.owner[block] == index:
                        self.owner[block] = holders[0]
                        touched.add(self.requests[holders[0]])
                else:
                    del self._holders[block]
                    self.owner[block] = -1
            for block in table:
                if block in kept:
                    continue
                holders = self._holders.setdefault(block, [])
                if not holders:
                    self.owner[block] = index
                holders.append(index)
                self.refs[block] += 1
            if table:
                self._tables[rid] = tuple(table)
                touched.add(rid)
            else:  # it left (finished, aborted, preempted): forget it
                self._computed.pop(rid, None)
                self._dropped.pop(rid, None)
                self._compacted.discard(rid)
        return touched

    def _mark(self, rid: str) -> None:
        """``rid``'s KV was compacted: its blocks (now and later) are compacted blocks."""
        if rid in self._compacted:
            return
        self._compacted.add(rid)
        table = self._tables.get(rid)
        if table:
            self._compacted_refs[list(table)] += 1

    def _unmark(self, rid: str) -> None:
        if rid not in self._compacted:
            return
        self._compacted.discard(rid)
        table = self._tables.get(rid)
        if table:
            self._compacted_refs[list(table)] -= 1

    def _inherit(self, request_ids: Iterable[str]) -> None:
        """A request holding a block of a compacted one is a parallel sample of it: its
        KV is the press's selection too (checked once every table of the event is in, so
        the order of ``block_tables`` does not matter)."""
        for rid in request_ids:
            table = self._tables.get(rid)
            if table and rid not in self._compacted and self._compacted_refs[list(table)].any():
                self._mark(rid)

    def _refill(self, request_ids: Iterable[str]) -> None:
        """Recompute tokens per block for the blocks these requests own."""
        bs = self.block_size
        for rid in request_ids:
            table = self._tables.get(rid)
            if not table:
                continue
            ids = np.asarray(table, np.int64)
            if self._arange.shape[0] < ids.shape[0]:
                self._arange = np.arange(max(ids.shape[0], 2 * self._arange.shape[0]))
            # What the blocks hold: the computed tokens less those a KV press dropped.
            cached = self._computed.get(rid, 0) - self._dropped.get(rid, 0)
            fill = np.clip(cached - self._arange[: ids.shape[0]] * bs, 0, bs)
            # An indexed block is full by construction (only full blocks are indexed).
            fill = np.where(self.indexed[ids], bs, fill)
            mine = self.owner[ids] == self._index[rid]
            self.tokens[ids[mine]] = fill[mine]

    # -- reading -----------------------------------------------------------------------

    def frame(self) -> Frame:
        """An immutable copy of the pool now."""
        refs = self.refs.copy()
        context = {r: c for r in self._compacted if (c := self._computed.get(r, 0)) > 0}
        state = np.where(refs > 1, SHARED, np.where(refs == 1, USED, EMPTY)).astype(np.int8)
        state[(refs == 0) & self.indexed] = CACHED
        frame = Frame(
            step_index=self.step_index,
            time_s=self.time_s,
            block_size=self.block_size,
            state=state,
            owner=self.owner.copy(),
            refs=refs,
            tokens=self.tokens.copy(),
            indexed=self.indexed.copy(),
            requests=tuple(self.requests),
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_offload_blocks=int(self.offload_indexed.shape[0]),
            offload_cached=int(np.count_nonzero(self.offload_indexed)),
            num_swap_blocks=self.num_swap_blocks,
            swap_used=self.swap_used,
            compacted=self._compacted_refs > 0,
            kept_ratio={r: (c - self._dropped.get(r, 0)) / c for r, c in context.items()},
            context_tokens=context,
        )
        arrays = (frame.state, frame.owner, frame.refs, frame.tokens, frame.indexed,
                  frame.compacted)
        for array in arrays:
            array.flags.writeable = False
        return frame

    def copy(self) -> KVCacheState:
        return copy.deepcopy(self)


@attrs.define
class SchedulerSeries:
    """Per-step queue lengths and batch composition (the timeline's data).

    Columns (lists of equal length, one entry per step that ran a batch): ``step``,
    ``time_s``, ``running``, ``waiting``, ``preempted`` (requests preempted and not yet
    resumed), ``prefill_tokens``, ``decode_tokens``, ``preemptions`` (this step).
    """

    step: list[int] = attrs.field(factory=list)
    time_s: list[float] = attrs.field(factory=list)
    running: list[int] = attrs.field(factory=list)
    waiting: list[int] = attrs.field(factory=list)
    preempted: list[int] = attrs.field(factory=list)
    prefill_tokens: list[int] = attrs.field(factory=list)
    decode_tokens: list[int] = attrs.field(factory=list)
    preemptions: list[int] = attrs.field(factory=list)
    _out: set[str] = attrs.field(factory=set)

    def apply(self, event: StepEvent) -> None:
        self._out.update(event.preempted)
        for admission in event.admitted:
            self._out.discard(admission.request_id)
        for rid in event.aborted:
            self._out.discard(rid)
        for rid, _ in event.finished:
            self._out.discard(rid)
        if not event.scheduled and not event.preempted:
            return
        self.step.append(event.step_index)
        self.time_s.append(event.end_time_s)
        self.running.append(event.num_running)
        self.waiting.append(event.num_waiting)
        self.preempted.append(len(self._out))
        self.prefill_tokens.append(event.num_prefill_tokens)
        self.decode_tokens.append(event.num_batched_tokens - event.num_prefill_tokens)
        self.preemptions.append(len(event.preempted))

    def __len__(self) -> int:
        return len(self.step)


@attrs.define
class MetricSeries:
    """Request latencies and cache use, from events (the metrics panel's data).

    ``ttft_s`` / ``tpot_s``: per finished request (arrival to first token; mean time per
    later token). ``time_s``, ``kv_usage`` and ``hit_rate`` (prefix-cache tokens hit over
    tokens looked up, cumulative) per step.
    """

    ttft_s: list[float] = attrs.field(factory=list)
    tpot_s: list[float] = attrs.field(factory=list)
    time_s: list[float] = attrs.field(factory=list)
    kv_usage: list[float] = attrs.field(factory=list)
    hit_rate: list[float] = attrs.field(factory=list)
    queried_tokens: int = 0
    hit_tokens: int = 0
    _arrival: dict[str, float] = attrs.field(factory=dict)
    _first: dict[str, float] = attrs.field(factory=dict)
    _count: dict[str, int] = attrs.field(factory=dict)

    def apply(self, event: StepEvent) -> None:
        for arrival in event.arrived:
            self._arrival.setdefault(arrival.request_id, arrival.arrival_time)
        for admission in event.admitted:
            self._arrival.setdefault(admission.request_id, admission.arrival_time)
            self.queried_tokens += admission.num_queried_tokens
            self.hit_tokens += admission.num_cached_tokens
        for rid, k in event.sampled:
            self._first.setdefault(rid, event.end_time_s)
            self._count[rid] = self._count.get(rid, 0) + k
        for rid, _ in event.finished:
            arrival = self._arrival.pop(rid, None)
            first = self._first.pop(rid, None)
            count = self._count.pop(rid, 0)
            if arrival is None or first is None:
                continue  # aborted before its first token, or it arrived before we looked
            self.ttft_s.append(first - arrival)
            if count > 1:
                self.tpot_s.append((event.end_time_s - first) / (count - 1))
        for rid in event.aborted:
            self._arrival.pop(rid, None)
            self._first.pop(rid, None)
            self._count.pop(rid, None)
        if event.scheduled or event.blocks_freed:
            self.time_s.append(event.end_time_s)
            self.kv_usage.append(event.kv_usage)
            rate = self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
            self.hit_rate.append(rate)
