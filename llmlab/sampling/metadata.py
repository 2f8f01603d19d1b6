"""What the sampler reads: per-row sampling state, and one step's :class:`SamplingMetadata`.

The sampler is a function of ``(logits, SamplingMetadata)``. Row ``i`` of the logits belongs
to ``metadata.rows[i]``, a :class:`SamplingRow`: the per-row state an executor keeps for
the life of a scheduler row (created from the step contract's ``RowSetup``, dropped when
the batch frees the row). It holds what lives across steps: the parameters as admitted,
the prompt and the tokens sampled so far (penalties, bad words, min_tokens, custom
processors), the grammar matcher, and the seeded stream's generator.

Seeded rows draw from a *counter-based* stream: the generator is re-seeded at every draw
from ``(seed, number of tokens sampled so far)``, so a request's tokens depend only on its
seed and its own history: not on what shares the batch, nor on whether it was preempted
and resumed on another row, nor on which process runs it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.sampling.params import SamplingParams
from llmlab.threads import available_cpus

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_seed(seed: int, index: int) -> int:
    """The seed of draw ``index`` of the stream ``seed`` (a 63-bit mix of both)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


@attrs.define(eq=False, slots=True)
class SamplingRow:
    """One row's sampling state (what a ``Request`` used to carry for the sampler).

    Attributes:
        request_id: the request on this row (for messages).
        sampling_params: its parameters, as admitted.
        prompt_token_ids: its prompt.
        output_token_ids: tokens sampled so far (the executor appends each one it draws).
        eos_token_ids: ids that end it unless ``ignore_eos``.
        grammar: its structured-output matcher (``GrammarState``), or None.
        generator: the seeded stream's generator, created at the first seeded draw.
    """

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = attrs.field(factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    grammar: Any = None
    generator: torch.Generator | None = None
    # What the sampler's fast path asks of every row, decided once (parameters are frozen;
    # the grammar is set when the row starts). See ``llmlab.sampling.sampler``.
    _plain_greedy: bool | None = attrs.field(default=None, init=False, repr=False)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @classmethod
    def of(cls, request: Any) -> SamplingRow:
        """A row over a request-like object (its lists are shared, not copied)."""
        return cls(
            request.request_id,
            request.sampling_params,
            request.prompt_token_ids,
            request.output_token_ids,
            getattr(request, "eos_token_ids", frozenset()),
            getattr(request, "grammar", None),
        )

    def seeded_generator(self, device: torch.device) -> torch.Generator | None:
        """The generator for this row's next draw (None when unseeded), on ``device``."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        gen = self.generator
        if gen is None or gen.device != device:
            gen = self.generator = torch.Generator(device=device)
        gen.manual_seed(stream_seed(seed, len(self.output_token_ids)))
        return gen


class ParamColumns:
    """The numeric sampling parameters of every row as columns (one array per parameter,
    indexed by row), written once when a row starts: what the processors turn into per-step
    tensors with one gather instead of a Python pass over the rows' parameters."""

    NAMES = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "frequency_penalty", "presence_penalty")

    def __init__(self, num_rows: int) -> None:
        self.columns = {name: np.zeros(num_rows, dtype=np.float32) for name in self.NAMES}

    def set(self, row: int, params: SamplingParams) -> None:
        for name, column in self.columns.items():
            column[row] = getattr(params, name)


