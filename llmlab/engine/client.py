"""``EngineClient``: the surface every kind of engine offers, and ``AsyncEngineClient``, its
asyncio front.

Two protocols, because the two shapes differ:

* :class:`EngineClient` is synchronous: requests go in, ``step()`` brings outputs out, and
  the engine's state can be read and watched. :class:`~llmlab.engine.engine.Engine` (one
  replica, in this process) and
  :class:`~llmlab.distributed.data_parallel.DataParallelEngine` (replicas in processes of
  their own, behind a router) implement it; ``LLM`` and ``AsyncEngine`` drive either
  through it alone. Where the answer of an engine of replicas is one per replica
  (``snapshot``, ``observe``, ``kv_cache``, ``record``), the member says so.
* :class:`AsyncEngineClient` is what asyncio code holds: ``generate``/``encode`` stream a
  request's outputs, ``abort`` and ``check_health`` are coroutines, and there is no
  ``step`` (a loop thread steps the engine). This is the shape of vLLM's ``EngineClient``
  (``vllm/engine/protocol.py``), which is its async one.
  :class:`~llmlab.entrypoints.async_engine.AsyncEngine` implements it around any
  ``EngineClient`` (its ``engine``); the engine's state is read through that engine, so
  observation is defined once, here, not twice.

Both are ``runtime_checkable``, but ``isinstance`` only sees that the names exist: the
signatures are kept equal by ``tests/engine/test_engine_client.py``, which also lists each
public member of ``Engine`` that is deliberately left out of the protocol.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Hashable, Iterable
from typing import Any, Protocol, runtime_checkable

from llmlab.config import EngineConfig
from llmlab.engine.inputs import PreparedRequest, PromptType
from llmlab.engine.outputs import PoolingRequestOutput, RequestOutput
from llmlab.observe.events import EngineSnapshot, StepObserver
from llmlab.pooling_params import PoolingParams
from llmlab.sampling.params import SamplingParams

__all__ = ["AsyncEngineClient", "EngineClient"]


@runtime_checkable
class EngineClient(Protocol):
    """What ``LLM``, ``AsyncEngine`` and the server need of an engine (module docstring).

    Attributes:
        config: the engine's settings (an engine of replicas: replica 0's, with its
            ``data_parallel_size``).
        tokenizer: the Hugging Face tokenizer, or None (``skip_tokenizer_init``).
        vocab_size / max_model_len / eos_token_ids / max_logprobs: what requests are
            checked against.
        default_sampling_params: used for a request given no ``SamplingParams`` (the
            checkpoint's ``generation_config.json``, as in vLLM).
    """

    config: EngineConfig
    tokenizer: Any | None
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    default_sampling_params: SamplingParams
    max_logprobs: int

    # -- requests ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
    ) -> None:
        """Check and queue a request (``prepare_request`` then ``add_prepared_request``).
        ``TypeError``/``ValueError`` naming the field, and nothing queued, on bad input.

        ``priority``: lower is served first by policies that read it; ``user``: who sent
        it (per-user policies share service by it); ``lora_request``: a
        :class:`~llmlab.lora.request.LoRARequest` to run it with, or None.
        """
        ...

    def prepare_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
        client: Hashable = None,
    ) -> PreparedRequest:
        """Check and tokenize a request without queueing it (``add_request``'s arguments
        and errors). It reads no state a step changes, so a front end may call it from
        another thread while the engine steps. ``client``: who sent it as the front end
        knows (the server: the peer's address); grammar compiles queue fairly per client."""
        ...

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Queue a request checked by ``prepare_request``; ``ValueError`` when its id is in
        use (nothing queued)."""
        ...

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are and free their KV blocks; no output of theirs
        comes after. Unknown ids are ignored."""
        ...

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (so it cannot be reused yet)."""
        ...

    # -- the step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Make progress and return the outputs of requests that progressed. A request the
        engine had to end raises :class:`~llmlab.errors.RequestFailedError` (its final
        output comes with the next call); other errors leave the engine consistent."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has work: requests in flight or outputs not yet returned."""
        ...

    def get_num_unfinished_requests(self) -> int:
        """Requests queued or running."""
        ...

    def get_tokenizer(self) -> Any | None:
        """The tokenizer (None without one)."""
        ...

    @property
    def is_alive(self) -> bool:
        """False while the engine cannot run requests (a dead tensor-parallel rank; every
        replica dead or unresponsive); :meth:`dead_reason` says why."""
        ...

    def dead_reason(self) -> str:
        """Why the engine is not alive (a sentence naming the rank or replicas)."""
        ...

    def shutdown(self) -> None:
        """Stop what the engine started (worker ranks, replica processes, grammar
        compiles). Safe to call twice."""
        ...

    # -- observation ---------------------------------------------------------------------

    def subscribe(self, observer: StepObserver) -> StepObserver:
        """Call ``observer(event)`` with every :class:`~llmlab.observe.events.StepEvent`
        (an engine of replicas: every replica's, each with its own step indices and block
        ids); returns it. An observer that raises is logged and skipped."""
        ...

    def unsubscribe(self, observer: StepObserver) -> None:
        """Stop calling ``observer``; ``ValueError`` if it is not subscribed."""
        ...

    def observe(
        self, observer: StepObserver
    ) -> EngineSnapshot | tuple[EngineSnapshot | None, ...]:
        """Subscribe ``observer`` and return the state it starts from, atomically: applying
        every later event to it follows the engine exactly. An engine of replicas returns
        one snapshot per replica (None for one that cannot answer, and is not heard)."""
        ...

    def snapshot(self) -> EngineSnapshot | tuple[EngineSnapshot | None, ...]:
        """The KV pool, block tables and queue lengths now
        (:class:`~llmlab.observe.events.EngineSnapshot`); an engine of replicas returns one
        per replica (None for one that cannot answer)."""
        ...

    def record(self, path: str | os.PathLike) -> Any:
        """Record the run from now on to JSON Lines at ``path`` (read back with
        :func:`llmlab.viz.load`); returns the recording, to ``close()`` or use in a
        ``with`` block. An engine of replicas writes one file per replica."""
        ...

    @property
    def kv_cache(self) -> Any:
        """The :class:`~llmlab.cache.kv_cache_manager.KVCacheManager` (read it, don't
        mutate); an engine of replicas gives one read-only view per replica."""
        ...


@runtime_checkable
class AsyncEngineClient(Protocol):
    """What asyncio code (the OpenAI server, a notebook's ``await``) needs of an engine:
    vLLM's ``EngineClient`` shape (module docstring).

    Attributes:
        engine: the :class:`EngineClient` it serves; its state (``snapshot``, ``observe``,
            ``subscribe``, ``kv_cache``, ``record``) is read there.
    """

    engine: EngineClient

    async def add_request(
        self,
        request_id: str | int | None,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        arrival_time: float | None = None,
        lora_request: Any = None,
        client: Hashable = None,
    ) -> AsyncIterator[RequestOutput]:
        """Check and queue a request (bad input raises here, queueing nothing); returns the
        stream of its outputs. ``request_id=None`` picks a fresh one."""
        ...

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | int | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come (an async generator; what each holds
        follows ``sampling_params.output_kind``). Closing it early aborts the request."""
        ...

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | int | None = None,
        *,
        priority: int = 0,
        user: str | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Yield a pooling request's output (an async generator; ``runner="pooling"``)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its stream ends. Unknown ids are ignored."""
        ...

    async def check_health(self) -> None:
        """Raise when the engine cannot serve (its loop is dead, or its latest step
        failed, or a step has run for too long)."""
        ...

    @property
    def is_running(self) -> bool:
        """Whether requests are taken now."""
        ...

    @property
    def errored(self) -> bool:
        """True when the loop is dead or the latest step failed."""
        ...

    def get_tokenizer(self) -> Any | None:
        """The engine's tokenizer (None without one)."""
        ...

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop and the engine; every open stream ends with an error. Safe to
        call twice."""
        ...

