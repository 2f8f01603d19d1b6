"""Incremental detokenization and stop strings, one :class:`IncrementalDetokenizer` per request.

Decoding the whole output again at every step costs O(length) per token, O(length^2) per
request. Instead each new token is decoded in a small window of the tokens just before it
(the "prefix / read offset" algorithm of vLLM and of ``tokenizers.decoders.DecodeStream``):

* ``window[:read]`` is context that was already reported (its text is ``prefix_text``);
  ``window[read:]`` are tokens whose text is not out yet.
* Each token is appended and the window decoded. If the text ends in ``"\\ufffd"`` (a
  multi-byte character split across byte-level BPE or byte-fallback tokens, not complete
  yet) or is no longer than ``prefix_text`` (the token decoded to nothing yet), nothing is
  emitted. Otherwise the text after ``prefix_text`` is emitted and the window slides to
  the tokens just read, which become the next token's context.

So every token costs one or two decodes of a few tokens, whatever the output length. The
context matters for tokenizers whose decoders look at neighbours (SentencePiece's "▁" is a
space except at the start of the text; WordPiece's "##"), which is also why the window is
primed with the last few prompt tokens: the first output token then decodes as it does in
``decode(prompt + output)``, not as the first token of a text. For byte-level BPE, the text
equals ``tokenizer.decode(output_ids)``.

Fast (``tokenizers``-backed) tokenizers are decoded by their Rust backend directly (the same
``Tokenizer.decode`` Hugging Face calls, minus its Python overhead, and without
``clean_up_tokenization_spaces``, as vLLM). Hugging Face fast tokenizers ignore
``spaces_between_special_tokens``, so it is passed only to slow tokenizers' ``decode``
(where transformers 4.x honours it).

Stop strings are searched after each token in the newly decoded text plus the
``len(stop) - 1`` characters before it, so a stop string spanning tokens is found and
each token's check costs O(new text + longest stop). While a request runs, the last
``max(len(stop)) - 1`` characters are held back from what is reported (unless
``include_stop_str_in_output``), so the start of a stop string is never streamed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from llmlab.sampling.params import SamplingParams

__all__ = ["IncrementalDetokenizer", "decode_token"]

REPLACEMENT_CHAR = "\ufffd"

# Most tokens of context kept before the unread ones (and taken from the prompt to prime
# the window; vLLM: 5): enough for any decoder that looks at neighbours, few enough to be
# free.
CONTEXT_TOKENS = 5
# A valid UTF-8 character is at most 4 bytes, i.e. at most 4 byte tokens. Tokens still
# held back beyond this many are an invalid byte sequence (or tokens that decode to
# nothing): their text is emitted as it decodes, which keeps the window, and so the cost
# per token, bounded whatever the model generates.
MAX_PENDING_TOKENS = 8
# How far back in the prompt a clean context is looked for.
_PRIME_SEARCH = 24

_Decode = Callable[[list[int]], str]


# -- per-tokenizer helpers --------------------------------------------------------------------

_lock = threading.Lock()
# tokenizer -> {(token_id, skip_special_tokens): text}; tokenizer -> special ids.
_token_text: weakref.WeakKeyDictionary[Any, dict[tuple[int, bool], str]] = (
    weakref.WeakKeyDictionary()
)
_special_ids: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _backend(tokenizer: Any) -> Any | None:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer, else None."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if callable(getattr(backend, "decode", None)) else None


def _window_decoder(
    tokenizer: Any, skip_special_tokens: bool, spaces_between_special_tokens: bool
) -> _Decode:
    backend = _backend(tokenizer)
    if backend is not None:
        decode = backend.decode

        def fast(ids: list[int]) -> str:
            return decode(ids, skip_special_tokens=skip_special_tokens)

        return fast

    def slow(ids: list[int]) -> str:
        return tokenizer.decode(
            ids,
            skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    return slow


def _cached(table: weakref.WeakKeyDictionary, tokenizer: Any, make: Callable[[], Any]) -> Any:
    try:
        return table[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable or not hashable: no cache
        return make()
    value = make()
    with _lock:
        return table.setdefault(tokenizer, value)


def _special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids ``skip_special_tokens=True`` removes (the tokenizer's special tokens)."""

    def make() -> frozenset[int]:
        ids = set(getattr(tokenizer, "all_special_ids", None) or ())
        backend = _backend(tokenizer)
        if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
            ids.update(
                i for i, tok in backend.get_added_tokens_decoder().items()
                if getattr(tok, "special", False)
            )
        return frozenset(ids)

    return _cached(_special_ids, tokenizer, make)


