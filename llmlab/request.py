"""A request's lifetime state: its lifecycle is written by the scheduler alone.

Input processing creates a ``Request``; from then on only the scheduler changes its
lifecycle (status, computed tokens, output tokens, row). Executors never see it: they get
the step contract's plain data (:mod:`llmlab.scheduler.batch`) and keep their own per-row
state. Output processing reads it and keeps what was reported in its own records.

This module sits below the engine, scheduler and cache (it imports only
``SamplingParams``), so those packages import it downward.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from llmlab.pooling_params import PoolingParams
from llmlab.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        # Membership of the member itself: ``self.value`` goes through the enum's
        # descriptor, which costs more than this check runs per step.
        return self in _FINISHED


_FINISHED = frozenset(
    (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
)


@attrs.define(eq=False)
class Request:
    """One generation request.

    ``all_token_ids`` is prompt + output so far. ``num_computed_tokens`` counts the leading
    tokens whose KV is in the cache; a request is in prefill while it is below
    ``num_tokens - 1`` and decoding after. Preemption by recompute resets it to 0 and keeps
    the generated tokens, which are then prefilled again with the prompt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # vLLM's semantics: a lower value is served first.
    priority: int = 0
    # Who sent it (the OpenAI ``user`` field); fairness policies share service per user.
    user: str | None = None
    prompt: str | None = None
    # Tokens that end generation unless ``ignore_eos``: the tokenizer's EOS plus any the
    # checkpoint's generation_config lists (e.g. Llama 3 instruct's end-of-turn token).
    eos_token_ids: frozenset[int] = frozenset()
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = attrs.field(factory=list)
    all_token_ids: list[int] = attrs.field(init=False)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when the request was first admitted.
    num_cached_tokens: int = 0
    # The stop token id or stop string that ended it (vLLM's ``stop_reason``).
    stop_reason: int | str | None = None
    # Chained hashes of this request's full blocks, computed once and kept across
    # preemptions (the tokens they cover never change).
    block_hashes: list[int] = attrs.field(factory=list)
    # Scheduler row while admitted (None while waiting or finished); see scheduler.batch.
    row: int | None = None
    # Why the engine ended the request itself (e.g. it can never fit the KV cache).
    error: str | None = None
    # Prompt tokens computed at least once (cache hits excluded), a high-water mark that
    # preemption does not reset: what fairness policies count as prompt service.
    num_prompt_computed: int = 0
    # Position in the scheduler's arrival order (ties between equal arrival times).
    seq: int = 0
    # Parallel sampling (n / best_of): the group this request is sample ``index`` of. The
    # leader (index 0) is queued; the others wait in ``forks`` until the leader's prompt is
    # computed, then start from its KV blocks (shared by reference) with their first token.
    group: SampleGroup | None = None
    index: int = 0
    forks: list[Request] = attrs.field(factory=list)
    # Logprobs of each output token (``TokenLogprobs``) when ``sampling_params.logprobs``
    # is set, and of each prompt position (None first) when ``prompt_logprobs`` is.
    output_logprobs: list = attrs.field(factory=list)
    prompt_logprobs: list = attrs.field(factory=list)
    # When it reached each stage (the engine's clock; None until then): vLLM's
    # RequestMetrics, stamped by the engine's output processor after each step.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # A pooling request (prefill only): its resolved parameters (``sampling_params`` is
    # then a placeholder that generates nothing), whether its pooler reads every prompt
    # position (so no prefix-cache hit may skip one), and its pooled output once computed.
    pooling_params: PoolingParams | None = None
    pools_all_positions: bool = False
    pooled: Any = None
    # The LoRA adapter it runs with (a ``LoRARequest``), or None: the base model. Its
    # ``hash_salt`` roots the chained block hashes, so the prefix cache never shares KV
    # across adapters (None: the base model's root).
    lora_request: Any = None
    hash_salt: int | None = None
    # KV accounting when a feature rewrote its KV (a KV press compacting it; the feature
    # keeps its own state): ``kv_dropped`` positions are no longer cached (the cache holds
    # ``num_cached_kv`` slots), and ``kv_compressed`` blocks are not a prefix of its tokens,
    # so they never enter the prefix index. Reset when it is recomputed after preemption.
    kv_dropped: int = 0
    kv_compressed: bool = False
    # Overlapped scheduling (planning a step while the previous one runs): positions past
    # ``num_computed_tokens`` that a batch still in flight computes, and the tokens it will
    # sample (0 or 1); the scheduler sets them while it plans ahead of that batch and
    # clears them when it commits it. Always 0 in a synchronous engine.
    num_ahead: int = 0
    num_placeholders: int = 0
    _view: RequestView | None = attrs.field(default=None, init=False, repr=False)

    @property
    def view(self) -> RequestView:
        """The read-only face of this request that policies see (one per request)."""
        view = self._view
        if view is None:
            view = self._view = RequestView(self)
        return view

    def __attrs_post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_cached_kv(self) -> int:
        """Tokens the KV cache holds for it (``num_computed_tokens`` and a batch in flight's
        ``num_ahead``, less what a KV press dropped): where its next token's KV is written."""
        return self.num_computed_tokens + self.num_ahead - self.kv_dropped

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all recorded yet (prefix hits would skip them)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_token_ids)
        )

    @property
    def skips_prefix_cache(self) -> bool:
        """Every prompt position must be computed for this request (no prefix-cache hit):
        prompt logprobs not all recorded yet, or a pooler that reads every position."""
        return self.pools_all_positions or self.needs_prompt_logprobs

    def append_output(self, token_id: int, logprob: float, top: Any = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if self.sampling_params.logprobs is not None:
            self.output_logprobs.append(top)

    def add_prompt_logprobs(self, first: int, scores: Any) -> None:
        """Record logprobs of prompt tokens ``first, first + 1, ...``; positions already
        recorded (a recompute after preemption) are skipped."""
        have = len(self.prompt_logprobs)
        if first <= have:
            self.prompt_logprobs.extend(scores[have - first :])


@attrs.define(eq=False)
class SampleGroup:
    """The ``best_of`` (default ``n``) parallel samples of one user request.

    ``members[i]`` is sample ``i``; the user sees one ``RequestOutput`` with ``n``
    completions (the ``n`` best by cumulative logprob when ``best_of > n``).
    """

    request_id: str
    n: int
    members: list[Request] = attrs.field(factory=list)

    @property
    def is_finished(self) -> bool:
        return all(m.is_finished for m in self.members)


class RequestView:
    """Read-only view of a :class:`Request`: what scheduling policies see.

    It exposes the request's identity, its parameters and its progress, never the mutable
    lists or the KV state, so a policy cannot change engine state by accident. One view
    exists per request (``request.view``), so views compare and hash by identity and can
    key a policy's own dicts and heaps.
    """

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    def __repr__(self) -> str:
        r = self._request
        return (
            f"RequestView({r.request_id!r}, status={r.status.value}, prompt={r.num_prompt_tokens}, "
            f"output={r.num_output_tokens}, priority={r.priority}, user={r.user!r})"
        )

    request_id = property(lambda self: self._request.request_id)
    arrival_time = property(lambda self: self._request.arrival_time)
    priority = property(lambda self: self._request.priority)
    user = property(lambda self: self._request.user)
    seq = property(lambda self: self._request.seq, doc="arrival order (ties)")
    sampling_params = property(lambda self: self._request.sampling_params)  # frozen
    pooling_params = property(
        lambda self: self._request.pooling_params, doc="set for a pooling request (prefill only)"
    )
    status = property(lambda self: self._request.status)
    num_prompt_tokens = property(lambda self: len(self._request.prompt_token_ids))
    num_output_tokens = property(lambda self: len(self._request.output_token_ids))
    num_tokens = property(lambda self: len(self._request.all_token_ids))
    num_computed_tokens = property(lambda self: self._request.num_computed_tokens)
    num_preemptions = property(lambda self: self._request.num_preemptions)
    num_cached_tokens = property(
        lambda self: self._request.num_cached_tokens,
        doc="prompt tokens found in the prefix cache at first admission",
    )
    is_finished = property(lambda self: self._request.is_finished)

    @property
    def max_tokens(self) -> int | None:
        return self._request.sampling_params.max_tokens

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return tuple(self._request.prompt_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._request.output_token_ids)
