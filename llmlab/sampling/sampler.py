"""The batched sampler: one call per step turns the batch's logits into next tokens.

Filters (top-k, top-p, min-p) run on the whole batch at once. Drawing uses the
exponential-race form of categorical sampling, ``argmax(p / E)`` with ``E ~ Exp(1)``, so a
request with its own seed draws its noise from its own generator: the same seed gives the
same tokens whatever else shares the batch. Unseeded rows share the engine's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch

if TYPE_CHECKING:
    from llmlab.request import Request


@attrs.frozen
class SamplerOutput:
    token_ids: list[int]
    # Log-probability of each chosen token under the model's raw distribution.
    logprobs: list[float]


def _apply_min_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
    vocab = logits.shape[-1]
    for row, r in enumerate(requests):
        params = r.sampling_params
        if r.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids)
            if not params.ignore_eos:
                banned.extend(r.eos_token_ids)
            # Ids past the logits (possible when the tokenizer knows more tokens than the
            # model scores) can never be sampled, so there is nothing to suppress.
            banned = [t for t in banned if t < vocab]
            if banned:
                logits[row, banned] = float("-inf")


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (each ``[N]``; 0 = off for k).

    The returned rows are renormalised; filtered entries are exactly 0.
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    vocab = probs.shape[-1]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=probs.device)
        k = torch.where(top_k > 0, top_k, vocab)
        drop = rank[None, :] >= k[:, None]
        # Keep a token while the mass strictly before it is below top_p (so at least one).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop |= mass_before >= top_p[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _own_generator(request: Request, device: torch.device) -> torch.Generator | None:
    """The request's seeded stream, created at its first draw on the logits' device."""
    seed = request.sampling_params.seed
    if seed is None:
        return None
    if request.generator is None:
        request.generator = torch.Generator(device=device)
        request.generator.manual_seed(seed)
    return request.generator


@attrs.define
class Sampler:
    """Greedy and random sampling for a batch of requests (one new token each)."""

    name: str = "default"

    def __call__(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        generator: torch.Generator | None = None,
    ) -> SamplerOutput:
        logits = logits.float()
        _apply_min_tokens(logits, requests)
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)

        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            tokens[random_rows] = self._sample(logits, requests, random_rows, generator)

        chosen = logprobs.gather(1, tokens[:, None])[:, 0]
        return SamplerOutput(tokens.tolist(), chosen.tolist())

    def _sample(
        self,
        logits: torch.Tensor,
        requests: Sequence[Request],
        rows: list[int],
        generator: torch.Generator | None,
    ) -> torch.Tensor:
        device = logits.device
        params = [requests[i].sampling_params for i in rows]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        vocab = logits.shape[-1]
        probs = filtered_probs(
            logits[rows],
            column([p.temperature for p in params], torch.float32),
            # A top_k beyond the vocabulary keeps everything (and would overflow a long).
            column([min(max(p.top_k, 0), vocab) for p in params], torch.long),
            column([p.top_p for p in params], torch.float32),
            column([p.min_p for p in params], torch.float32),
        )
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(rows) if requests[i].sampling_params.seed is None]
        if unseeded:
            shared = torch.empty(len(unseeded), probs.shape[1], device=device)
            noise[unseeded] = shared.exponential_(generator=generator)
        for j, i in enumerate(rows):
            own = _own_generator(requests[i], device)
            if own is not None:
                noise[j].exponential_(generator=own)
        return (probs / noise).argmax(dim=-1)