def decode_token(tokenizer: Any, token_id: int, skip_special_tokens: bool = False) -> str:
    """One token's text on its own, as vLLM fills ``Logprob.decoded_token``.

    ``tokenizer.decode([token_id])`` (a byte token of a multi-byte character is therefore
    ``"\\ufffd"``; special tokens appear unless ``skip_special_tokens``); an id the tokenizer
    cannot decode (e.g. a padded vocabulary row) is ``""``. Cached per tokenizer, for as long
    as the tokenizer lives; a tokenizer changed after its first use here (``add_tokens``)
    keeps the old texts.
    """
    token_id = int(token_id)
    key = (token_id, bool(skip_special_tokens))
    texts = _cached(_token_text, tokenizer, dict)
    text = texts.get(key)
    if text is None:
        text = _decode_one(tokenizer, token_id, bool(skip_special_tokens))
        texts[key] = text
    return text


def _decode_one(tokenizer: Any, token_id: int, skip_special_tokens: bool) -> str:
    if token_id < 0:
        return ""
    backend = _backend(tokenizer)
    try:
        if backend is not None:
            text = backend.decode([token_id], skip_special_tokens=skip_special_tokens)
        else:
            text = tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
    except (IndexError, KeyError, ValueError, OverflowError, TypeError):
        return ""
    return text or ""


# -- the detokenizer -------------------------------------------------------------------------


