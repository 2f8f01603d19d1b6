"""Structured outputs (JSON schema, regex, choice, EBNF grammar, JSON object) as a logits mask.

Built on `xgrammar <https://github.com/mlc-ai/xgrammar>`_, imported only when the first
constrained request arrives. One :class:`StructuredOutputBackend` per engine compiles a
request's :class:`~llmlab.sampling.params.StructuredOutputsParams` once (an LRU cache keyed
by the constraint) into a :class:`CompiledGrammar`; every sequence gets its own
:class:`GrammarState` (the matcher: where in the grammar the output is). Each step,
:func:`apply_grammar_masks` puts ``-inf`` on every token a row's grammar forbids, for the
whole batch at once; after the draw the engine feeds the token to :meth:`GrammarState.accept`.

What the mask guarantees, beyond "the text so far is a prefix of a sentence of the grammar":

* Tokens the tokenizer does not have (ids the model's padded vocabulary adds) and the
  tokenizer's special tokens other than EOS (``<s>``, pad, ...) are never allowed: their
  text is not what a detokenizer that skips special tokens prints.
* EOS is allowed exactly when the output is a complete sentence; once a state has accepted
  EOS it allows only EOS.
* A row is never left with no token at all: if a grammar dead-ends (a rule that can never
  finish, e.g. ``x ::= x "b"``) the row allows only EOS, with a warning, so the draw never
  sees an all ``-inf`` row. A grammar that matches nothing is refused at compile time.
* JSON strings hold no raw control characters and no UTF-8-encoded surrogates (two holes
  in xgrammar 0.2.8's JSON grammars, patched here), so ``json.loads`` takes the output and
  ``maxLength`` holds for the decoded text.

JSON (``json`` and ``json_object``) is generated on one line with fixed separators
(``", "`` and ``": "``, as ``json.dumps`` writes it; xgrammar's ``any_whitespace=False``):
JSON allows any amount of whitespace between tokens, and a model that puts weight on
whitespace (a random-weight one always does; real ones drift into ``\\n\\n\\n...`` too) can then
emit it forever without the document ever closing. With fixed separators every allowed
token advances the document. ``whitespace_pattern`` is therefore ignored.

Threading: :meth:`StructuredOutputBackend.compile` may be called from any thread (the cache
is locked; xgrammar's compiler is thread-safe and releases the GIL for most of a compile). A
:class:`GrammarState` is not thread-safe: one thread (the engine's step loop) drives it.

An engine does not compile here: its :class:`~llmlab.sampling.metadata.GrammarFactory`
looks in this cache (:meth:`StructuredOutputBackend.lookup`) and compiles a miss in a
process it can kill (:mod:`llmlab.sampling.compile_pool`), handing the result back with
:meth:`StructuredOutputBackend.store_serialized`. The compile itself (one function for both
paths) is :func:`llmlab.sampling.compile_worker.compile_constraint`.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from llmlab.sampling.compile_worker import (
    compile_constraint,
    import_xgrammar as _import_xgrammar,
    xgr_message as _xgr_message,
)
from llmlab.sampling.grammar import (
    CompiledGrammar,
    GrammarState,
    GrammarVocabulary,
    apply_grammar_masks,
)
from llmlab.sampling.params import StructuredOutputsParams


__all__ = [
    "CacheInfo",
    "CompiledGrammar",
    "GrammarState",
    "StructuredOutputBackend",
    "apply_grammar_masks",
]


def _special_token_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (named ones and added tokens marked special)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for idx, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(idx))
    return ids


class CacheInfo(NamedTuple):
    """Compiled-grammar cache statistics (as ``functools.lru_cache`` reports them)."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


