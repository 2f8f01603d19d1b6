"""The proposer contract: what a speculative proposer is given and what it returns.

A proposer guesses each speculating request's next tokens; the target model then scores
the guesses and the draft's correct prefix is kept (verification, a mechanism of the
model runner: :mod:`llmlab.speculative.verify`). Only :meth:`Proposer.propose` is required:

    class RepeatLast:                        # a whole proposer
        def propose(self, requests, k):
            return [[r.token_ids[-1]] * k for r in requests]

Optional hooks, each called only when the proposer defines it:

* ``on_verified(results)``: after verification, one :class:`Verified` per request that
  speculated (its draft, how much was accepted, the tokens emitted; the target's hidden
  states of the scored positions when ``wants_hidden_states`` is true).
* ``release(rows)``: rows freed (the request finished, was preempted or aborted); per-row
  state keyed on them is dead. ``reset()``: every row's state is dead (a failed step).
* ``bind(context)``: called once when the engine is built, with a :class:`ProposerContext`
  (vocabulary size, device, block size, the target's KV layout): what a proposer that runs
  a model of its own needs.

Proposers run inside the executor (the :class:`~llmlab.runner.model_runner.ModelRunner`),
after the batch is scheduled and before the target's forward pass, so a draft model can
write its own KV cache into the blocks the scheduler reserved for the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import attrs
import numpy as np


class DraftRequest(NamedTuple):
    """One speculating request, as a proposer sees it.

    Attributes:
        request_id: the request.
        row: its scheduler row (stable while it runs; per-row state keys on it).
        token_ids: its prompt and output so far, oldest first (a read-only int64 numpy
            view; its last token is the one whose successors are drafted).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        temperature: its sampling temperature (0: greedy), for drafters that sample.
        seed: its own seed, or None: a drafter that samples draws from
            :func:`~llmlab.sampling.metadata.stream_seed` streams of it, so a seeded
            request stays reproducible.
    """

    request_id: str
    row: int
    token_ids: np.ndarray
    num_prompt_tokens: int
    temperature: float = 0.0
    seed: int | None = None


class Verified(NamedTuple):
    """What verification made of one request's draft.

    Attributes:
        request_id, row: the request.
        draft: the tokens proposed.
        num_accepted: how many leading draft tokens the target accepted.
        token_ids: the tokens emitted this step: the accepted draft tokens, then the
            target's own next token (the correction, or the bonus when all were accepted).
        hidden_states: ``[len(draft) + 1, hidden]`` target hidden states of the scored
            positions (the last known token, then each draft token), when the proposer
            asks for them (``wants_hidden_states = True``); else None.
    """

    request_id: str
    row: int
    draft: tuple[int, ...]
    num_accepted: int
    token_ids: tuple[int, ...]
    hidden_states: Any = None


@attrs.frozen
class Proposal:
    """A proposer's answer with draft probabilities (a plain list of token lists is the
    answer of a proposer whose drafts are certain, such as n-gram lookup).

    Attributes:
        token_ids: per request, its draft (at most ``k`` tokens; may be empty).
        probs: per request, ``[len(draft), vocab]`` probabilities the drafter drew each
            draft token from (rejection sampling needs them for sampled requests), or None
            for a point mass on the drafted token.
    """

    token_ids: Sequence[Sequence[int]]
    probs: Sequence[Any] | None = None


@attrs.frozen
class ProposerContext:
    """What ``bind`` gives a proposer: the engine it drafts for.

    Attributes:
        vocab_size: the target's vocabulary (drafted ids must be below it).
        device: where the target runs.
        dtype: the target's dtype.
        block_size: tokens per KV block (a draft model's paged cache uses the same blocks).
        num_kv_blocks: blocks in the target's cache.
        max_num_seqs: rows.
        max_model_len: the longest sequence.
        attention: the target's attention backend (a draft model may run on it).
        tokenizer: the target's tokenizer, or None.
        prepare: ``prepare(entries) -> (input_ids, positions, AttentionInputs)``: flat
            model inputs for :class:`~llmlab.scheduler.batch.ScheduledRequest` spans over
            the runner's per-row block tables (a draft model's forward pass addresses its
            own paged cache through them).
        seed: the engine's seed (a proposer that samples seeds its own generator from it,
            so a run is reproducible).
        for_device: ``for_device(model, pack=True) -> model``: what the engine does to its
            own model after loading it (on CPU: fused kernels, and linears prepacked for
            oneDNN unless ``pack=False``), for a draft model.
    """

    vocab_size: int
    device: Any
    dtype: Any
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_model_len: int
    attention: Any = None
    tokenizer: Any = None
    prepare: Any = None
    for_device: Any = None
    seed: int = 0


@runtime_checkable
class Proposer(Protocol):
    """Drafts up to ``k`` next tokens for each request (see the module)."""

    def propose(
        self, requests: Sequence[DraftRequest], k: int
    ) -> Sequence[Sequence[int]] | Proposal: ...
