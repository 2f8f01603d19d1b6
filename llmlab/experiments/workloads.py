"""Workloads: timed, tokenized requests, and seeded generators of the usual shapes.

A :class:`Workload` is a tuple of :class:`WorkloadRequest` sorted by arrival time (seconds
from the start). The generators draw everything from ``numpy.random.default_rng(seed)``, so
the same arguments give the same workload, and prompts are token ids drawn uniformly from
``[low, vocab_size)`` (no tokenizer needed; read ``vocab_size`` from the model's
``config.json`` and raise ``low`` to keep special tokens out). Arrivals are an open-loop
Poisson process at ``rate`` requests/s; ``rate=None`` or ``math.inf`` puts every request at
t=0. Lengths are an ``int`` or an inclusive ``(min, max)`` range drawn uniformly per use.

Shapes:

* :func:`shared_prefix_chat`: multi-turn chats sharing one system prompt; turn k repeats the
  whole conversation so far, so it shares every earlier turn as a prefix.
* :func:`few_shot`: a few long few-shot templates, each request one of them plus a short
  question.
* :func:`mixed_long_short`: long and short requests in a given proportion.
* :func:`multi_tenant`: a heavy and a light user with different rates and the same lengths
  (the setting of Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import attrs
import numpy as np

from llmlab.validation import as_int, as_real, as_str, as_token_ids

LengthSpec = int | tuple[int, int]
"""A length: exactly ``n``, or uniform over the inclusive range ``(min, max)``."""


def _user(value: object) -> str | None:
    return as_str("user", value, allow_none=True)


def _prompt(value: object) -> tuple[int, ...]:
    token_ids = as_token_ids("prompt_token_ids", value)
    if not token_ids:
        raise ValueError("prompt_token_ids must hold at least one token id, got ()")
    return tuple(token_ids)


@attrs.frozen
class WorkloadRequest:
    """One request of a workload.

    Attributes:
        arrival_time: seconds from the start of the workload (>= 0).
        prompt_token_ids: the prompt, as token ids (at least one).
        max_tokens: tokens to generate (the run ignores EOS, so exactly this many).
        user: who sends it, for per-user policies and metrics (None: nobody in particular).
        priority: lower is served first by policies that read it (vLLM's semantics).
        session: the conversation it belongs to (None: unknown), for routers that keep a
            session on one replica.
    """

    arrival_time: float = attrs.field(
        converter=functools.partial(as_real, "arrival_time", min=0)
    )
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_prompt)
    max_tokens: int = attrs.field(converter=functools.partial(as_int, "max_tokens", min=1))
    user: str | None = attrs.field(default=None, converter=_user)
    priority: int = attrs.field(default=0, converter=functools.partial(as_int, "priority"))
    session: str | None = attrs.field(default=None, converter=functools.partial(
        as_str, "session", allow_none=True))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def _sorted_requests(requests: Sequence[WorkloadRequest]) -> tuple[WorkloadRequest, ...]:
    requests = tuple(requests)
    for i, request in enumerate(requests):
        if not isinstance(request, WorkloadRequest):
            raise TypeError(
                f"requests[{i}] must be a WorkloadRequest, got {type(request).__name__}"
            )
    # Stable, so requests arriving together keep their given order (turns of a chat).
    return tuple(sorted(requests, key=lambda r: r.arrival_time))


@attrs.frozen
class Workload:
    """A named tuple of requests, sorted by arrival time (stable for equal times)."""

    name: str = attrs.field(converter=functools.partial(as_str, "name"))
    requests: tuple[WorkloadRequest, ...] = attrs.field(converter=_sorted_requests)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def users(self) -> tuple[str | None, ...]:
        """Distinct users in order of first arrival (None included if some request has it)."""
        return tuple(dict.fromkeys(r.user for r in self.requests))

    @property
    def duration_s(self) -> float:
        """Arrival time of the last request (0 for an empty workload)."""
        return self.requests[-1].arrival_time if self.requests else 0.0

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        """Tokens the workload asks for (the sum of ``max_tokens``)."""
        return sum(r.max_tokens for r in self.requests)

    def to_pandas(self):
        """One row per request: arrival_time, num_prompt_tokens, max_tokens, user,
        priority, prompt_token_ids."""
        import pandas as pd

        return pd.DataFrame(
            {
                "arrival_time": [r.arrival_time for r in self.requests],
                "num_prompt_tokens": [r.num_prompt_tokens for r in self.requests],
                "max_tokens": [r.max_tokens for r in self.requests],
                "user": [r.user for r in self.requests],
                "priority": [r.priority for r in self.requests],
                "prompt_token_ids": [r.prompt_token_ids for r in self.requests],
            }
        )


# -- argument checks ---------------------------------------------------------------------


def _rate(value: object) -> float | None:
    """Requests/s, or None for "all at t=0" (``None`` or ``math.inf``)."""
    if value is None or (isinstance(value, (int, float)) and value == math.inf):
        return None
    return as_real(
        "rate", value, min=0, min_inclusive=False,
        allowed="> 0 (requests/s), or None or math.inf for all at t=0",
    )


def _length(field: str, value: object) -> tuple[int, int]:
    allowed = "an int >= 1 or a (min, max) pair of ints with 1 <= min <= max"
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{field} must be {allowed}, got {value!r}")
        lo = as_int(f"{field}[0]", value[0], min=1)
        hi = as_int(f"{field}[1]", value[1], min=1)
        if lo > hi:
            raise ValueError(f"{field} must be {allowed}, got {value!r} (min > max)")
        return lo, hi
    n = as_int(field, value, min=1, allowed=allowed)
    return n, n


def _vocab(vocab_size: object, low: object) -> tuple[int, int]:
    vocab_size = as_int("vocab_size", vocab_size, min=1)
    low = as_int("low", low, min=0, max=vocab_size - 1,
                 allowed=f"an int in [0, vocab_size) = [0, {vocab_size})")
    return vocab_size, low


def _seed(seed: object) -> np.random.Generator:
    return np.random.default_rng(as_int("seed", seed, min=0))


# -- drawing -----------------------------------------------------------------------------


def _arrivals(rng: np.random.Generator, n: int, rate: float | None) -> np.ndarray:
    if rate is None or n == 0:
        return np.zeros(n)
    # The first request at t=0, then exponential gaps (as vLLM's benchmark_serving sends).
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def _lengths(rng: np.random.Generator, spec: tuple[int, int], n: int) -> list[int]:
    lo, hi = spec
    return rng.integers(lo, hi + 1, size=n).tolist()


def _tokens(rng: np.random.Generator, n: int, low: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.integers(low, vocab_size, size=n).tolist())


def poisson_arrivals(n: int, rate: float | None, seed: int = 0) -> np.ndarray:
    """``n`` sorted arrival times (s) of a Poisson process at ``rate`` requests/s.

    The first arrival is at 0 and the gaps are exponential with mean ``1 / rate``, so the
    measured rate ``(n - 1) / last`` tends to ``rate``. ``rate=None`` or ``math.inf``: all 0.
    """
    n = as_int("n", n, min=0)
    return _arrivals(_seed(seed), n, _rate(rate))


# -- generators --------------------------------------------------------------------------


def shared_prefix_chat(
    num_conversations: int = 8,
    num_turns: int = 4,
    *,
    vocab_size: int,
    system_prompt_len: LengthSpec = 64,
    user_turn_len: LengthSpec = 16,
    output_len: LengthSpec = 16,
    rate: float | None = None,
    seed: int = 0,
    low: int = 0,
) -> Workload:
    """Multi-turn chats that all start with the same system prompt.

    Turn ``k`` of a conversation (1-based) is one request whose prompt is the system
    prompt, then turns ``1 .. k-1`` (each a user message and a synthetic assistant reply
    of that turn's ``max_tokens``), then the new user message; so it shares the whole
    earlier conversation as a prefix, and every request shares the system prompt.

    Arrivals are ``num_conversations * num_turns`` Poisson arrivals at ``rate``, dealt to
    the conversations in a random interleaving, each conversation's turns in order. This is
    open loop: turn ``k + 1`` may arrive before turn ``k`` has finished.
    """
    num_conversations = as_int("num_conversations", num_conversations, min=1)
    num_turns = as_int("num_turns", num_turns, min=1)
    vocab_size, low = _vocab(vocab_size, low)
    system_spec = _length("system_prompt_len", system_prompt_len)
    user_spec = _length("user_turn_len", user_turn_len)
    output_spec = _length("output_len", output_len)
    rate = _rate(rate)
    rng = _seed(seed)

    n = num_conversations * num_turns
    times = _arrivals(rng, n, rate)
    # Slot i goes to conversation order[i]; a conversation's j-th slot is its turn j.
    order = rng.permutation(np.repeat(np.arange(num_conversations), num_turns))
    system = _tokens(rng, _lengths(rng, system_spec, 1)[0], low, vocab_size)
    history = [system] * num_conversations
    requests = []
    for time, conversation in zip(times.tolist(), order.tolist(), strict=True):
        user_len, reply_len = _lengths(rng, user_spec, 1)[0], _lengths(rng, output_spec, 1)[0]
        prompt = history[conversation] + _tokens(rng, user_len, low, vocab_size)
        requests.append(WorkloadRequest(time, prompt, reply_len, session=f"chat-{conversation}"))
        history[conversation] = prompt + _tokens(rng, reply_len, low, vocab_size)
    return Workload("shared_prefix_chat", requests)


def few_shot(
    num_requests: int = 32,
    *,
    vocab_size: int,
    num_templates: int = 4,
    template_len: LengthSpec = 256,
    question_len: LengthSpec = 16,
    output_len: LengthSpec = 16,
    rate: float | None = None,
    seed: int = 0,
    low: int = 0,
) -> Workload:
    """Few-shot prompting: each request is one of ``num_templates`` long prefixes (drawn
    uniformly) followed by a short question of its own."""
    num_requests = as_int("num_requests", num_requests, min=1)
    num_templates = as_int("num_templates", num_templates, min=1)
    vocab_size, low = _vocab(vocab_size, low)
    template_spec = _length("template_len", template_len)
    question_spec = _length("question_len", question_len)
    output_spec = _length("output_len", output_len)
    rate = _rate(rate)
    rng = _seed(seed)

    templates = [
        _tokens(rng, n, low, vocab_size) for n in _lengths(rng, template_spec, num_templates)
    ]
    times = _arrivals(rng, num_requests, rate)
    choices = rng.integers(0, num_templates, size=num_requests).tolist()
    question_lens = _lengths(rng, question_spec, num_requests)
    output_lens = _lengths(rng, output_spec, num_requests)
    requests = [
        WorkloadRequest(time, templates[t] + _tokens(rng, q, low, vocab_size), out)
        for time, t, q, out in zip(
            times.tolist(), choices, question_lens, output_lens, strict=True
        )
    ]
    return Workload("few_shot", requests)


def mixed_long_short(
    num_requests: int = 32,
    *,
    vocab_size: int,
    long_fraction: float = 0.25,
    long_prompt_len: LengthSpec = 1024,
    long_output_len: LengthSpec = 128,
    short_prompt_len: LengthSpec = 64,
    short_output_len: LengthSpec = 16,
    rate: float | None = None,
    seed: int = 0,
    low: int = 0,
) -> Workload:
    """Long and short requests: exactly ``round(long_fraction * num_requests)`` are long
    (``long_prompt_len``, ``long_output_len``), the rest short, in random order."""
    num_requests = as_int("num_requests", num_requests, min=1)
    long_fraction = as_real("long_fraction", long_fraction, min=0, max=1)
    vocab_size, low = _vocab(vocab_size, low)
    specs = {
        True: (_length("long_prompt_len", long_prompt_len),
               _length("long_output_len", long_output_len)),
        False: (_length("short_prompt_len", short_prompt_len),
                _length("short_output_len", short_output_len)),
    }
    rate = _rate(rate)
    rng = _seed(seed)

    num_long = round(long_fraction * num_requests)
    is_long = rng.permutation(np.arange(num_requests) < num_long).tolist()
    times = _arrivals(rng, num_requests, rate)
    requests = []
    for time, long in zip(times.tolist(), is_long, strict=True):
        prompt_spec, output_spec = specs[long]
        prompt_len = _lengths(rng, prompt_spec, 1)[0]
        requests.append(WorkloadRequest(
            time, _tokens(rng, prompt_len, low, vocab_size), _lengths(rng, output_spec, 1)[0]
        ))
    return Workload("mixed_long_short", requests)


def bursts(
    num_bursts: int = 4,
    burst_size: int = 8,
    *,
    vocab_size: int,
    gap_s: float = 1.0,
    spread_s: float = 0.0,
    prompt_len: LengthSpec = (16, 64),
    output_len: LengthSpec = (64, 128),
    seed: int = 0,
    low: int = 0,
) -> Workload:
    """Requests in bursts: ``num_bursts`` groups of ``burst_size``, the ``k``-th starting at
    ``k * gap_s`` s: its first request then, the others uniformly within ``spread_s`` s after
    (0: all at once). With long outputs (the default) it is decode-heavy, and
    with a gap longer than a burst's run the engine goes idle between bursts: the case
    where the first step after an idle gap and a queue built at once decide TTFT."""
    num_bursts = as_int("num_bursts", num_bursts, min=1)
    burst_size = as_int("burst_size", burst_size, min=1)
    gap_s = as_real("gap_s", gap_s, min=0)
    spread_s = as_real("spread_s", spread_s, min=0)
    vocab_size, low = _vocab(vocab_size, low)
    prompt_spec = _length("prompt_len", prompt_len)
    output_spec = _length("output_len", output_len)
    rng = _seed(seed)

    n = num_bursts * burst_size
    offsets = rng.uniform(0.0, spread_s, size=(num_bursts, burst_size))
    offsets[:, 0] = 0.0  # each burst's first request arrives at its start
    times = np.sort(np.arange(num_bursts)[:, None] * gap_s + np.sort(offsets, axis=1), axis=None)
    prompt_lens = _lengths(rng, prompt_spec, n)
    output_lens = _lengths(rng, output_spec, n)
    requests = [
        WorkloadRequest(time, _tokens(rng, p, low, vocab_size), out)
        for time, p, out in zip(times.tolist(), prompt_lens, output_lens, strict=True)
    ]
    return Workload("bursts", requests)


def chain(*workloads: Workload, gap_s: float = 0.5, name: str | None = None) -> Workload:
    """The workloads one after the other: each starts ``gap_s`` s after the previous one's
    last arrival (its own arrival times shifted so). For a calibration run that shows a
    fit every kind of step: a busy stream, prompts over cached prefixes, idle gaps."""
    if not workloads:
        raise ValueError("chain needs at least one workload")
    for i, workload in enumerate(workloads):
        if not isinstance(workload, Workload):
            raise TypeError(f"workloads[{i}] must be a Workload, got {type(workload).__name__}")
    gap_s = as_real("gap_s", gap_s, min=0)
    requests: list[WorkloadRequest] = []
    start = 0.0
    for workload in workloads:
        requests += [attrs.evolve(r, arrival_time=start + r.arrival_time) for r in workload]
        if requests:
            start = requests[-1].arrival_time + gap_s
    return Workload(name or "+".join(w.name for w in workloads), requests)


def multi_tenant(
    num_requests: int = 32,
    *,
    vocab_size: int,
    heavy_share: float = 0.8,
    prompt_len: LengthSpec = (16, 64),
    output_len: LengthSpec = (8, 32),
    rate: float | None = None,
    heavy_user: str = "heavy",
    light_user: str = "light",
    seed: int = 0,
    low: int = 0,
) -> Workload:
    """Two users with the same length distributions and different request rates.

    ``heavy_user`` sends ``round(heavy_share * num_requests)`` of the requests (at least
    one, and leaving at least one to ``light_user``), in a random interleaving of the
    Poisson arrivals at the total ``rate``: so the heavy user's rate is about
    ``heavy_share * rate`` and the light user's the rest.
    """
    num_requests = as_int("num_requests", num_requests, min=2)
    heavy_share = as_real("heavy_share", heavy_share, min=0, max=1, min_inclusive=False,
                          max_inclusive=False)
    heavy_user = as_str("heavy_user", heavy_user, allow_empty=False)
    light_user = as_str("light_user", light_user, allow_empty=False)
    if heavy_user == light_user:
        raise ValueError(
            f"heavy_user and light_user must differ, both are {heavy_user!r}"
        )
    vocab_size, low = _vocab(vocab_size, low)
    prompt_spec = _length("prompt_len", prompt_len)
    output_spec = _length("output_len", output_len)
    rate = _rate(rate)
    rng = _seed(seed)

    num_heavy = min(max(round(heavy_share * num_requests), 1), num_requests - 1)
    is_heavy = rng.permutation(np.arange(num_requests) < num_heavy).tolist()
    times = _arrivals(rng, num_requests, rate)
    prompt_lens = _lengths(rng, prompt_spec, num_requests)
    output_lens = _lengths(rng, output_spec, num_requests)
    requests = [
        WorkloadRequest(
            time, _tokens(rng, p, low, vocab_size), out,
            user=heavy_user if heavy else light_user,
        )
        for time, heavy, p, out in zip(
            times.tolist(), is_heavy, prompt_lens, output_lens, strict=True
        )
    ]
    return Workload("multi_tenant", requests)