class IncrementalDetokenizer:
    """A request's output text, built token by token, with its stop strings.

    Feed each step's new output tokens to :meth:`update`; read the text to report with
    :meth:`text` (cumulative) or :meth:`delta` (new since the last ``delta``).

    Attributes:
        output_text: the text so far in its final form: cut at a matched stop string (before
            it, or after it with ``include_stop_str_in_output``). Characters still
            incomplete at the end (a partial multi-byte character) are not in it until a
            later token completes them, or until ``finished`` (then as ``"\\ufffd"``, as
            ``tokenizer.decode`` gives them).
        stop_string: the stop string that matched, or None.
        stop_buffer_length: characters held back while running: ``max(len(stop)) - 1``, 0
            with ``include_stop_str_in_output`` or without stop strings.
        num_tokens: output tokens fed so far (including those after a stop, which are
            ignored).

    Without a tokenizer, or with ``detokenize=False``, there is no text (``output_text`` is
    always ``""``) and stop strings are never matched, as in vLLM (the engine rejects stop
    strings with ``detokenize=False``).

    Stop strings follow vLLM: they are checked only once the output has more than
    ``min_tokens`` tokens (counting the token whose text is checked), and a match must
    include text decoded from the current token (a stop string wholly inside text produced
    before ``min_tokens`` is not matched later). Where several stop strings match in the
    same token's text, the one starting earliest wins (then the shorter). Text after the
    stop string, in the same token or later ones, is dropped.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        detokenize: bool = True,
    ) -> None:
        self.enabled = tokenizer is not None and bool(detokenize)
        self.stop: tuple[str, ...] = tuple(stop) if self.enabled else ()
        if any(not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty, got {self.stop!r}")
        self.include_stop_str_in_output = bool(include_stop_str_in_output)
        self.min_tokens = int(min_tokens)
        self.skip_special_tokens = bool(skip_special_tokens)
        self.spaces_between_special_tokens = bool(spaces_between_special_tokens)
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not self.include_stop_str_in_output
            else 0
        )
        self.output_text = ""
        self.stop_string: str | None = None
        self.num_tokens = 0
        self._reported = 0  # len(output_text) already returned by delta()
        self._flushed = False
        # The window: tokens[:_read] are context already reported (text _prefix_text).
        self._tokens: list[int] = []
        self._read = 0
        self._prefix_text = ""
        self._skip: frozenset[int] = frozenset()
        self._decode: _Decode | None = None
        # For fast tokenizers, a one-token window decodes exactly as decode_token does:
        # share its cache (the common case: one token read per step).
        self._single: dict[tuple[int, bool], str] | None = None
        if not self.enabled:
            return
        self._decode = _window_decoder(
            tokenizer, self.skip_special_tokens, self.spaces_between_special_tokens
        )
        if _backend(tokenizer) is not None:
            self._single = _cached(_token_text, tokenizer, dict)
        if self.skip_special_tokens:
            self._skip = _special_token_ids(tokenizer)
        self._prime(prompt_token_ids)

    @classmethod
    def from_params(
        cls, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        return cls(
            tokenizer,
            prompt_token_ids,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            detokenize=params.detokenize,
        )

    def _prime(self, prompt_token_ids: Sequence[int]) -> None:
        """Start the window with the last few prompt tokens as context.

        The context must start and end on character boundaries: a byte-fallback decoder
        turns a whole run of byte tokens into U+FFFD when the run is not valid UTF-8. So
        (like vLLM) take the shortest suffix of at least CONTEXT_TOKENS tokens (of the last
        24) that decodes with no U+FFFD.
        """
        tail = [
            int(t) for t in prompt_token_ids[-_PRIME_SEARCH:] if int(t) not in self._skip
        ]
        for n in range(min(CONTEXT_TOKENS, len(tail)), len(tail) + 1):
            text = self._safe_decode(tail[-n:])
            if REPLACEMENT_CHAR not in text:
                self._set_context(tail[-n:], text)
                return
        # Invalid bytes in the prompt, or a prompt ending inside a character: leave its last
        # bytes out of the context, so the output's first tokens are not glued to them
        # (their text is then U+FFFD, as in tokenizer.decode(output_ids)).
        tail = tail[-CONTEXT_TOKENS:]
        text = self._safe_decode(tail)
        while tail and text.endswith(REPLACEMENT_CHAR):
            tail.pop()
            text = self._safe_decode(tail)
        self._set_context(tail, text)

    def _set_context(self, tokens: list[int], text: str) -> None:
        self._tokens = tokens
        self._read = len(tokens)
        self._prefix_text = text

    def _safe_decode(self, ids: list[int]) -> str:
        assert self._decode is not None
        if not ids:
            return ""
        try:
            return self._decode(ids)
        except (IndexError, KeyError, ValueError, OverflowError, TypeError):
            # An id the tokenizer cannot decode: decode without it (it contributes "").
            good = [i for i in ids if self._decodable(i)]
            return self._decode(good) if good else ""

    def _decodable(self, token_id: int) -> bool:
        try:
            self._decode([token_id])  # type: ignore[misc]
        except (IndexError, KeyError, ValueError, OverflowError, TypeError):
            return False
        return True

    # -- feeding tokens ---------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        """A stop string matched: the text is final and further tokens are ignored."""
        return self.stop_string is not None

    def update(
        self,
        new_token_ids: Sequence[int],
        num_output_tokens: int,
        *,
        stop_terminated: bool = False,
        final: bool = False,
    ) -> str | None:
        """Add the request's new output tokens; return the stop string they complete, if any.

        ``num_output_tokens`` is the request's output length after these tokens (for
        ``min_tokens``). With ``stop_terminated`` (the last token is an EOS or stop token id
        that ended the request) that token is left out of the text unless
        ``include_stop_str_in_output`` (vLLM v1). After a stop string matched, updates are
        ignored and return None. ``final``: no tokens follow these (the request ended), so
        without stop strings they may be decoded in one call (:meth:`_append_all`).
        """
        n = len(new_token_ids)
        self.num_tokens += n
        if not self.enabled or self.stopped or n == 0:
            return None
        if stop_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        if final and not self.stop and len(new_token_ids) > 1 and self._append_all(new_token_ids):
            return None
        first_count = num_output_tokens - n + 1
        for i, token_id in enumerate(new_token_ids):
            before = len(self.output_text)
            piece = self._decode_next(int(token_id))
            if not piece:
                continue
            self.output_text += piece
            if self.stop and first_count + i > self.min_tokens and self._check_stop(before):
                return self.stop_string
        return None

    def _append_all(self, token_ids: Sequence[int]) -> bool:
        """Decode ``token_ids`` after the window in one call: done (True) when the result
        holds no incomplete or invalid character, which is when it equals what token-by-token
        decoding emits (every token's text then comes out whole, in order); else nothing
        is changed (False). Only for the last tokens of a request without stop strings:
        the window is left as it is, not ready for more."""
        window = self._tokens + [int(t) for t in token_ids if int(t) not in self._skip]
        text = self._safe_decode(window)
        if REPLACEMENT_CHAR in text or not text.startswith(self._prefix_text):
            return False
        self.output_text += text[len(self._prefix_text):]
        self._tokens, self._read, self._prefix_text = window, len(window), text
        return True

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skip:
            return ""  # removed by skip_special_tokens; keeps the window small
        tokens = self._tokens
        tokens.append(token_id)
        text = self._safe_decode(tokens)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            if len(tokens) - self._read <= MAX_PENDING_TOKENS:
                return ""  # incomplete character, or nothing new yet: hold back
            return self._advance(text, forced=True)
        return self._advance(text)

    def _advance(self, text: str, forced: bool = False) -> str:
        """Emit ``text`` (the window's decode) past the context; slide the window: the
        tokens just read become the next context."""
        new = text[len(self._prefix_text):]
        start = self._read
        if forced:  # invalid text: a shorter context keeps the window small
            start = max(start, len(self._tokens) - CONTEXT_TOKENS)
        self._tokens = tokens = self._tokens[start:]
        self._read = len(tokens)
        if len(tokens) == 1 and self._single is not None:
            key = (tokens[0], self.skip_special_tokens)
            prefix = self._single.get(key)
            if prefix is None:
                prefix = self._single[key] = self._safe_decode(tokens)
            self._prefix_text = prefix
        else:
            self._prefix_text = self._safe_decode(tokens)
        return new

    def _check_stop(self, before: int) -> bool:
        """Search the text decoded since ``before`` (plus len(stop) - 1 chars) for stops."""
        text = self.output_text
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            at = text.find(s, max(0, before - len(s) + 1))
            if at >= 0 and (best is None or (at, len(s)) < best[:2]):
                best = (at, len(s), s)
        if best is None:
            return False
        at, length, s = best
        self.output_text = text[: at + length] if self.include_stop_str_in_output else text[:at]
        self.stop_string = s
        self._tokens = []
        return True

    def finish(self) -> None:
        """No more tokens come: flush characters still held as incomplete (as ``"\\ufffd"``).

        Called by ``text(finished=True)`` and ``delta(finished=True)``; idempotent.
        """
        if self._flushed or not self.enabled:
            return
        self._flushed = True
        if self.stopped or len(self._tokens) <= self._read:
            return
        text = self._safe_decode(self._tokens)
        if len(text) <= len(self._prefix_text):
            return
        before = len(self.output_text)
        self.output_text += self._advance(text, forced=True)
        if self.stop and self.num_tokens > self.min_tokens:
            self._check_stop(before)

    # -- reporting ----------------------------------------------------------------------------

    def text(self, finished: bool) -> str:
        """The cumulative text to report now.

        While running (not ``finished`` and no stop string matched), the last
        ``stop_buffer_length`` characters are held back: they could be the start of a stop
        string, which must never be streamed.
        """
        if finished:
            self.finish()
        return self.output_text[: self._reportable(finished)]

    def delta(self, finished: bool) -> str:
        """Text newly reportable since the previous ``delta`` call (``""`` if none).

        The concatenation of all deltas, the last with ``finished=True``, is ``output_text``.
        """
        if finished:
            self.finish()
        end = self._reportable(finished)
        start = self._reported
        if end <= start:
            return ""
        self._reported = end
        return self.output_text[start:end]

    def _reportable(self, finished: bool) -> int:
        n = len(self.output_text)
        if finished or self.stopped:
            return n
        return max(0, n - self.stop_buffer_length)

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(tokens={self.num_tokens}, chars={len(self.output_text)}, "
            f"stop_string={self.stop_string!r})"
        )
