"""Verification: which drafted tokens the target keeps (a mechanism, not a component).

Each speculating request scored ``m + 1`` positions in one forward pass: its last known
token, then its ``m`` draft tokens. Position ``j`` gives the target's distribution for the
token after ``draft[:j]``, computed with the request's whole pipeline (penalties, bias,
bad words, temperature, top-k/p, min-p) as if ``draft[:j]`` had been generated: each
position is a *virtual row* whose output history ends with the draft's first ``j``
tokens. Then:

* greedy requests keep the longest draft prefix that equals the target's argmax at every
  position, then the target's own argmax at the first mismatch (or after the last draft
  token, the bonus token): exactly the tokens plain decoding would produce;
* sampled requests use rejection sampling (Leviathan et al. 2023; Chen et al. 2023):
  draft token ``x`` drawn from ``q`` is kept with probability ``min(1, p(x) / q(x))``; at
  the first rejection the token is drawn from ``max(p - q, 0)`` renormalised; when all are
  kept, the bonus token is drawn from ``p``. Every emitted token is then distributed as
  the target's own sample. A drafter without probabilities (n-gram, suffix) drafts from a
  point mass: ``x`` is kept with probability ``p(x)``, and a rejection draws from ``p``
  with ``x`` removed.

Seeded requests draw from their own counter-based stream at depth ``j`` (the same stream
index plain decoding would use for that token), so they are reproducible for a given
proposer. Log-probabilities are the raw model's, as for every other token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from llmlab.sampling.logprobs import gather_logprobs
from llmlab.sampling.metadata import SamplingMetadata, SamplingRow, stream_seed


def virtual_rows(row: SamplingRow, draft: Sequence[int]) -> list[SamplingRow]:
    """Row states at each scored position of a draft: the row as if ``draft[:j]`` had
    been generated, for ``j = 0 .. len(draft)`` (the first is the row itself)."""
    out = [row]
    history = list(row.output_token_ids)
    for token in draft:
        history.append(token)
        out.append(SamplingRow(
            row.request_id, row.sampling_params, row.prompt_token_ids, list(history),
            row.eos_token_ids, None,
        ))
    return out


def verify(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    drafts: Sequence[Sequence[int]],
    draft_probs: Sequence[Any] | None,
    sampler: Any,
    generator: torch.Generator | None,
    forced: Sequence[int] | None = None,
) -> list[tuple[tuple[int, ...], tuple[float, ...], tuple[Any, ...] | None]]:
    """Per draft: ``(tokens, logprobs, top logprobs or None)`` emitted.

    ``logits``: ``[sum(len(d) + 1), V]`` raw logits of every draft's scored positions, in
    order; ``rows``: the virtual row of each (:func:`virtual_rows`). ``draft_probs``: per
    draft, ``[len(d), V]`` probabilities it was drawn from, or None (a point mass).
    ``forced``: per draft, how many tokens to accept regardless (synthetic acceptance);
    the token after them is the target's own at that position.
    """
    device = logits.device
    num_rows, vocab = logits.shape
    lengths = [len(d) for d in drafts]
    starts = np.cumsum([0] + [m + 1 for m in lengths])[:-1]
    metadata = SamplingMetadata(list(rows), vocab, device, generator=generator)
    raw = logits.float()
    work = sampler.process(logits, metadata, raw=raw)
    argmax = work.argmax(dim=-1).tolist()
    random_rows = metadata.random_rows  # virtual rows with temperature > 0
    probs = None
    prow = np.full(num_rows, -1, dtype=np.int64)
    if random_rows:
        prow[random_rows] = np.arange(len(random_rows))
        probs = torch.softmax(work[random_rows], dim=-1)

    # Acceptance of every draft position, decided for all drafts at once.
    streams = _Streams(device)
    accepted: list[int] = []
    for i, draft in enumerate(drafts):
        base, m = int(starts[i]), lengths[i]
        if forced is not None:
            accepted.append(min(forced[i], m))
            continue
        if prow[base] < 0:  # greedy: keep while the draft is the target's argmax
            a = 0
            while a < m and argmax[base + a] == draft[a]:
                a += 1
            accepted.append(a)
            continue
        accepted.append(-1)  # decided below, vectorised over the sampled drafts
    sampled = [i for i, a in enumerate(accepted) if a < 0]
    if sampled:
        flat_v = np.concatenate([starts[i] + np.arange(lengths[i]) for i in sampled])
        flat_d = torch.tensor([t for i in sampled for t in drafts[i]], device=device)
        p_at = probs[torch.from_numpy(prow[flat_v]).to(device), flat_d]
        q_at = torch.ones_like(p_at)
        if draft_probs is not None:
            offset = 0
            for i in sampled:
                m = lengths[i]
                if draft_probs[i] is not None:
                    q = draft_probs[i].to(device=device, dtype=torch.float32)
                    q_at[offset : offset + m] = q[torch.arange(m, device=device),
                                                  flat_d[offset : offset + m]]
                offset += m
        u = _uniforms(rows, flat_v, generator, streams, device)
        keep = (u * q_at < p_at).tolist()
        offset = 0
        for i in sampled:
            m = lengths[i]
            run = keep[offset : offset + m]
            accepted[i] = run.index(False) if False in run else m
            offset += m

    # The token after the accepted run: the target's own there (residual after a
    # rejection), drawn for all sampled drafts in one race.
    finals: list[int] = [0] * len(drafts)
    # (draft index, distribution, its virtual row, a uniform was drawn there first)
    race_rows: list[tuple[int, torch.Tensor, int, bool]] = []
    for i, draft in enumerate(drafts):
        a, m = accepted[i], lengths[i]
        v = int(starts[i]) + a
        if prow[v] < 0:
            finals[i] = argmax[v]
            continue
        dist = probs[prow[v]]
        if a < m and forced is None:
            q = None if draft_probs is None else draft_probs[i]
            if q is None:
                dist = dist.clone()
                dist[draft[a]] = 0.0
            else:
                dist = (dist - q[a].to(device=device, dtype=torch.float32)).clamp_(min=0.0)
            if not float(dist.sum()) > 0.0:  # p == q: the residual is empty; p itself
                dist = probs[prow[v]]
        race_rows.append((i, dist, v, a < m and forced is None))
    if race_rows:
        dists = torch.stack([d for _, d, _, _ in race_rows])
        noise = torch.empty_like(dists)
        seeded = [rows[v].sampling_params.seed is not None for _, _, v, _ in race_rows]
        shared = [j for j, s in enumerate(seeded) if not s]
        if shared:
            part = torch.empty(len(shared), vocab, device=device).exponential_(generator=generator)
            noise[shared] = part
        for j, (_, _, v, after_uniform) in enumerate(race_rows):
            if seeded[j]:
                # The row's stream at this depth; after a rejection there, past the uniform
                # already drawn from it.
                gen = streams.at(rows[v])
                if after_uniform:
                    torch.rand((), generator=gen, device=device)
                noise[j].exponential_(generator=gen)
        picked = (dists / noise).argmax(dim=-1).tolist()
        for (i, _, _, _), token in zip(race_rows, picked, strict=True):
            finals[i] = token

    # Emitted tokens and their raw logprobs.
    emit_v: list[int] = []
    emit_t: list[int] = []
    for i, draft in enumerate(drafts):
        a = accepted[i]
        emit_v.extend(range(int(starts[i]), int(starts[i]) + a + 1))
        emit_t.extend([*draft[:a], finals[i]])
    index = torch.tensor(emit_v, device=device)
    tokens = torch.tensor(emit_t, device=device)
    picked_raw = raw.index_select(0, index)
    chosen = (picked_raw.gather(1, tokens[:, None])[:, 0]
              - torch.logsumexp(picked_raw, dim=-1)).tolist()
    wants_top = [rows[v].sampling_params.logprobs for v in emit_v]
    tops: list[Any] = [None] * len(emit_v)
    if any(k is not None for k in wants_top):
        tops = gather_logprobs(torch.log_softmax(picked_raw, dim=-1), tokens, wants_top)
    out = []
    offset = 0
    for i in range(len(drafts)):
        n = accepted[i] + 1
        span = slice(offset, offset + n)
        top = tuple(tops[span]) if wants_top[offset] is not None else None
        out.append((tuple(emit_t[span]), tuple(chosen[span]), top))
        offset += n
    return out


class _Streams:
    """Seeded rows' counter-based streams through one scratch generator: draw ``j`` of a
    row is seeded by ``stream_seed(seed, number of its tokens before it)``, as in plain
    sampling (:meth:`~llmlab.sampling.metadata.SamplingRow.seeded_generator`)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._gen: torch.Generator | None = None  # made at the first seeded row

    def at(self, row: SamplingRow) -> torch.Generator:
        if self._gen is None:
            self._gen = torch.Generator(device=self._device)
        self._gen.manual_seed(stream_seed(row.sampling_params.seed, len(row.output_token_ids)))
        return self._gen


def _uniforms(rows, flat_v, generator, streams: _Streams, device) -> torch.Tensor:
    """One uniform per draft position: the first draw of the row's own stream at that depth
    when it is seeded, else from the shared generator."""
    u = torch.empty(len(flat_v), device=device)
    shared = []
    for j, v in enumerate(flat_v.tolist()):
        row = rows[v]
        if row.sampling_params.seed is None:
            shared.append(j)
        else:
            u[j] = torch.rand((), generator=streams.at(row), device=device)
    if shared:
        u[shared] = torch.rand(len(shared), generator=generator, device=device)
    return u
