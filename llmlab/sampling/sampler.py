"""The batched sampler: one call per step turns the batch's logits into next tokens.

``Sampler(logits[N, V], metadata)``: a function of the logits and the step's
:class:`~llmlab.sampling.metadata.SamplingMetadata`, whose row ``i`` (the per-row state an
executor keeps, :class:`~llmlab.sampling.metadata.SamplingRow`) owns logits row ``i``. It
reads no engine state. (``Sampler(logits, requests, generator)`` with request-like objects
still works: they are wrapped as rows.)

1. The raw logprobs, ``log_softmax`` of the unprocessed logits, are kept for reporting
   (vLLM's ``raw_logprobs``): the sampled token's, and the top ``logprobs`` per row.
2. A float32 copy of the logits runs through ``Sampler.processors``, a list of
   :class:`~llmlab.sampling.processors.LogitsProcessor` over the whole batch (see
   :mod:`llmlab.sampling.processors` for the default pipeline and its order: custom
   processors, allowed ids, bad words, logit bias, min tokens, structured outputs,
   penalties, temperature, top-k, top-p, min-p). Replace or extend the list to change it.
3. Greedy rows (``temperature == 0``) take the argmax of the processed logits. Random rows
   draw with the exponential race, ``argmax(p / E)`` with ``E ~ Exp(1)``, so a request with
   its own seed draws its noise from its own counter-based stream (re-seeded per draw from
   the seed and the row's token count): the same seed gives the same tokens whatever else
   shares the batch, and across preemption. Unseeded rows share the executor's generator.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from llmlab import registry
from llmlab.sampling.greedy import argmax_logprob
from llmlab.sampling.logprobs import TokenLogprobs, gather_logprobs
from llmlab.sampling.metadata import SamplingMetadata, SamplingRow
from llmlab.sampling.processors import LogitsProcessor, default_processors


def _default_top(self: SamplerOutput) -> list[TokenLogprobs | None]:
    return [None] * len(self.token_ids)

logger = logging.getLogger(__name__)

# Processor types known to change nothing for a plain greedy row (see Sampler.__call__).
_BUILTIN_PROCESSORS = frozenset(type(p) for p in default_processors())


@attrs.frozen
class SamplerOutput:
    """One step's result, per row.

    Attributes:
        token_ids: the chosen token.
        logprobs: its log-probability under the model's raw (unprocessed) distribution.
        top: the chosen token with its rank, then the ``logprobs`` most likely tokens with
            ranks 1..k, for rows whose ``sampling_params.logprobs`` is set; None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    top: list[TokenLogprobs | None] = attrs.field(
        default=attrs.Factory(_default_top, takes_self=True)
    )


