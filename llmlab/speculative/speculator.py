"""The model runner's speculative step: ask the proposer, verify, report.

:class:`Speculator` is mechanism owned by the :class:`~llmlab.runner.model_runner.ModelRunner`
(one per engine). For a batch whose entries carry a lookahead (``num_lookahead``, set by
the scheduler) it

1. keeps each row's token history (prompt + output, one growing array per row, so a
   proposer reads a numpy view instead of a list built every step);
2. asks the proposer for drafts, grouped by lookahead ``k``, and checks them (no more than
   ``k`` tokens, ids inside the vocabulary): a proposer that breaks this fails the step
   with a :class:`~llmlab.errors.ComponentError` naming it, before anything is computed
   or committed, so no request loses anything;
3. turns each drafted entry into a span of ``1 + len(draft)`` tokens with as many scored
   positions (the rest of the batch is unchanged), for one forward pass;
4. after the forward pass, verifies (:func:`~llmlab.speculative.verify.verify`) and tells
   the proposer what was accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.errors import ComponentError
from llmlab.scheduler.batch import ScheduledBatch
from llmlab.speculative.proposer import DraftRequest, Proposal, Verified
from llmlab.speculative.verify import verify, virtual_rows


class TokenHistory:
    """Prompt + output of every row, as growing int64 arrays (filled from the runner's
    per-row sampling state, only the tokens added since the last look)."""

    def __init__(self, num_rows: int) -> None:
        self._arrays: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_rows
        self._lengths = [0] * num_rows
        self._owners: list[str | None] = [None] * num_rows

    def release(self, rows: Sequence[int]) -> None:
        for row in rows:
            self._lengths[row] = 0
            self._owners[row] = None

    def reset(self) -> None:
        self.release(range(len(self._lengths)))

    def view(self, row: int, state: Any) -> np.ndarray:
        """The row's tokens (read-only view), brought up to date with ``state`` (its
        :class:`~llmlab.sampling.metadata.SamplingRow`)."""
        if self._owners[row] != state.request_id:
            self._owners[row] = state.request_id
            self._lengths[row] = 0
        prompt, output = state.prompt_token_ids, state.output_token_ids
        total = len(prompt) + len(output)
        have = self._lengths[row]
        array = self._arrays[row]
        if have < total:
            if array.shape[0] < total:
                grown = np.zeros(max(2 * array.shape[0], total + 64), dtype=np.int64)
                grown[:have] = array[:have]
                array = self._arrays[row] = grown
            if have < len(prompt):
                array[have : len(prompt)] = prompt[have:]
                have = len(prompt)
            array[have:total] = output[have - len(prompt) :]
            self._lengths[row] = total
        out = array[:total]
        out.flags.writeable = False
        return out


@attrs.define
class Draft:
    """One entry's draft for this step."""

    index: int  # the entry's position in the batch
    tokens: tuple[int, ...]
    probs: Any = None  # [len(tokens), vocab] or None (a point mass)


