"""The model runner: the :class:`~llmlab.engine.executor.Executor` that runs a real model.

It turns a :class:`~llmlab.scheduler.batch.ScheduledBatch` into tensors, runs the model and
samples; everything it needs comes in the batch (rows, token spans, block tables), so it
never reads the scheduler or the KV cache manager. The batch is flat: the new tokens of
every scheduled request are concatenated (no padding), positions and KV slots are given per
token, and logits are computed only for the positions each entry asks to score.

Per-row state of the attention backend (e.g. the CPU decode mirror) is created here, once
per engine, released when the batch says a row was freed, and reset if a step fails.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from llmlab.attention.backend import (
    AttentionBackend,
    AttentionContext,
    AttentionInputs,
    block_table_tensor,
    token_slots,
)
from llmlab.errors import ComponentError
from llmlab.sampling.logprobs import gather_logprobs
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch

# Prompt positions scored at once for prompt_logprobs (bounds a [rows, vocab] tensor).
_PROMPT_LOGPROBS_CHUNK = 256


@attrs.define
class ModelRunner:
    """Executes batches on ``model`` with the paged KV tensors ``kv_caches``.

    Attributes:
        attention_state: the backend's per-engine state (``create_state``), or None.
        decode_graphs: replays pure decode steps through CUDA graphs
            (:class:`~llmlab.engine.cuda_graphs.DecodeGraphs`), or None (eager).
    """

    model: torch.nn.Module
    attention: AttentionBackend
    sampler: Sampler
    kv_caches: list[torch.Tensor]
    block_size: int
    device: torch.device
    generator: torch.Generator
    num_kv_blocks: int
    max_num_seqs: int
    attention_state: Any = attrs.field(init=False, default=None)
    # Set by the builder on CUDA unless enforce_eager (llmlab.engine.cuda_graphs).
    decode_graphs: Any = attrs.field(init=False, default=None)
    # Set by the builder when the CPU thread count is automatic (llmlab.threads.ThreadGovernor):
    # ticked before each step, it follows how many other tasks compete for the cores.
    threads: Any = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        create = getattr(self.attention, "create_state", None)
        if create is not None:
            self.attention_state = create(
                num_rows=self.max_num_seqs,
                num_slots=self.num_kv_blocks * self.block_size,
                device=self.device,
            )

    # -- the executor interface --------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> BatchOutput:
        """Release freed rows, apply block copies, run the model, sample."""
        if self.threads is not None:
            self.threads.tick()
        try:
            return self._execute(batch)
        except BaseException as err:
            # Per-row state may be half-updated (e.g. a forward interrupted after some
            # layers): start it afresh; the next step rebuilds it from the paged cache.
            reset = getattr(self.attention_state, "reset", None)
            if reset is not None:
                reset()
            if isinstance(err, Exception) and not isinstance(err, ComponentError):
                raise ComponentError.wrap("executor", self, "execute", err) from err
            raise

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> BatchOutput:
        release = getattr(self.attention_state, "release", None)
        if batch.freed_rows and release is not None:
            release(batch.freed_rows)
        if batch.block_copies:
            self.attention.copy_blocks(self.kv_caches, list(batch.block_copies), self.block_size)
        if not batch.entries:
            return BatchOutput.empty()
        hidden = None
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(batch)  # None: not a batch a graph serves
        if hidden is None:
            hidden = self.run_model(batch, self.kv_caches, self.attention_state)

        # Rows of ``hidden`` to sample from: each scoring entry's last position, once for
        # the request and once more for each parallel sample it forks into.
        scored_rows: list[int] = []
        sample_requests = []
        prompt_scores: list[Any] = [None] * len(batch.entries)
        prompt_starts: list[int] = [0] * len(batch.entries)
        offset = 0
        for i, entry in enumerate(batch.entries):
            base, offset = offset, offset + len(entry.token_ids)
            k = entry.num_scored
            if k > 1:
                raise NotImplementedError(
                    f"request {entry.request_id!r} asks to score {k} positions; the model "
                    "runner samples one token per request (speculative verification is not "
                    "built yet)"
                )
            if k:
                scored_rows.extend([offset - 1] * (1 + len(entry.forks)))
                sample_requests.append(entry.request)
                sample_requests.extend(entry.forks)
            if entry.request.needs_prompt_logprobs:
                scores = self._prompt_logprobs(entry, hidden, base)
                if scores is not None:
                    prompt_starts[i], prompt_scores[i] = scores
        any_prompt = any(p is not None for p in prompt_scores)
        prompt_fields = {
            "prompt_logprobs": tuple(prompt_scores) if any_prompt else None,
            "prompt_logprobs_start": tuple(prompt_starts) if any_prompt else None,
        }
        if not scored_rows:
            empty = BatchOutput.empty(len(batch.entries))
            return attrs.evolve(empty, **prompt_fields) if any_prompt else empty
        logits = self.model.compute_logits(hidden[scored_rows])
        try:
            sampled = self.sampler(logits, sample_requests, self.generator)
        except Exception as err:
            raise ComponentError.wrap("sampler", self.sampler, "__call__", err) from err
        tops = getattr(sampled, "top", None) or [None] * len(sampled.token_ids)
        token_ids, logprobs, top_logprobs, forks, j = [], [], [], [], 0
        for entry in batch.entries:
            if not entry.num_scored:
                token_ids.append(())
                logprobs.append(())
                top_logprobs.append(())
                forks.append(())
                continue
            token_ids.append((sampled.token_ids[j],))
            logprobs.append((sampled.logprobs[j],))
            top_logprobs.append((tops[j],))
            j += 1
            samples = []
            for _ in entry.forks:
                samples.append((sampled.token_ids[j], sampled.logprobs[j], tops[j]))
                j += 1
            forks.append(tuple(samples))
        return BatchOutput(
            tuple(token_ids),
            tuple(logprobs),
            top_logprobs=tuple(top_logprobs) if any(t is not None for t in tops) else None,
            forks=tuple(forks) if any(forks) else None,
            **prompt_fields,
        )

    def _prompt_logprobs(self, entry, hidden: torch.Tensor, base: int):
        """Logprobs of the prompt tokens this entry's span predicts, not recorded before:
        ``(first prompt position scored, [TokenLogprobs, ...])`` or None."""
        request = entry.request
        prompt = request.prompt_token_ids
        # Position p predicts prompt token p + 1; tokens up to len(recorded) - 1 are done.
        lo = max(entry.start, len(request.prompt_logprobs) - 1)
        hi = min(entry.start + len(entry.token_ids), len(prompt) - 1)
        if hi <= lo:
            return None
        k = request.sampling_params.prompt_logprobs
        scores = []
        # Chunks bound the [rows, vocab] logits of a long prompt.
        for a in range(lo, hi, _PROMPT_LOGPROBS_CHUNK):
            b = min(hi, a + _PROMPT_LOGPROBS_CHUNK)
            rows = hidden[base + a - entry.start : base + b - entry.start]
            lp = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)
            targets = torch.tensor(prompt[a + 1 : b + 1], device=lp.device)
            scores.extend(gather_logprobs(lp, targets, [k] * (b - a)))
        return lo + 1, scores

    # -- tensors -----------------------------------------------------------------------

    def prepare(
        self, batch: ScheduledBatch, attention_state: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        """Flat ``input_ids``, ``positions`` and the attention description of a batch."""
        entries = batch.entries
        input_ids: list[int] = []
        query_lens, seq_lens, starts = [], [], []
        for entry in entries:
            n = len(entry.token_ids)
            input_ids.extend(entry.token_ids)
            query_lens.append(n)
            starts.append(entry.start)
            seq_lens.append(entry.start + n)
        tables = block_table_tensor([e.block_table for e in entries])
        # Host-side index arithmetic in numpy: a few small arrays per step, where each
        # torch op would cost more in dispatch than in work.
        lens = np.asarray(query_lens, dtype=np.int64)
        start = np.asarray(starts, dtype=np.int64)
        if (lens == 1).all():  # all decodes: one token at each start
            seq_index = np.arange(len(entries))
            pos = start
        else:
            seq_index = np.repeat(np.arange(len(entries)), lens)
            # Position of each flat token: its sequence's start plus its offset in the span.
            first = np.cumsum(lens) - lens
            pos = np.arange(len(input_ids)) - first[seq_index] + start[seq_index]
        slots = torch.from_numpy(token_slots(tables.numpy(), seq_index, pos, self.block_size))
        positions = torch.from_numpy(pos)
        dev = self.device
        inputs = AttentionInputs(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=slots.to(dev),
            block_size=self.block_size,
            device=dev,
            rows=tuple(e.row for e in entries),
            state=attention_state,
        )
        return torch.tensor(input_ids, dtype=torch.long, device=dev), positions.to(dev), inputs

    def run_model(
        self, batch: ScheduledBatch, kv_caches: list[torch.Tensor], attention_state: Any = None
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of every token in the batch."""
        input_ids, positions, inputs = self.prepare(batch, attention_state)
        try:
            metadata = self.attention.build_metadata(inputs)
        except Exception as err:
            raise ComponentError.wrap("attention backend", self.attention, "build_metadata", err) from err
        return self.model(input_ids, positions, AttentionContext(self.attention, metadata, kv_caches))
