"""How many tokens to draft: the speculation-length component, chosen each step.

``lengths(candidates, num_running) -> [k, ...]``: one lookahead per candidate (a running
decode, as a read-only :class:`~llmlab.request.RequestView`), each in
``[0, num_speculative_tokens]``; 0 means that request decodes plainly this step. The
scheduler asks once per step, before it budgets the step, so the answer can depend on the
batch size. A policy that also defines ``observe(event)`` is subscribed to the engine's
step events (what was drafted and accepted, how long steps took): that is how
:class:`AdaptiveLength` learns.

Built-ins: :class:`FixedLength` (always ``k``), :class:`BatchSizeLength` (``k`` by batch
size, vLLM's ``num_speculative_tokens_per_batch_size``) and :class:`AdaptiveLength` (the
default: drafts only as far as the measured acceptance pays for the verification cost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


def _at_least_one(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@runtime_checkable
class SpeculationLength(Protocol):
    """Per-step lookahead of each running decode (see the module)."""

    num_speculative_tokens: int

    def lengths(self, candidates: Sequence[Any], num_running: int) -> Sequence[int]: ...


@attrs.define
class FixedLength:
    """Every decode drafts ``num_speculative_tokens`` tokens, every step."""

    num_speculative_tokens: int = attrs.field(validator=_at_least_one)

    def lengths(self, candidates: Sequence[Any], num_running: int) -> list[int]:
        return [self.num_speculative_tokens] * len(candidates)


def _as_table(value: Any) -> tuple[tuple[int, int], ...]:
    """``{batch_size: k}`` or ``[(batch_size, k), ...]`` as sorted pairs, checked."""
    pairs = value.items() if isinstance(value, Mapping) else value
    try:
        table = tuple(sorted((int(b), int(k)) for b, k in pairs))
    except (TypeError, ValueError):
        raise ValueError(
            "num_speculative_tokens_per_batch_size must map batch sizes to token counts, "
            f"e.g. {{1: 4, 16: 2, 64: 0}}; got {value!r}"
        ) from None
    if not table or any(b < 1 or k < 0 for b, k in table):
        raise ValueError(
            "num_speculative_tokens_per_batch_size needs batch sizes >= 1 and token counts "
            f">= 0; got {value!r}"
        )
    return table


@attrs.define
class BatchSizeLength:
    """``k`` by the number of running requests: the entry with the smallest batch size at
    or above the current one (``{1: 4, 8: 2, 32: 1}``: 4 tokens up to batch 1, 2 up to 8,
    1 up to 32, none beyond). vLLM's ``num_speculative_tokens_per_batch_size``."""

    num_speculative_tokens: int = attrs.field(validator=_at_least_one)
    table: tuple[tuple[int, int], ...] = attrs.field(converter=_as_table)

    def lengths(self, candidates: Sequence[Any], num_running: int) -> list[int]:
        k = 0
        for batch_size, tokens in self.table:
            if num_running <= batch_size:
                k = tokens
                break
        return [min(k, self.num_speculative_tokens)] * len(candidates)


