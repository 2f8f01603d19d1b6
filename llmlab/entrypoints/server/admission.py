"""Admission by work: the server's bounds on what it holds in flight.

A request is weighed before anything of it is tokenized: its engine requests (one per
prompt), its sequences (prompts x ``max(n, best_of)``) and its tokens (each prompt's tokens
plus its sequences x ``max_tokens``). :meth:`Admission.admit` checks that weight against
what is in flight and reserves it in one step, under one lock, so a flood cannot pass the
bound between a check and an add. A request that does not fit is answered 429 with
``Retry-After`` there and then: the check reads three counters and never waits for the
engine loop (whose lock a busy step may hold).

What was reserved is given back as each engine request's stream ends (finished, failed or
aborted; :meth:`~llmlab.entrypoints.async_engine.RequestStream.add_done_callback`), or at once
for whatever never reached the engine. Prompt tokens are not known before tokenizing, so
the first reservation uses an estimate and :meth:`Ticket.settle` replaces it with the exact
weight per prompt (a 429 then if the exact weight no longer fits).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs

from llmlab.entrypoints.server.errors import APIError

# Retry-After on a 429: a bound frees as requests finish, typically within a second or two.
RETRY_AFTER_S = 1


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class Weight:
    """What one request, or one of its prompts, holds while in flight."""

    requests: int = 0
    sequences: int = 0
    tokens: int = 0

    def __add__(self, other: Weight) -> Weight:
        return Weight(self.requests + other.requests, self.sequences + other.sequences,
                      self.tokens + other.tokens)

    def __sub__(self, other: Weight) -> Weight:
        return Weight(self.requests - other.requests, self.sequences - other.sequences,
                      self.tokens - other.tokens)


@attrs.define(eq=False)
class Admission:
    """Bounds on the work in flight (queued or running), shared by every route.

    Attributes:
        max_sequences: sequences in flight; a prompt with ``n=256`` is 256 of them.
        max_tokens: prompt tokens plus the tokens sequences may still generate
            (``max_tokens`` each), in flight.
    """

    max_sequences: int = attrs.field(default=4096, validator=_positive)
    max_tokens: int = attrs.field(default=4 * 2**20, validator=_positive)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock, repr=False)
    _held: Weight = attrs.field(init=False, factory=Weight)

    @property
    def held(self) -> Weight:
        """What is reserved now."""
        return self._held

    def admit(self, *parts: Weight) -> Ticket:
        """Reserve the request whose prompts weigh ``parts`` (one part: a whole-request
        estimate, for :meth:`Ticket.settle`), or raise a 429 :class:`APIError` naming the
        bound it would pass. The check and the reservation are one step."""
        weight = sum(parts, Weight())
        with self._lock:
            self._check(weight)
            self._held = self._held + weight
        return Ticket(self, parts)

    def full_reason(self) -> str | None:
        """Why no request at all fits now (the smallest is one sequence of two tokens),
        or None. ``/health`` says it; the routes refuse before reading the body."""
        held = self._held  # one read of an immutable value: no lock needed
        if held.sequences >= self.max_sequences:
            return f"{held.sequences} sequences in flight (at most {self.max_sequences})"
        if held.tokens + 2 > self.max_tokens:
            return f"{held.tokens} tokens in flight (at most {self.max_tokens})"
        return None

    def _check(self, weight: Weight) -> None:
        # A request larger than a bound on its own would be refused forever: a 400.
        if weight.sequences > self.max_sequences:
            raise APIError(f"the request needs {weight.sequences} sequences, more than the "
                           f"{self.max_sequences} this server holds at once", param="n")
        if weight.tokens > self.max_tokens:
            raise APIError(f"the request needs {weight.tokens} tokens (prompt + max_tokens "
                           f"per sequence), more than the {self.max_tokens} this server "
                           "holds at once", param="max_tokens")
        held = self._held
        if held.sequences + weight.sequences > self.max_sequences:
            raise busy(f"{weight.sequences} more sequence(s) would pass the server's bound "
                       f"({held.sequences} in flight, at most {self.max_sequences})")
        if held.tokens + weight.tokens > self.max_tokens:
            raise busy(f"{weight.tokens} more token(s) (prompt + max_tokens per sequence) "
                       f"would pass the server's bound ({held.tokens} in flight, at most "
                       f"{self.max_tokens})")

    def _resize(self, old: Weight, new: Weight) -> None:
        with self._lock:
            grown = new - old
            if grown.sequences > 0 or grown.tokens > 0:
                self._held = self._held - old
                try:
                    self._check(new)
                finally:
                    self._held = self._held + old
            self._held = self._held - old + new

    def _release(self, weight: Weight) -> None:
        with self._lock:
            self._held = self._held - weight


def default_max_tokens(max_sequences: int, max_model_len: int) -> int:
    """The token bound when none is given: an eighth of the sequence bound at full context
    (a request without ``max_tokens`` weighs its whole context), and at least 4 Mi tokens,
    so with short contexts the sequence bound is the one that binds."""
    return max(4 * 2**20, max_sequences * max_model_len // 8)


def busy(message: str) -> APIError:
    """The 429 every bound answers with."""
    return APIError(f"the server is at capacity: {message}; retry shortly", status=429,
                    type="rate_limit_exceeded", code="server_busy",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class Ticket:
    """One request's reservation: first a whole, then (after :meth:`settle`) one part per
    prompt. A part handed to a stream (:meth:`attach`) is released when that stream ends;
    :meth:`release` gives back the rest. Releasing is idempotent and thread-safe (streams
    end on the engine loop's thread)."""

    def __init__(self, admission: Admission, parts: Sequence[Weight]) -> None:
        self._admission = admission
        self._lock = threading.Lock()
        self._parts: list[Weight | None] = list(parts)
        self._attached: set[int] = set()

    def settle(self, parts: Sequence[Weight]) -> None:
        """Replace the estimate with the exact weight of each prompt (a 429 if the total
        grew past a bound; the estimate stays held then, for :meth:`release`)."""
        with self._lock:
            old = sum((w for w in self._parts if w is not None), Weight())
            new = sum(parts, Weight())
            self._admission._resize(old, new)
            self._parts = list(parts)

    def attach(self, stream, index: int) -> None:
        """Prompt ``index``'s part now ends with ``stream`` (a
        :class:`~llmlab.entrypoints.async_engine.RequestStream`)."""
        with self._lock:
            self._attached.add(index)
        stream.add_done_callback(lambda: self._release_part(index))

    def _release_part(self, index: int) -> None:
        with self._lock:
            part, self._parts[index] = self._parts[index], None
        if part is not None:
            self._admission._release(part)

    def release(self) -> None:
        """Give back every part no stream holds (the request failed, or ended before
        reaching the engine); the attached ones go when their streams end."""
        with self._lock:
            total = Weight()
            for i, part in enumerate(self._parts):
                if part is not None and i not in self._attached:
                    total = total + part
                    self._parts[i] = None
        if total != Weight():
            self._admission._release(total)
