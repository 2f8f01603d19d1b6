"""Logits processors: the steps between the model's logits and the draw, batched.

A :class:`LogitsProcessor` is any callable ``processor(logits, batch) -> logits`` over the
whole batch: ``logits`` is ``[N, V]`` float32 (a private copy the sampler owns, so it may be
modified in place), row ``i`` belongs to ``batch.rows[i]`` (a per-row
:class:`~llmlab.sampling.metadata.SamplingRow`; ``batch.requests`` is the same list), and
:class:`~llmlab.sampling.metadata.SamplingMetadata` (also named ``SamplingBatch``) holds
the step's rows plus per-row tensors built on demand. Every built-in processor
first checks, in plain Python over the batch's parameters, whether any row uses it, and
returns the logits untouched when none does; otherwise it works on the rows that do with a
few tensor operations for the whole batch.

The default pipeline (:func:`default_processors`, ``Sampler.processors``), in order:

1. :class:`CustomLogitsProcessors`: each request's own ``logits_processors`` (vLLM v0:
   ``fn(output_token_ids, logits_row)`` or ``fn(prompt_token_ids, output_token_ids,
   logits_row)``, chosen by positional arity; ids are tuples), returning the new row. The
   only per-request Python loop that touches tensors, and only over rows that have some.
2. :class:`AllowedTokenIds`: every token outside ``allowed_token_ids`` gets ``-inf``.
3. :class:`BadWords`: ``bad_words`` (vLLM's rule): each word is tokenized as is and with a
   leading space (the latter kept when it gives a different first token and as many
   tokens); a word's last token is banned when the output ends with its other tokens, so a
   one-token word is always banned. Needs the sampler's tokenizer; tokenizations are cached.
4. :class:`LogitBias`: ``logit_bias`` added (ids beyond the logits ignored).
5. :class:`MinTokens`: while fewer than ``min_tokens`` tokens exist, ``-inf`` on the EOS ids
   (unless ``ignore_eos``) and ``stop_token_ids`` (ids beyond the logits ignored).
6. :class:`StructuredOutputMask`: rows with a ``grammar`` are masked by
   ``llmlab.sampling.structured.apply_grammar_masks`` (imported only when needed).
7. :class:`Penalties`: vLLM's repetition penalty (tokens in the prompt or the output:
   positive logits divided by it, the others multiplied), then frequency (minus penalty
   times the token's count in the output) and presence (minus penalty if it occurs in the
   output); token counts come from one scatter over the rows that use a penalty.
8. :class:`Temperature`, 9. :class:`TopK`, 10. :class:`TopP`, 11. :class:`MinP`: only on
   random rows (``temperature > 0``); each filter renormalises what the previous one left
   (as vLLM and HF do: top-p measures mass within the top-k), and min-p is relative to the
   most likely token after temperature.

Greedy rows then take the argmax of the processed logits (steps 1-7 apply to them); random
rows draw by the exponential race in :class:`~llmlab.sampling.sampler.Sampler`. Logprobs are
always those of the unprocessed logits. To add a step, insert any object with the
processor signature into ``Sampler.processors``.
"""

from __future__ import annotations

import importlib
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from llmlab.sampling.metadata import SamplingMetadata, count_tokens  # noqa: F401 (re-exported)
from llmlab.sampling.params import _positional_arity

# The name processors written against earlier versions use for the metadata.
SamplingBatch = SamplingMetadata

NEG_INF = float("-inf")


@runtime_checkable
class LogitsProcessor(Protocol):
    """One step of the pipeline, over the whole batch; may modify ``logits`` in place."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor: ...


def _on_rows(
    logits: torch.Tensor, rows: Sequence[int], batch: SamplingBatch,
    fn: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Apply ``fn`` to the sub-batch ``logits[rows]`` and write it back (no copy when
    ``rows`` is every row)."""
    if len(rows) == logits.shape[0]:
        return fn(logits)
    index = batch.index(rows)
    logits.index_copy_(0, index, fn(logits.index_select(0, index)))
    return logits


# -- tensor kernels (also used by sampler.filtered_probs) ---------------------------------


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (``[n]``, > 0), in place."""
    return logits.div_(temperature[:, None])


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, k_max: int | None = None) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (``[n]`` long, 1..V; ties with the k-th kept)."""
    if k_max is None:
        k_max = int(k.max())
    k_max = min(k_max, logits.shape[-1])
    top = logits.topk(k_max, dim=-1).values
    kth = top.gather(1, (k.clamp(1, k_max) - 1)[:, None])
    return logits.masked_fill_(logits < kth, NEG_INF)