class GrammarFactory:
    """Builds structured-output matchers for rows; the compiler is created at first use
    (xgrammar is optional) and shared by every thread that asks.

    :meth:`compile` looks in the backend's cache on the caller's thread first: a cache hit
    never waits for anything. A miss is compiled in a process of its own, which is killed
    when the caller gives up (:mod:`llmlab.sampling.compile_pool`), queued fairly across
    clients. :meth:`close` kills every compile at once (call it when the engine shuts
    down; a factory that is garbage-collected closes too).

    Attributes:
        compile_timeout_s: the longest :meth:`compile` waits for a miss, queueing included
            (the compile process's one-time start, at the first miss, is not counted).
            A compile that runs out of time is refused and its process killed.
        compile_workers: compiles that run at once, each a process of one xgrammar thread
            (default: a quarter of the usable cores, at least one).
        max_pending_compiles_per_client: compiles one client (``compile``'s ``client``)
            may have queued or running; one more is refused at once. A request for a
            grammar already compiling joins that compile and does not count. Callers
            that name no client share one, so for them this bounds the whole server.
        max_choices: the most ``structured_outputs.choice`` options (None: no limit).
            OpenAI's structured outputs allow 1000 enum values per schema; a choice list
            compiles in time that grows faster than its length (10,000 options of a few
            words take seconds; 300,000 take minutes).
        max_constraint_chars: the longest constraint, in characters: the JSON schema
            (compact), the regex, the grammar or the choices together (None: no limit).
        max_grammar_bytes: the largest compiled grammar (xgrammar's ``memory_size_bytes``);
            a larger one is refused (None: no limit).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int],
                 compile_timeout_s: float = 10.0, compile_workers: int | None = None, *,
                 max_pending_compiles_per_client: int = 16, max_choices: int | None = 1000,
                 max_constraint_chars: int | None = 1_000_000,
                 max_grammar_bytes: int | None = 64 << 20) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        if compile_workers is None:
            # A quarter of the usable cores (one on a small machine), each compile on one
            # thread: a schema that compiles for long leaves the rest to the engine.
            compile_workers = max(1, int(available_cpus()) // 4)
        self.compile_workers = compile_workers
        for name, value, optional in (
            ("compile_workers", compile_workers, False),
            ("max_pending_compiles_per_client", max_pending_compiles_per_client, False),
            ("max_choices", max_choices, True),
            ("max_constraint_chars", max_constraint_chars, True),
            ("max_grammar_bytes", max_grammar_bytes, True),
        ):
            if not (value is None and optional) and not (isinstance(value, int) and value >= 1):
                raise ValueError(
                    f"{name} must be an integer >= 1{' or None' if optional else ''}, got {value!r}"
                )
        self.max_pending_compiles_per_client = max_pending_compiles_per_client
        self.max_choices = max_choices
        self.max_constraint_chars = max_constraint_chars
        self.max_grammar_bytes = max_grammar_bytes
        self._backend = None
        self._pool = None
        self._closed = False
        self._lock = threading.Lock()
        # cache key -> [compiled grammar, live parameter objects pinning it] (_pin). Its
        # own re-entrant lock: an unpin runs when the garbage collector frees a request's
        # parameters, which may happen on any thread, inside any allocation.
        self._pins: dict[tuple, list] = {}
        self._pins_lock = threading.RLock()

    @property
    def backend(self):
        with self._lock:
            if self._backend is None:
                if self.tokenizer is None:
                    raise ValueError(
                        "structured_outputs needs a tokenizer (skip_tokenizer_init=True)"
                    )
                from llmlab.sampling.structured import StructuredOutputBackend

                self._backend = StructuredOutputBackend(
                    self.tokenizer, self.vocab_size, self.eos_token_ids, compile_threads=1
                )
            return self._backend

    @property
    def compile_pool(self):
        """The :class:`~llmlab.sampling.compile_pool.CompilePool` misses compile in
        (created at the first miss)."""
        backend = self.backend
        with self._lock:
            if self._closed:
                raise ValueError(
                    "structured_outputs cannot be compiled: the engine is shutting down"
                )
            if self._pool is None:
                from llmlab.sampling.compile_pool import CompilePool

                self._pool = CompilePool(
                    backend.tokenizer_info_json(), self.vocab_size,
                    workers=self.compile_workers,
                    max_pending_per_client=self.max_pending_compiles_per_client,
                    max_grammar_bytes=self.max_grammar_bytes,
                )
                # An engine dropped without close() leaves no compile process behind.
                weakref.finalize(self, self._pool.close)
            return self._pool

    def compile(self, spec: Any, client: Hashable = None):
        """The compiled grammar of a ``StructuredOutputsParams`` (or a mapping of its
        fields): from the cache at once, else compiled in a process of its own, queued
        behind at most one compile per worker of each other client.

        ``client`` is whose request this is (the request's ``user``, say): compiles are
        served round-robin across clients. ``None`` is one client shared by every caller
        that names none.

        Raises:
            ValueError: the constraint is invalid or over a limit (naming the field, the
                value and what is allowed); it took longer than ``compile_timeout_s``;
                ``client`` has ``max_pending_compiles_per_client`` compiles pending; or
                the factory was closed.
        """
        backend = self.backend
        key = backend.cache_key(spec)
        self._check_size(key)
        hit = backend.lookup(key)
        if hit is None:
            hit = self._compile_miss(key, client)
        self._pin(spec, hit)
        return hit

    def _compile_miss(self, key: tuple, client: Hashable) -> Any:
        backend = self.backend
        from llmlab.sampling.compile_pool import CompilePoolClosed, CompileTimeout

        try:
            serialized = self.compile_pool.compile(key, client, timeout_s=self.compile_timeout_s)
        except CompileTimeout as err:
            raise ValueError(
                f"structured_outputs took longer than {self.compile_timeout_s:g} s to compile "
                f"({err}); simplify the schema (deeply nested schemas compile slowly)"
            ) from None
        except CompilePoolClosed:
            raise ValueError(
                "structured_outputs cannot be compiled: the engine is shutting down"
            ) from None
        return backend.store_serialized(key, serialized)

    def _check_size(self, key: tuple) -> None:
        """The up-front limits on a constraint (its cache key), before any compile."""
        kind, spec = key[0], key[1] if len(key) > 1 else ""
        if kind == "choice":
            if self.max_choices is not None and len(spec) > self.max_choices:
                raise ValueError(
                    f"structured_outputs.choice has {len(spec)} options, more than the "
                    f"{self.max_choices} allowed"
                )
            chars = sum(map(len, spec))
        else:
            chars = len(spec)
        if self.max_constraint_chars is not None and chars > self.max_constraint_chars:
            raise ValueError(
                f"structured_outputs.{kind} is {chars} characters long, more than the "
                f"{self.max_constraint_chars} allowed"
            )

    def new_state(self, spec: Any, accepted: Iterable[int] = ()):
        """A matcher for ``spec`` that has accepted ``accepted`` (a resumed row's output).
        The grammar comes from the pins (below) or the cache; only a spec that never went
        through :meth:`compile` (or an equal one still alive) can miss both and compile
        here, as :meth:`compile` does."""
        backend = self.backend
        with self._pins_lock:
            pinned = self._pins.get(backend.cache_key(spec))
        state = backend.new_state(pinned[0] if pinned is not None else self.compile(spec))
        state.accept_many(accepted)
        return state

    def _pin(self, spec: Any, compiled: Any) -> None:
        """Keep ``compiled`` for as long as ``spec`` (the request's own parameters object)
        lives, whatever the cache evicts meanwhile: a row starts (or restarts after a
        preemption) on the engine's loop, where a compile would hold every request, and a
        client sending hundreds of other grammars must not be able to force one there.
        What is pinned is bounded by the requests in flight."""
        try:
            weakref.finalize(spec, self._unpin, compiled.key)
        except TypeError:  # a plain mapping: nothing lives on to pin it to
            return
        with self._pins_lock:
            entry = self._pins.setdefault(compiled.key, [compiled, 0])
            entry[1] += 1

    def _unpin(self, key: tuple) -> None:
        with self._pins_lock:
            entry = self._pins.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._pins[key]

    def close(self) -> None:
        """Kill every running and queued compile (their callers get a ``ValueError``) and
        the compile process; later misses are refused. Returns at once; safe to call
        twice."""
        with self._lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.close()


@attrs.define(eq=False)
class SamplingMetadata:
    """One sampler call: the rows of the logits, and per-row data derived from them lazily.

    Row lists (``list[int]``, ascending) come from plain Python over the parameters; tensors
    are built only when a processor asks, with one ``torch.tensor`` per column.

    Attributes:
        rows: row ``i`` of the logits belongs to ``rows[i]`` (a :class:`SamplingRow`, or
            any object with the same attributes). ``requests`` is the same list.
        vocab_size: width of the logits (may be less than the tokenizer's vocabulary).
        device: the logits' device; tensors built here live on it.
        tokenizer: needed by ``bad_words`` (the sampler fills in its own when None).
        generator: the stream unseeded rows share (the executor's).
        columns, row_ids: the executor's per-row parameter columns and each logits row's
            scheduler row in them (both None: :meth:`column` reads the parameters).
        params: ``rows[i].sampling_params`` per row.
    """

    rows: Sequence[SamplingRow]
    vocab_size: int
    device: torch.device
    tokenizer: Any = None
    generator: torch.Generator | None = None
    columns: ParamColumns | None = None
    row_ids: np.ndarray | None = None
    params: list[SamplingParams] = attrs.field(init=False)
    _cache: dict = attrs.field(init=False, factory=dict, repr=False)

    def __attrs_post_init__(self) -> None:
        self.params = [r.sampling_params for r in self.rows]

    @property
    def requests(self) -> Sequence[SamplingRow]:
        """The rows (the name processors written against earlier versions use)."""
        return self.rows

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    # -- rows --------------------------------------------------------------------------

    def rows_where(self, pred: Callable[[SamplingParams], object]) -> list[int]:
        """Rows whose sampling parameters satisfy ``pred``."""
        return [i for i, p in enumerate(self.params) if pred(p)]

    def requests_where(self, pred: Callable[[SamplingRow], object]) -> list[int]:
        """Rows whose state satisfies ``pred``."""
        return [i for i, r in enumerate(self.rows) if pred(r)]

    @property
    def random_rows(self) -> list[int]:
        """Rows that draw at random (``temperature > 0``); the others are greedy."""
        rows = self._cache.get("random_rows")
        if rows is None:
            if self.columns is not None and self.row_ids is not None:
                temperature = self.columns.columns["temperature"][self.row_ids]
                rows = np.flatnonzero(temperature > 0).tolist()
            else:
                rows = self.rows_where(lambda p: p.temperature > 0)
            self._cache["random_rows"] = rows
        return rows

    def random_rows_where(self, pred: Callable[[SamplingParams], object]) -> list[int]:
        """Random rows whose parameters satisfy ``pred`` (the filters skip greedy rows)."""
        params = self.params
        return [i for i in self.random_rows if pred(params[i])]

    # -- tensors -----------------------------------------------------------------------

    def index(self, rows: Sequence[int]) -> torch.Tensor:
        """``rows`` as a long tensor on the device."""
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def values(
        self, get: Callable[[SamplingParams], float], rows: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """``[len(rows)]`` tensor of ``get(params)`` per row (all rows by default)."""
        params = self.params
        vals = [get(p) for p in params] if rows is None else [get(params[i]) for i in rows]
        return torch.tensor(vals, dtype=dtype, device=self.device)

    def column(self, name: str, rows: Sequence[int] | None = None) -> torch.Tensor:
        """``[len(rows)]`` float32 tensor of the numeric parameter ``name`` (one of
        :attr:`ParamColumns.NAMES`) per row (all rows by default): a gather from the
        executor's columns when it keeps them, else read from the parameters."""
        if self.columns is None or self.row_ids is None:
            return self.values(lambda p: getattr(p, name), rows)
        ids = self.row_ids if rows is None else self.row_ids[list(rows)]
        return torch.from_numpy(self.columns.columns[name][ids]).to(self.device)

    def output_counts(self, rows: Sequence[int]) -> torch.Tensor:
        """``[len(rows), V]`` float32: how often each token occurs in each row's output."""
        key = ("output_counts", tuple(rows))
        counts = self._cache.get(key)
        if counts is None:
            lists = [self.rows[i].output_token_ids for i in rows]
            counts = self._cache[key] = count_tokens(lists, self.vocab_size, self.device)
        return counts

    def prompt_counts(self, rows: Sequence[int]) -> torch.Tensor:
        """``[len(rows), V]`` float32: how often each token occurs in each row's prompt."""
        key = ("prompt_counts", tuple(rows))
        counts = self._cache.get(key)
        if counts is None:
            lists = [self.rows[i].prompt_token_ids for i in rows]
            counts = self._cache[key] = count_tokens(lists, self.vocab_size, self.device)
        return counts


def count_tokens(
    lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``[len(lists), vocab_size]`` float32 counts of each list's ids, in one scatter.

    Ids ``>= vocab_size`` are counted in a spare column that is dropped.
    """
    n = len(lists)
    counts = torch.zeros(n, vocab_size + 1, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long, device=device)
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long,
                       device=device)
    if ids.numel():
        rows = torch.repeat_interleave(torch.arange(n, device=device), lengths)
        ids = ids.clamp_(max=vocab_size)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32),
                          accumulate=True)
    return counts[:, :vocab_size]