class StructuredOutputBackend(GrammarVocabulary):
    """Compiles constraints for one tokenizer and vocabulary; one per engine. It is the
    :class:`~llmlab.sampling.grammar.GrammarVocabulary` its states mask with.

    Args:
        tokenizer: the Hugging Face tokenizer the model's output is decoded with.
        vocab_size: the model's vocabulary (the logits' last dimension); may exceed the
            tokenizer's, and the ids beyond it are never allowed.
        eos_token_ids: the ids that end a sequence; the grammar allows them exactly when
            the output is complete. Ids at or beyond ``vocab_size`` are ignored.
        max_cache_entries: compiled grammars kept (least recently used dropped first).
        compile_threads: threads xgrammar uses to compile one grammar.

    Raises:
        ImportError: xgrammar is not installed.
        ValueError: no EOS id inside the vocabulary, or a tokenizer xgrammar cannot read.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        max_cache_entries: int = 256,
        compile_threads: int = 8,
    ) -> None:
        xgr = _import_xgrammar()
        vocab_size = int(vocab_size)
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        if max_cache_entries < 1:
            raise ValueError(f"max_cache_entries must be >= 1, got {max_cache_entries}")
        eos = tuple(dict.fromkeys(int(t) for t in eos_token_ids if 0 <= int(t) < vocab_size))
        if not eos:
            raise ValueError(
                f"structured outputs need an EOS token id inside the vocabulary [0, {vocab_size})"
            )
        self.max_cache_entries = int(max_cache_entries)

        try:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos)
            )
        except (ValueError, RuntimeError, TypeError, AttributeError) as err:
            raise ValueError(
                f"structured outputs cannot use this tokenizer ({type(tokenizer).__name__}): "
                f"{_xgr_message(err)}"
            ) from err
        banned = {t for t in _special_token_ids(tokenizer) if t < vocab_size} - set(eos)
        if banned:
            # xgrammar only treats tokens whose text is empty as special, so "<s>" would be
            # allowed as the three characters "<s>". Blank them: xgrammar never allows an
            # empty token (which is also how the ids beyond the tokenizer's vocab are kept out).
            encoded = [""] * vocab_size
            for text, idx in tokenizer.get_vocab().items():
                if idx < vocab_size and idx not in banned:
                    encoded[idx] = text
            info = xgr.TokenizerInfo(
                encoded,
                info.vocab_type,
                vocab_size=vocab_size,
                stop_token_ids=list(eos),
                add_prefix_space=info.add_prefix_space,
            )
        self.tokenizer_info = info
        super().__init__(xgr, vocab_size, eos, frozenset(info.special_token_ids) - set(eos))
        # We cache ourselves (bounded); xgrammar's own cache is unbounded by default.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=int(compile_threads), cache_enabled=False
        )
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, CompiledGrammar] = collections.OrderedDict()
        self._hits = 0
        self._misses = 0

    # ------------------------------------------------------------------ compilation

    def compile(self, params: StructuredOutputsParams | Mapping) -> CompiledGrammar:
        """The compiled grammar for ``params`` (cached; thread-safe), compiled in this
        process on a miss (an engine compiles misses in a process it can kill instead:
        ``GrammarFactory``).

        Raises:
            ValueError: naming the field (``structured_outputs.json`` / ``.regex`` /
                ``.choice`` / ``.grammar``) and why: an invalid or unsupported JSON schema,
                regex or grammar, or one that matches no text.
        """
        key = self.cache_key(params)
        hit = self.lookup(key)
        if hit is not None:
            return hit
        # Compiled outside the lock: a large schema takes a while, and other requests'
        # compilations (and cache hits) need not wait for it.
        return self._store(key, compile_constraint(self._compiler, key, self.vocab_size))

    def cache_key(self, params: StructuredOutputsParams | Mapping) -> tuple:
        """The cache key of ``params``: its kind and a canonical form of the constraint
        (for a JSON schema, one ``json.loads`` and one ``json.dumps``; the others as given)."""
        if isinstance(params, Mapping):
            params = StructuredOutputsParams(**params)
        if not isinstance(params, StructuredOutputsParams):
            raise TypeError(
                "expected StructuredOutputsParams (or GuidedDecodingParams), got "
                f"{type(params).__name__} {params!r}"
            )
        return _cache_key(params)

    def lookup(self, key: tuple | StructuredOutputsParams | Mapping) -> CompiledGrammar | None:
        """The cached grammar of ``key`` (from :meth:`cache_key`, or the parameters
        themselves), or None; never compiles and never waits for a compile."""
        if not isinstance(key, tuple):
            key = self.cache_key(key)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self._hits += 1
            return hit

    def store_serialized(self, key: tuple, serialized: str) -> CompiledGrammar:
        """Cache and return the grammar of ``key`` compiled elsewhere (``serialized``: its
        ``CompiledGrammar.serialize_json()`` against this backend's tokenizer info); a
        grammar cached for ``key`` meanwhile wins."""
        hit = self.lookup(key)
        if hit is not None:
            return hit
        try:
            compiled = self._xgr.CompiledGrammar.deserialize_json(serialized, self.tokenizer_info)
        except (RuntimeError, ValueError) as err:  # pragma: no cover - same xgrammar both ends
            raise ValueError(
                f"structured_outputs.{key[0]} could not be loaded after compiling: "
                f"{_xgr_message(err)}"
            ) from None
        return self._store(key, compiled)

    def tokenizer_info_json(self) -> str:
        """This backend's tokenizer info, serialized (what a compile process starts from)."""
        return self.tokenizer_info.serialize_json()

    def _store(self, key: tuple, xgr_grammar: Any) -> CompiledGrammar:
        compiled = CompiledGrammar(key, xgr_grammar, owner=self)
        with self._lock:
            self._misses += 1
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cache_entries:
                self._cache.popitem(last=False)
        return compiled

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, self.max_cache_entries, len(self._cache))

    # ------------------------------------------------------------------ states

    def new_state(self, compiled: CompiledGrammar) -> GrammarState:
        """A fresh matcher at the start of ``compiled`` (one per sequence)."""
        if not isinstance(compiled, CompiledGrammar):
            raise TypeError(
                f"new_state needs a CompiledGrammar from compile(), got {type(compiled).__name__}"
            )
        if compiled._owner is not self:
            raise ValueError("this grammar was compiled by another StructuredOutputBackend")
        return GrammarState(self, self._xgr.GrammarMatcher(compiled.xgr_grammar), compiled)


# ---------------------------------------------------------------------- cache keys


def _cache_key(params: StructuredOutputsParams) -> tuple:
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            schema = json.loads(schema)  # valid JSON: the params checked it
        # Not sort_keys: the order of "properties" is the order the model writes them in
        # (and it matters: a "reasoning" field before "answer"), so two schemas that
        # differ in key order are two grammars. Whitespace and dict-vs-string do not matter.
        try:
            canonical = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"structured_outputs.json is not a JSON-serializable schema: {err}"
            ) from None
        return ("json", canonical)
    if kind == "json_object":
        return ("json_object",)
    if kind == "choice":
        return ("choice", tuple(params.choice))
    return (kind, getattr(params, kind))  # regex, grammar
