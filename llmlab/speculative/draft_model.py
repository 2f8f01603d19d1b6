"""``draft_model``: a smaller model with the same vocabulary drafts for the target.

The draft model has its own paged KV cache with the target's block count and block size,
addressed through the *same* per-row block tables: position ``p`` of a row lives in the
same block and slot in both caches. So the scheduler's blocks serve both models and
nothing about prefix caching, preemption, forks or abort changes for the draft.

Each row remembers how far the draft's KV is valid (``computed``). To draft, the model
first catches up on the tokens it has not seen (a new row from position 0: on a prefix hit
the cached blocks' draft KV may not have been written, e.g. by a request that never
speculated; after a step, the target's correction token), then runs ``k - 1`` one-token
steps. Greedy requests draft the argmax; sampled ones draw at their temperature from the
request's own stream when seeded, and return the probabilities for rejection sampling.
After verification only the accepted tokens' draft KV stays valid.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmlab import registry
from llmlab.sampling.metadata import stream_seed
from llmlab.scheduler.batch import ScheduledRequest
from llmlab.speculative.proposer import DraftRequest, Proposal, ProposerContext, Verified

# Draft draws use a stream of their own (the target's verification uses ``stream_seed(seed,
# n)``): the same seed, mixed with this.
_DRAFT_STREAM = 0x5D7AF7


def resolve_draft_path(model: str) -> pathlib.Path:
    """A draft model's folder: a local path, the built-in draft's name, or a hub id."""
    from llmlab.builtin import DRAFT_MODEL_NAME, builtin_model_path
    from llmlab.models.loader import resolve_model_path

    if model == DRAFT_MODEL_NAME:
        return builtin_model_path(draft=True)
    return pathlib.Path(resolve_model_path(model, None))


@registry.register("proposer", "draft_model")
@attrs.define
class DraftModelProposer:
    """Drafts with a smaller model run by the same engine (see the module).

    Attributes:
        model: the draft model (a local folder, a hub id, or ``"llmlab-stories-draft"``).
    """

    model: str
    name: str = "draft_model"
    _ctx: ProposerContext | None = attrs.field(init=False, default=None)
    _net: Any = attrs.field(init=False, default=None)
    _kv_caches: list[torch.Tensor] = attrs.field(init=False, factory=list)
    _computed: np.ndarray = attrs.field(init=False, default=None)
    _proposed_at: np.ndarray = attrs.field(init=False, default=None)
    _generator: torch.Generator | None = attrs.field(init=False, default=None)
    _scratch: torch.Generator | None = attrs.field(init=False, default=None)

    def bind(self, ctx: ProposerContext) -> None:
        """Load the draft model and allocate its KV cache; ``ValueError`` if its vocabulary
        differs from the target's."""
        from transformers import AutoConfig

        from llmlab.cache.kv_tensors import allocate_kv_caches
        from llmlab.models.loader import load_model

        path = resolve_draft_path(self.model)
        hf_config = AutoConfig.from_pretrained(path)
        if hf_config.vocab_size != ctx.vocab_size:
            raise ValueError(
                f"the draft model {self.model!r} has a vocabulary of {hf_config.vocab_size} "
                f"tokens but the target's has {ctx.vocab_size}; a draft model must share the "
                "target's vocabulary"
            )
        self._net = load_model(path, hf_config, ctx.dtype, ctx.device)
        if ctx.for_device is not None:
            # Plain linears: a draft's are small, and oneDNN's packed call costs about 23 us
            # where F.linear takes 8 at one row (128 x 384, measured on 2 cores).
            self._net = ctx.for_device(self._net, pack=False)
        self._kv_caches = allocate_kv_caches(
            ctx.attention, self._net.kv_layout, ctx.num_kv_blocks, ctx.block_size,
            ctx.dtype, ctx.device,
        )
        self._ctx = ctx
        self._generator = torch.Generator(device=ctx.device)
        self._generator.manual_seed(ctx.seed ^ _DRAFT_STREAM)
        self._scratch = torch.Generator(device=ctx.device)
        self._computed = np.zeros(ctx.max_num_seqs, dtype=np.int64)
        self._proposed_at = np.zeros(ctx.max_num_seqs, dtype=np.int64)

    def release(self, rows: Sequence[int]) -> None:
        self._computed[list(rows)] = 0

    def reset(self) -> None:
        self._computed[:] = 0

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest], k: int) -> Proposal:
        if self._ctx is None:
            raise RuntimeError("DraftModelProposer.propose before bind (the engine binds it)")
        device = self._ctx.device
        entries = []
        for r in requests:
            n = len(r.token_ids)
            start = min(int(self._computed[r.row]), n - 1)
            entries.append(ScheduledRequest(
                r.request_id, r.row, start, tuple(r.token_ids[start:].tolist()), 0, (), 1,
            ))
            self._proposed_at[r.row] = n
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        sampled = [i for i, r in enumerate(requests) if r.temperature > 0]
        if sampled:
            index = torch.tensor(sampled, device=device)
            temperature = torch.tensor(
                [requests[i].temperature for i in sampled], device=device
            )[:, None]
        for step in range(k):
            logits = self._forward(entries)
            tokens = logits.argmax(dim=-1)
            if sampled:
                q = torch.softmax(logits.index_select(0, index).float() / temperature, dim=-1)
                tokens[index] = self._draw(q, [requests[i] for i in sampled], step)
                for j, i in enumerate(sampled):
                    probs[i].append(q[j])
            chosen = tokens.tolist()
            for i, token in enumerate(chosen):
                drafts[i].append(token)
            if step + 1 < k:
                entries = [
                    ScheduledRequest(
                        e.request_id, e.row, e.start + len(e.token_ids), (t,), 0, (), 1
                    )
                    for e, t in zip(entries, chosen, strict=True)
                ]
        for r in requests:
            self._computed[r.row] = len(r.token_ids)
        stacked = [torch.stack(p) if p else None for p in probs]
        return Proposal(drafts, stacked if any(sampled) else None)

    def _draw(self, q: torch.Tensor, requests: list[DraftRequest], step: int) -> torch.Tensor:
        """One token per row of ``q``, by the exponential race: a seeded request from its
        own draft stream (so it stays reproducible), the rest from the proposer's."""
        noise = torch.empty_like(q)
        shared = [j for j, r in enumerate(requests) if r.seed is None]
        if shared:
            noise[shared] = torch.empty(len(shared), q.shape[1], device=q.device).exponential_(
                generator=self._generator
            )
        for j, r in enumerate(requests):
            if r.seed is not None:
                self._scratch.manual_seed(
                    stream_seed(r.seed ^ _DRAFT_STREAM, len(r.token_ids) + step)
                )
                noise[j].exponential_(generator=self._scratch)
        return (q / noise).argmax(dim=-1)

    def _forward(self, entries: list[ScheduledRequest]) -> torch.Tensor:
        """Logits ``[len(entries), V]`` at each span's last position (draft KV written)."""
        from llmlab.attention.backend import AttentionContext

        attention = self._ctx.attention
        input_ids, positions, inputs = self._ctx.prepare(entries)
        metadata = attention.build_metadata(inputs)
        context = AttentionContext(attention, metadata, self._kv_caches)
        hidden = self._net(input_ids, positions, context)
        last = np.cumsum([len(e.token_ids) for e in entries]) - 1
        return self._net.compute_logits(hidden[torch.from_numpy(last).to(hidden.device)])

    def on_verified(self, results: Sequence[Verified]) -> None:
        # Draft KV is valid through the last known token and the accepted draft tokens it
        # was fed (the k-th draft token was never fed).
        for v in results:
            n = int(self._proposed_at[v.row])
            self._computed[v.row] = n + min(v.num_accepted, len(v.draft) - 1)