@registry.register("sampler", "default")
@attrs.define
class Sampler:
    """Greedy and random sampling for a batch of requests (one new token each).

    Attributes:
        name: a label for reports.
        processors: the logits pipeline, applied in order (default:
            :func:`~llmlab.sampling.processors.default_processors`).
        tokenizer: needed only by requests with ``bad_words`` (their tokenization).
    """

    name: str = "default"
    processors: list[LogitsProcessor] = attrs.field(factory=default_processors)
    tokenizer: Any = None

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata | Sequence[Any],
        generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        """Next token of every row. ``generator`` is only for the older form, where the
        second argument is a list of request-like objects instead of the metadata."""
        if not isinstance(metadata, SamplingMetadata):
            metadata = SamplingMetadata(
                [r if isinstance(r, SamplingRow) else SamplingRow.of(r) for r in metadata],
                logits.shape[-1], logits.device, generator=generator,
            )
        requests = metadata.rows
        if len(requests) != logits.shape[0]:
            raise ValueError(
                f"{logits.shape[0]} rows of logits for {len(requests)} rows of metadata"
            )
        if not requests:
            return SamplerOutput([], [], [])
        if metadata.tokenizer is None:
            metadata.tokenizer = self.tokenizer
        generator = metadata.generator
        raw = logits.float()
        builtin_only = all(type(p) in _BUILTIN_PROCESSORS for p in self.processors)
        if builtin_only and all(
            r._plain_greedy if r._plain_greedy is not None else _plain_greedy(r)
            for r in requests
        ):
            # Plain greedy rows, no top-k: one fused pass (on CPU, a C++ kernel).
            tokens, chosen = argmax_logprob(raw)
            return SamplerOutput(tokens.tolist(), chosen.tolist(), [None] * len(requests))
        wants_top = any(r.sampling_params.logprobs is not None for r in requests)
        # The full log-softmax only when someone reads the top-k; otherwise the chosen
        # token's logprob is its logit minus the row's logsumexp.
        raw_logprobs = torch.log_softmax(raw, dim=-1) if wants_top else None
        batch = metadata
        work = self.process(logits, batch, raw=raw)
        tokens = self._draw(work, batch, generator)
        if raw_logprobs is None:
            chosen = raw.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(raw, dim=-1)
            top = [None] * len(requests)
        else:
            chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0]
            top = gather_logprobs(raw_logprobs, tokens, [p.logprobs for p in batch.params])
        return SamplerOutput(tokens.tolist(), chosen.tolist(), top)

    def process(
        self, logits: torch.Tensor, metadata: SamplingMetadata, raw: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The logits each row draws from (float32): after the processors, so a greedy
        row's token is their argmax and a random row's distribution their softmax (what
        speculative verification compares drafts against). ``raw``: ``logits`` as float32,
        if the caller has it. May return ``raw`` itself when nothing would change it."""
        if raw is None:
            raw = logits.float()
        if metadata.tokenizer is None:
            metadata.tokenizer = self.tokenizer
        builtin_only = all(type(p) in _BUILTIN_PROCESSORS for p in self.processors)
        if builtin_only and all(_unchanged_greedy(r) for r in metadata.rows):
            return raw  # plain greedy rows and built-in processors only: nothing to change
        # The processors' own copy (contiguous even if ``logits`` is an expanded view).
        work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        for processor in self.processors:
            work = processor(work, metadata)
        _revive_dead_rows(work, metadata)
        return work

    def _draw(
        self, logits: torch.Tensor, batch: SamplingMetadata, generator: torch.Generator | None
    ) -> torch.Tensor:
        rows = batch.random_rows
        if not rows:
            return logits.argmax(dim=-1)
        if len(rows) == batch.num_rows:
            return self._sample(logits, batch, rows, generator)
        tokens = logits.argmax(dim=-1)
        index = batch.index(rows)
        tokens[index] = self._sample(logits.index_select(0, index), batch, rows, generator)
        return tokens

    def _sample(
        self,
        logits: torch.Tensor,
        batch: SamplingMetadata,
        rows: list[int],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        """Exponential race over ``logits`` (the processed logits of ``rows``).

        Rows cut by top-k race among their ``k`` survivors only (noise for ``k`` entries, not
        the vocabulary: most of the draw's cost). Which path a row takes depends on its own
        parameters only, so a seeded row's tokens still do not depend on its neighbours.
        """
        vocab = logits.shape[-1]
        cut = [j for j, i in enumerate(rows) if 0 < batch.params[i].top_k < vocab]
        if not cut:
            return self._race(logits, batch, rows, generator)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        k = max(batch.params[rows[j]].top_k for j in cut)
        index = batch.index(cut)
        values, ids = logits.index_select(0, index).topk(k, dim=-1)
        cut_rows = [rows[j] for j in cut]
        picked = self._race(values, batch, cut_rows, generator, widths=True)
        tokens[index] = ids.gather(1, picked[:, None])[:, 0]
        in_cut = set(cut)
        rest = [j for j in range(len(rows)) if j not in in_cut]
        if rest:
            ridx = batch.index(rest)
            tokens[ridx] = self._race(
                logits.index_select(0, ridx), batch, [rows[j] for j in rest], generator
            )
        return tokens

    def _race(
        self,
        logits: torch.Tensor,
        batch: SamplingMetadata,
        rows: list[int],
        generator: torch.Generator | None,
        widths: bool = False,
    ) -> torch.Tensor:
        """``argmax(p / E)`` per row; with ``widths``, a seeded row draws noise for its own
        ``top_k`` leading columns only (the rest are -inf for it)."""
        probs = torch.softmax(logits, dim=-1)
        device = probs.device
        requests = batch.requests
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(rows) if batch.params[i].seed is not None]
        if len(seeded) < len(rows):
            if not seeded:
                noise.exponential_(generator=generator)
            else:
                unseeded = sorted(set(range(len(rows))) - set(seeded))
                shared = torch.empty(len(unseeded), probs.shape[1], device=device)
                noise[unseeded] = shared.exponential_(generator=generator)
        for j in seeded:
            own = requests[rows[j]].seeded_generator(device)
            if widths:
                width = batch.params[rows[j]].top_k
                noise[j, :width].exponential_(generator=own)
                noise[j, width:] = 1.0
            else:
                noise[j].exponential_(generator=own)
        return (probs / noise).argmax(dim=-1)


def _unchanged_greedy(request) -> bool:
    """Greedy, and nothing (constraint, bias, penalty) changes the request's logits."""
    p = request.sampling_params
    return not (
        p.temperature != 0.0 or _restricts(request) or p.logit_bias
        or p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
    )


def _plain_greedy(row: SamplingRow) -> bool:
    """:func:`_unchanged_greedy` and no logprobs asked for: a row the fused argmax serves
    (remembered on the row)."""
    plain = row._plain_greedy = (
        row.sampling_params.logprobs is None and _unchanged_greedy(row)
    )
    return plain


def _restricts(request) -> bool:
    """Whether the request has a constraint that can forbid tokens (a grammar, allowed ids,
    bad words, min_tokens, or custom processors that may do anything)."""
    p = request.sampling_params
    return bool(
        request.grammar is not None or p.allowed_token_ids or p.bad_words or p.min_tokens
        or p.logits_processors
    )


def _revive_dead_rows(logits: torch.Tensor, batch: SamplingMetadata) -> None:
    """A row whose constraints forbid every token (a finished grammar that allows only EOS
    while ``min_tokens`` bans it, bad words covering every allowed id) would draw from NaNs.
    Such a row gets its EOS ids back, so the request ends instead of emitting garbage."""
    rows = [i for i, r in enumerate(batch.requests) if _restricts(r)]
    if not rows:
        return
    index = batch.index(rows)
    dead = torch.isneginf(logits.index_select(0, index)).all(dim=-1).nonzero()[:, 0].tolist()
    vocab = logits.shape[-1]
    for j in dead:
        request = batch.requests[rows[j]]
        eos = [t for t in request.eos_token_ids if t < vocab]
        logger.warning(
            "request %r: its constraints forbid every token; allowing EOS %s so it can end",
            request.request_id, eos,
        )
        if eos:
            logits[rows[j], eos] = 0.0
        else:
            logits[rows[j]] = 0.0
