"""The model runner: turns a ``ScheduledBatch`` into tensors, runs the model, samples.

It is the only component that touches the model and the KV tensors. The batch is flat:
the new tokens of every scheduled request are concatenated (no padding), positions and KV
slots are given per token, and logits are computed only for the last token of requests
that reach the end of their known tokens this step.
"""

from __future__ import annotations

import attrs
import torch

from llmlab.attention.backend import AttentionBackend, AttentionContext, AttentionInputs
from llmlab.cache.kv_cache_manager import KVCacheManager
from llmlab.sampling.sampler import Sampler
from llmlab.scheduler.scheduler import ScheduledBatch


@attrs.define
class ModelRunner:
    model: torch.nn.Module
    attention: AttentionBackend
    sampler: Sampler
    kv: KVCacheManager
    kv_caches: list[torch.Tensor]
    device: torch.device
    generator: torch.Generator

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        bs = self.kv.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, block_tables = [], [], []
        for entry in batch.entries:
            request = entry.request
            start = entry.num_computed_tokens
            end = start + entry.num_new_tokens
            blocks = self.kv.block_ids(request.request_id)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(entry.num_new_tokens)
            seq_lens.append(end)
            block_tables.append(blocks)
        dev = self.device
        inputs = AttentionInputs(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_size=bs,
            device=dev,
            request_ids=tuple(e.request.request_id for e in batch.entries),
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            inputs,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, tuple[int, float]]:
        """Run one step; returns ``{request_id: (token_id, logprob)}`` for sampling requests."""
        input_ids, positions, inputs = self.prepare(batch)
        metadata = self.attention.build_metadata(inputs)
        attn = AttentionContext(self.attention, metadata, self.kv_caches)
        hidden = self.model(input_ids, positions, attn)

        last_rows, sampling = [], []
        offset = 0
        for entry in batch.entries:
            offset += entry.num_new_tokens
            if entry.samples:
                last_rows.append(offset - 1)
                sampling.append(entry.request)
        if not sampling:
            return {}
        logits = self.model.compute_logits(hidden[last_rows])
        out = self.sampler(logits, sampling, self.generator)
        return {
            r.request_id: (tok, lp)
            for r, tok, lp in zip(sampling, out.token_ids, out.logprobs, strict=True)
        }