def apply_top_p(
    logits: torch.Tensor, top_p: torch.Tensor, max_finite: int | None = None
) -> torch.Tensor:
    """Keep each row's smallest most-likely set whose probability reaches ``top_p`` (``[n]``):
    a token stays while the mass of the tokens before it is below ``top_p``.

    ``max_finite``: a bound on each row's finite logits (after top-k), so only that many
    are sorted instead of the whole vocabulary; the result is the same.
    """
    if max_finite is not None and max_finite < logits.shape[-1]:
        sorted_logits, order = logits.topk(max_finite, dim=-1)
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= top_p[:, None]
    drop_sorted[:, 0] = False  # the most likely token always stays
    if sorted_logits.shape[-1] < logits.shape[-1]:  # the rest is -inf already
        return logits.scatter_(1, order, sorted_logits.masked_fill(drop_sorted, NEG_INF))
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill_(drop, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than ``min_p`` (``[n]``) times the row's most likely one."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill_(probs < threshold, NEG_INF)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_counts: torch.Tensor | None = None,
    repetition: torch.Tensor | None = None,
    frequency: torch.Tensor | None = None,
    presence: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's penalties on ``[n, V]`` logits, given per-row ``[n]`` penalties (None: off).

    Repetition (tokens in the prompt or the output; ``prompt_counts`` needed): a positive
    logit is divided by the penalty, any other multiplied. Frequency: minus penalty times
    the token's output count. Presence: minus penalty if the token is in the output.
    """
    in_output = output_counts > 0
    if repetition is not None:
        seen = in_output if prompt_counts is None else in_output | (prompt_counts > 0)
        factor = torch.where(seen, repetition[:, None], 1.0)
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    if frequency is not None:
        logits -= frequency[:, None] * output_counts
    if presence is not None:
        logits -= presence[:, None] * in_output
    return logits


# -- the processors ----------------------------------------------------------------------


_ARITY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _takes_prompt(fn: Callable) -> bool:
    """Whether a custom processor has the 3-argument (prompt, output, logits) form."""
    try:
        return _ARITY[fn]
    except (KeyError, TypeError):
        pass
    three = _positional_arity(fn) == 3
    try:
        _ARITY[fn] = three
    except TypeError:  # not weak-referenceable: computed each time
        pass
    return three


@attrs.define
class CustomLogitsProcessors:
    """Step 1: each request's ``sampling_params.logits_processors``, row by row."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.rows_where(lambda p: p.logits_processors)
        vocab = logits.shape[-1]
        for i in rows:
            request = batch.requests[i]
            output = tuple(request.output_token_ids)
            prompt = None
            row = logits[i]
            for fn in request.sampling_params.logits_processors:
                if _takes_prompt(fn):
                    if prompt is None:
                        prompt = tuple(request.prompt_token_ids)
                    row = fn(prompt, output, row)
                else:
                    row = fn(output, row)
                if not isinstance(row, torch.Tensor) or row.shape != (vocab,):
                    raise ValueError(
                        f"logits processor {fn!r} of request {request.request_id!r} must "
                        f"return a 1-D tensor of {vocab} logits, got "
                        f"{getattr(row, 'shape', type(row).__name__)}"
                    )
            logits[i] = row
        return logits


@attrs.define
class AllowedTokenIds:
    """Step 2: ``-inf`` on every token outside a row's ``allowed_token_ids``."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.rows_where(lambda p: p.allowed_token_ids is not None)
        if not rows:
            return logits
        vocab = logits.shape[-1]
        pairs = [
            (i, t) for i in rows for t in batch.params[i].allowed_token_ids if t < vocab
        ]
        mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        mask[batch.index(rows)] = True
        if pairs:
            r, t = zip(*pairs, strict=True)
            mask[batch.index(r), batch.index(t)] = False
        return logits.masked_fill_(mask, NEG_INF)


def _encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(ids, "ids", ids))  # a `tokenizers.Tokenizer` returns an Encoding


def tokenize_bad_words(words: Sequence[str], tokenizer: Any) -> list[tuple[int, ...]]:
    """vLLM's tokenization of ``bad_words``: each word as is, and with a leading space when
    that gives a different first token and the same number of tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(_encode(tokenizer, word.lstrip()))
        if not plain:
            continue
        out.append(plain)
        spaced = tuple(_encode(tokenizer, " " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


@attrs.define
class BadWords:
    """Step 3: ban the last token of each bad word whose other tokens end the output.

    Attributes:
        max_cached: distinct ``bad_words`` tuples whose tokenization is kept (the cache is
            emptied when it would grow past this, or when the tokenizer changes).
    """

    max_cached: int = 4096
    _cache: dict = attrs.field(init=False, factory=dict, repr=False)
    _tokenizer: Any = attrs.field(init=False, default=None, repr=False)

    def token_ids(self, words: Sequence[str], tokenizer: Any) -> list[tuple[int, ...]]:
        if tokenizer is not self._tokenizer:
            self._cache.clear()
            self._tokenizer = tokenizer
        words = tuple(words)  # SamplingParams.bad_words is a list (vLLM's type)
        ids = self._cache.get(words)
        if ids is None:
            if len(self._cache) >= self.max_cached:
                self._cache.clear()
            ids = self._cache[words] = tokenize_bad_words(words, tokenizer)
        return ids

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.rows_where(lambda p: p.bad_words)
        if not rows:
            return logits
        if batch.tokenizer is None:
            raise ValueError(
                "bad_words need a tokenizer, and the sampler has none (set Sampler.tokenizer)"
            )
        vocab = logits.shape[-1]
        banned_rows, banned_ids = [], []
        for i in rows:
            request = batch.requests[i]
            output = request.output_token_ids
            for ids in self.token_ids(request.sampling_params.bad_words, batch.tokenizer):
                last, n_prefix = ids[-1], len(ids) - 1
                if last >= vocab or n_prefix > len(output):
                    continue
                if n_prefix == 0 or tuple(output[len(output) - n_prefix:]) == ids[:-1]:
                    banned_rows.append(i)
                    banned_ids.append(last)
        if banned_rows:
            logits[batch.index(banned_rows), batch.index(banned_ids)] = NEG_INF
        return logits


@attrs.define
class LogitBias:
    """Step 4: add ``logit_bias`` (ids beyond the logits are ignored)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.rows_where(lambda p: p.logit_bias)
        if not rows:
            return logits
        vocab = logits.shape[-1]
        triples = [
            (i, t, b) for i in rows for t, b in batch.params[i].logit_bias.items() if t < vocab
        ]
        if triples:
            r, t, b = zip(*triples, strict=True)
            bias = torch.tensor(b, dtype=logits.dtype, device=logits.device)
            logits.index_put_((batch.index(r), batch.index(t)), bias, accumulate=True)
        return logits


@attrs.define
class MinTokens:
    """Step 5: before ``min_tokens`` outputs, ``-inf`` on EOS (unless ``ignore_eos``) and on
    ``stop_token_ids``; ids beyond the logits (a tokenizer larger than the model's output)
    can never be drawn, so they are skipped."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.requests_where(
            lambda r: r.sampling_params.min_tokens > len(r.output_token_ids)
        )
        if not rows:
            return logits
        vocab = logits.shape[-1]
        pairs = []
        for i in rows:
            request = batch.requests[i]
            params = request.sampling_params
            banned = set(params.stop_token_ids)
            if not params.ignore_eos:
                banned.update(request.eos_token_ids)
            pairs.extend((i, t) for t in banned if t < vocab)
        if pairs:
            r, t = zip(*pairs, strict=True)
            logits[batch.index(r), batch.index(t)] = NEG_INF
        return logits


def _default_grammar_masks(logits: torch.Tensor, grammars: list) -> torch.Tensor | None:
    module = importlib.import_module("llmlab.sampling.structured")
    return module.apply_grammar_masks(logits, grammars)


@attrs.define
class StructuredOutputMask:
    """Step 6: structured outputs. When some row's ``grammar`` is set, calls
    ``apply_masks(logits, [row.grammar per row])`` (None for rows without one), which
    masks the logits in place.

    Attributes:
        apply_masks: the masking function; None means
            ``llmlab.sampling.structured.apply_grammar_masks``, imported at first use.
    """

    apply_masks: Callable[[torch.Tensor, list], torch.Tensor | None] | None = None

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        grammars = [getattr(r, "grammar", None) for r in batch.requests]
        if all(g is None for g in grammars):
            return logits
        apply = self.apply_masks if self.apply_masks is not None else _default_grammar_masks
        out = apply(logits, grammars)
        return logits if out is None else out


@attrs.define
class Penalties:
    """Step 7: repetition, frequency and presence penalties (the formulas of
    :func:`apply_penalties`), applied sparsely: only the (row, token) pairs that occur in
    the rows' histories are read and written, so the cost follows the histories' length,
    not rows x vocabulary."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.rows_where(
            lambda p: p.repetition_penalty != 1.0
            or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0
        )
        if not rows:
            return logits
        params = [batch.params[i] for i in rows]
        vocab = logits.shape[-1]
        device = logits.device
        out_keys = _history_keys(batch, rows, "output_token_ids", vocab)
        if any(p.repetition_penalty != 1.0 for p in params):
            rep_rows = [i for i in rows if batch.params[i].repetition_penalty != 1.0]
            keys = torch.cat([
                _history_keys(batch, rep_rows, "prompt_token_ids", vocab),
                _history_keys(batch, rep_rows, "output_token_ids", vocab),
            ]).unique()
            r, t = keys // vocab, keys % vocab
            factor = batch.column("repetition_penalty").to(device)[r]
            vals = logits[r, t]
            logits[r, t] = torch.where(vals > 0, vals / factor, vals * factor)
        if out_keys.numel():
            keys, counts = out_keys.unique(return_counts=True)
            r, t = keys // vocab, keys % vocab
            shift = torch.zeros_like(keys, dtype=logits.dtype)
            if any(p.frequency_penalty != 0.0 for p in params):
                shift += batch.column("frequency_penalty")[r] * counts
            if any(p.presence_penalty != 0.0 for p in params):
                shift += batch.column("presence_penalty")[r]
            logits[r, t] -= shift
        return logits


def _history_keys(batch: SamplingBatch, rows: Sequence[int], field: str, vocab: int):
    """``row * vocab + token`` for every token of ``field`` in ``rows`` (ids past the
    logits dropped), one flat tensor built from the lists in one pass."""
    lists = [getattr(batch.requests[i], field) for i in rows]
    lengths = torch.tensor([len(x) for x in lists], dtype=torch.long)
    ids = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    row_of = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    keep = ids < vocab
    return (row_of[keep] * vocab + ids[keep]).to(batch.device)


@attrs.define
class Temperature:
    """Step 8: divide random rows by their temperature (greedy rows are left as they are)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.random_rows_where(lambda p: p.temperature != 1.0)
        if not rows:
            return logits
        temperature = batch.column("temperature", rows)
        return _on_rows(logits, rows, batch, lambda sub: apply_temperature(sub, temperature))


@attrs.define
class TopK:
    """Step 9: keep the ``top_k`` largest logits of random rows (0, -1 or >= V: all)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        vocab = logits.shape[-1]
        rows = batch.random_rows_where(lambda p: 0 < p.top_k < vocab)
        if not rows:
            return logits
        ks = [batch.params[i].top_k for i in rows]
        k = torch.tensor(ks, dtype=torch.long, device=logits.device)
        return _on_rows(logits, rows, batch, lambda sub: apply_top_k(sub, k, max(ks)))


@attrs.define
class TopP:
    """Step 10: nucleus filter on random rows with ``top_p < 1``."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.random_rows_where(lambda p: p.top_p < 1.0)
        if not rows:
            return logits
        vocab = logits.shape[-1]
        # Rows cut by top-k hold at most k finite logits: sort those only (the full sort
        # of a 150k vocabulary is most of this step's cost otherwise).
        cut = [i for i in rows if 0 < batch.params[i].top_k < vocab]
        full = [i for i in rows if not 0 < batch.params[i].top_k < vocab]
        if cut:
            top_p = batch.column("top_p", cut)
            k = max(batch.params[i].top_k for i in cut)
            logits = _on_rows(logits, cut, batch, lambda sub: apply_top_p(sub, top_p, k))
        if full:
            top_p = batch.column("top_p", full)
            logits = _on_rows(logits, full, batch, lambda sub: apply_top_p(sub, top_p))
        return logits


@attrs.define
class MinP:
    """Step 11: drop tokens of random rows below ``min_p`` times the top probability."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.random_rows_where(lambda p: p.min_p > 0.0)
        if not rows:
            return logits
        min_p = batch.column("min_p", rows)
        return _on_rows(logits, rows, batch, lambda sub: apply_min_p(sub, min_p))


def default_processors() -> list[LogitsProcessor]:
    """The default pipeline, in order (a fresh list each call)."""
    return [
        CustomLogitsProcessors(),
        AllowedTokenIds(),
        BadWords(),
        LogitBias(),
        MinTokens(),
        StructuredOutputMask(),
        Penalties(),
        Temperature(),
        TopK(),
        TopP(),
        MinP(),
    ]