@attrs.define
class Speculator:
    """Proposes and verifies for a model runner (see the module).

    Attributes:
        proposer: the :class:`~llmlab.speculative.proposer.Proposer`.
        vocab_size: drafted ids must be below it.
    """

    proposer: Any
    vocab_size: int
    num_rows: int
    history: TokenHistory = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.history = TokenHistory(self.num_rows)

    def release(self, rows: Sequence[int]) -> None:
        self.history.release(rows)
        self._call_optional("release", tuple(rows))

    def reset(self) -> None:
        self.history.reset()
        self._call_optional("reset")

    def _call_optional(self, method: str, *args) -> Any:
        hook = getattr(self.proposer, method, None)
        if hook is None:
            return None
        try:
            return hook(*args)
        except Exception as err:
            raise ComponentError.wrap("proposer", self.proposer, method, err) from err

    # -- before the forward pass -------------------------------------------------------

    def propose(
        self, batch: ScheduledBatch, rows: Sequence[Any]
    ) -> tuple[ScheduledBatch, list[Draft]]:
        """Drafts for the batch's lookahead entries; the batch with each drafted entry's
        span extended by its draft (and scoring all of it)."""
        groups: dict[int, list[tuple[int, DraftRequest]]] = {}
        for i, e in enumerate(batch.entries):
            if e.num_lookahead:
                state = rows[e.row]
                groups.setdefault(e.num_lookahead, []).append((i, DraftRequest(
                    e.request_id, e.row, self.history.view(e.row, state),
                    len(state.prompt_token_ids), float(state.sampling_params.temperature),
                    state.sampling_params.seed,
                )))
        drafts: list[Draft] = []
        for k, members in groups.items():
            requests = [r for _, r in members]
            try:
                answer = self.proposer.propose(requests, k)
            except Exception as err:
                raise ComponentError.wrap("proposer", self.proposer, "propose", err) from err
            tokens, probs = _unpack(answer)
            if len(tokens) != len(requests):
                raise ComponentError(
                    "proposer", self.proposer, "propose",
                    f"returned {len(tokens)} drafts for {len(requests)} requests",
                )
            for j, ((index, request), draft) in enumerate(zip(members, tokens, strict=True)):
                draft = self._check(request, draft, k)
                if draft:
                    p = None if probs is None else probs[j]
                    if p is not None and tuple(p.shape) != (len(draft), self.vocab_size):
                        raise ComponentError(
                            "proposer", self.proposer, "propose",
                            f"gave probabilities of shape {tuple(p.shape)} for request "
                            f"{request.request_id!r}'s {len(draft)}-token draft; expected "
                            f"({len(draft)}, {self.vocab_size})",
                        )
                    drafts.append(Draft(index, draft, p))
        if not drafts:
            return batch, drafts
        drafts.sort(key=lambda d: d.index)
        entries = list(batch.entries)
        for d in drafts:
            e = entries[d.index]
            entries[d.index] = e._replace(
                token_ids=e.token_ids + d.tokens, num_scored=1 + len(d.tokens)
            )
        return attrs.evolve(batch, entries=tuple(entries), columns=None), drafts

    def _check(self, request: DraftRequest, draft: Any, k: int) -> tuple[int, ...]:
        try:
            draft = tuple(int(t) for t in draft)
        except (TypeError, ValueError):
            raise ComponentError(
                "proposer", self.proposer, "propose",
                f"returned {draft!r} for request {request.request_id!r}, not a sequence of "
                "token ids",
            ) from None
        if len(draft) > k:
            raise ComponentError(
                "proposer", self.proposer, "propose",
                f"returned {len(draft)} tokens for request {request.request_id!r}, more "
                f"than the k={k} it was asked for",
            )
        bad = [t for t in draft if not 0 <= t < self.vocab_size]
        if bad:
            raise ComponentError(
                "proposer", self.proposer, "propose",
                f"returned token id {bad[0]} for request {request.request_id!r}, outside "
                f"the vocabulary [0, {self.vocab_size})",
            )
        return draft

    # -- after the forward pass --------------------------------------------------------

    def verify(
        self,
        batch: ScheduledBatch,
        drafts: list[Draft],
        rows: Sequence[Any],
        hidden: torch.Tensor,
        ends: Sequence[int],
        compute_logits,
        sampler: Any,
        generator: torch.Generator | None,
    ) -> dict[int, tuple[tuple[int, ...], tuple[float, ...], Any]]:
        """Per drafted entry index: ``(tokens, logprobs, top logprobs)`` emitted. Each
        row's history gains its tokens; the proposer hears what was accepted.
        ``ends``: per entry, where its span ends in ``hidden``."""
        positions: list[int] = []
        vrows = []
        for d in drafts:
            end = ends[d.index]
            positions.extend(range(end - len(d.tokens) - 1, end))
            vrows.extend(virtual_rows(rows[batch.entries[d.index].row], d.tokens))
        scored = hidden[positions]
        forced = None
        decide = getattr(self.proposer, "num_accepted", None)
        if decide is not None:
            try:
                forced = [int(a) for a in decide([len(d.tokens) for d in drafts])]
            except Exception as err:
                raise ComponentError.wrap(
                    "proposer", self.proposer, "num_accepted", err
                ) from err
        probs = [d.probs for d in drafts] if any(d.probs is not None for d in drafts) else None
        results = verify(
            compute_logits(scored), vrows, [d.tokens for d in drafts], probs, sampler,
            generator, forced,
        )
        out = {}
        verified = []
        wants_hidden = getattr(self.proposer, "wants_hidden_states", False)
        offset = 0
        for d, result in zip(drafts, results, strict=True):
            entry = batch.entries[d.index]
            rows[entry.row].output_token_ids.extend(result[0])
            out[d.index] = result
            n = len(d.tokens) + 1
            verified.append(Verified(
                entry.request_id, entry.row, d.tokens, len(result[0]) - 1, result[0],
                scored[offset : offset + n] if wants_hidden else None,
            ))
            offset += n
        self._call_optional("on_verified", verified)
        return out


def _unpack(answer: Any) -> tuple[Sequence[Any], Sequence[Any] | None]:
    if isinstance(answer, Proposal):
        return answer.token_ids, answer.probs
    return answer, None