@attrs.define
class AdaptiveLength:
    """Speculates where it measurably pays (the default).

    Two decisions, both from measurements in the step events:

    * **Whether to speculate at all, per batch size.** Steps are sorted into buckets by
      their number of decodes (1, 2, 3-4, 5-8, ...: powers of two). In each bucket the
      policy keeps the throughput of its last ``window`` decode steps with speculation on
      and with it off (tokens emitted over the steps' wall time: a mean, so a mode whose
      cost comes in occasional slow steps, a proposer indexing a new prompt, pays for
      them), and uses the faster
      mode; every ``explore_every`` steps of a bucket it runs ``explore_steps`` steps of
      the other one, so a change (longer contexts, better drafts) is noticed; each probe
      that confirms the choice doubles the wait before the next (up to 32 times), and
      a costly one (a proposer catching up on tokens it missed) waits until its cost is
      at most 1% of the time since. The
      first step after a switch is not measured: it carries the switch's one-off cost (a
      draft model catching up on the tokens it missed), not the mode's. Wall time counts
      everything speculation costs: proposing, the wider forward pass, verifying. So
      where drafts are poor or the batch is large enough that extra tokens are not free,
      speculation stays off except for ever rarer short probes.
    * **How far each request drafts, when on.** Each request's per-token acceptance
      ``alpha`` is estimated (a draft of ``m`` tokens with ``a`` accepted is ``a``
      successes in ``a + (a < m)`` trials; a request starts from the engine-wide estimate,
      worth ``prior_weight`` trials); position ``j`` is drafted only while ``alpha ** j >=
      min_acceptance``, the chance it is accepted. A request whose first token is
      unlikely to be accepted does not draft.

    Attributes:
        num_speculative_tokens: the most a request drafts per step.
        min_acceptance: the least acceptance probability worth drafting a position for.
        explore_every / explore_steps: probing the mode not in use.
        window: steps per mode whose throughput is compared.
    """

    num_speculative_tokens: int = attrs.field(validator=_at_least_one)
    min_acceptance: float = 0.3
    prior_weight: float = 4.0
    explore_every: int = 64
    explore_steps: int = 4
    window: int = 16
    _requests: dict[str, list[float]] = attrs.field(init=False, factory=dict)
    _accepted: float = attrs.field(init=False, default=2.0)  # engine-wide, with a prior
    _trials: float = attrs.field(init=False, default=3.0)
    _buckets: dict[int, _Bucket] = attrs.field(init=False, factory=dict)
    _pending: tuple[int, bool] | None = attrs.field(init=False, default=None)

    @property
    def alpha(self) -> float:
        """Engine-wide per-token acceptance estimate."""
        return self._accepted / self._trials

    def acceptance(self, request_id: str) -> float:
        """Per-token acceptance estimate of a request (the engine-wide one if unseen)."""
        prior = self.alpha
        stats = self._requests.get(request_id)
        if stats is None:
            return prior
        w = self.prior_weight
        return (stats[0] + w * prior) / (stats[1] + w)

    def speculating(self, batch_size: int) -> bool | None:
        """The mode chosen for steps of ``batch_size`` decodes (None: not measured yet)."""
        bucket = self._buckets.get(_bucket_of(batch_size))
        return None if bucket is None else bucket.preferred()

    def lengths(self, candidates: Sequence[Any], num_running: int) -> list[int]:
        key = _bucket_of(len(candidates))
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(inherited=self._nearest_choice(key))
        on = bucket.choose(self.explore_every, self.explore_steps)
        self._pending = (key, on)
        if not on:
            return [0] * len(candidates)
        # Runs every step for every decode: requests not yet measured share one answer.
        prior = self.alpha
        k_prior = self._k(prior)
        stats, w = self._requests, self.prior_weight
        out = []
        for view in candidates:
            own = stats.get(view.request_id)
            out.append(k_prior if own is None else self._k((own[0] + w * prior) / (own[1] + w)))
        return out

    def _nearest_choice(self, key: int) -> bool | None:
        """The mode of an adjacent bucket (half or twice the batch size) that has one, or
        None: a batch size next to a measured one starts from its choice (the tail of a
        run passes through each size for a few steps only) instead of measuring both."""
        for near in (key * 2, key // 2):
            bucket = self._buckets.get(near)
            if bucket is not None and bucket.choice() is not None:
                return bucket.choice()
        return None

    def _k(self, alpha: float) -> int:
        """The largest ``j <= num_speculative_tokens`` with ``alpha ** j >= min_acceptance``."""
        floor = self.min_acceptance
        if alpha < floor or alpha <= 0.0:
            return 0
        if alpha >= 1.0 or floor <= 0.0:
            return self.num_speculative_tokens
        return min(self.num_speculative_tokens, int(math.log(floor) / math.log(alpha) + 1e-9))

    def observe(self, event: Any) -> None:
        """Learn from a step: acceptance per request; the step's throughput in its mode."""
        for request_id, drafted, accepted in event.speculated:
            if not drafted:
                continue
            trials = accepted + (1 if accepted < drafted else 0)
            stats = self._requests.setdefault(request_id, [0.0, 0.0])
            stats[0] += accepted
            stats[1] += trials
            self._accepted += accepted
            self._trials += trials
        for request_id, _ in event.finished:
            self._requests.pop(request_id, None)
        for request_id in event.aborted:
            self._requests.pop(request_id, None)
        pending, self._pending = self._pending, None
        if pending is None or not event.scheduled or event.num_prefill_tokens:
            return  # only decode steps compare the two modes fairly
        key, on = pending
        tokens = sum(n for _, n in event.sampled)
        if tokens and event.wall_time_s > 0:
            self._buckets[key].record(on, tokens, event.wall_time_s, self.window)


# The most of the time that probes confirming the choice in use may take.
PROBE_BUDGET = 0.01


def _bucket_of(batch_size: int) -> int:
    """1, 2, 3-4 -> 4, 5-8 -> 8, ...: steps of about the same cost share a bucket."""
    return 1 << max(0, (batch_size - 1).bit_length())


@attrs.define
class _Bucket:
    """Throughput with speculation on and off for one batch-size bucket."""

    inherited: bool | None = None  # a neighbour bucket's choice, until this one has its own
    # Per mode (off, on): ``(tokens, seconds)`` of its last measured steps.
    rates: tuple[list, list] = attrs.field(factory=lambda: ([], []))
    seen: list[int] = attrs.field(factory=lambda: [0, 0])
    last: bool | None = None  # the mode of the bucket's previous step
    switched: bool = False  # this step's mode differs from the previous one's
    until_probe: int = 0
    backoff: int = 1
    _probe_left: int = 0
    _probe_from: bool | None = None
    # What the current probe's steps took (switch included), settled once it confirms.
    _probing: bool = False
    _probe_seconds: float = 0.0
    _probe_steps: int = 0
    _settle: bool = False

    @property
    def rate(self) -> list[float | None]:
        """Recent throughput ``[off, on]`` in tokens/s (None: not measured)."""
        return [
            sum(t for t, _ in r) / sum(s for _, s in r) if r else None for r in self.rates
        ]

    def preferred(self) -> bool | None:
        off, on = self.rate
        if off is None or on is None:
            return None
        return on > off

    def choice(self) -> bool | None:
        """Its own preference once measured, else the one it inherited."""
        own = self.preferred()
        return self.inherited if own is None else own

    def choose(self, explore_every: int, explore_steps: int) -> bool:
        mode = self._mode(explore_every, explore_steps)
        self.switched = self.last is not None and mode != self.last
        self.last = mode
        return mode

    def _mode(self, explore_every: int, explore_steps: int) -> bool:
        need = explore_steps - 1  # a burst's first step is not measured
        measured = self.seen[0] >= need and self.seen[1] >= need
        if measured:
            best = bool(self.preferred())
        elif self.inherited is None:
            # The first bucket: measure both now, some steps on, then some off.
            return self.seen[1] < need
        else:
            # Start from the neighbour's choice; the probes below measure the other mode.
            best = self.inherited
            if self.until_probe <= 0 and not self._probe_left and self._probe_from is None:
                self.until_probe = explore_every
        self._probing = False
        if self._probe_left:
            self._probe_left -= 1
            if not self._probe_left:  # the probe is over: was the choice confirmed?
                confirmed = bool(self.preferred()) == self._probe_from
                self.backoff = min(self.backoff * 2, 32) if confirmed else 1
                self.until_probe = explore_every * self.backoff
                self._settle = confirmed
            self._probing = True
            return not self._probe_from
        self.until_probe -= 1
        if self.until_probe <= 0:
            self._probe_from = best
            self._probe_left = explore_steps  # this step and explore_steps more
            self.rates[int(not best)].clear()  # measured long ago: judge by the probe alone
            self._probing = True
            self._probe_seconds, self._probe_steps = 0.0, 0
            return not best
        return best

    def record(self, on: bool, tokens: int, seconds: float, window: int) -> None:
        if self._probing:
            self._probe_seconds += seconds
            self._probe_steps += 1
        elif self._settle and not self.switched:
            # A confirming probe cost more than as many steps of the mode in use (a
            # proposer catching up on everything it missed, say): wait long enough that
            # such probes cost at most PROBE_BUDGET of the time.
            self._settle = False
            steps = self.rates[int(on)]
            mean = sum(s for _, s in steps) / len(steps) if steps else seconds
            extra = self._probe_seconds - self._probe_steps * mean
            if extra > 0:
                self.until_probe = max(self.until_probe, int(extra / (PROBE_BUDGET * mean)))
        if self.switched:
            return  # a switch's one-off cost is not the mode's
        rates = self.rates[int(on)]
        rates.append((tokens, seconds))
        if len(rates) > window:
            del rates[0]
        self.seen[int(on)] += 1
