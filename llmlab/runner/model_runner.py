"""The model runner: the :class:`~llmlab.runner.executor.Executor` that runs a real model.

It turns a :class:`~llmlab.scheduler.batch.ScheduledBatch` into tensors (flat, no padding:
:mod:`llmlab.runner.inputs`), runs the model and samples (:mod:`llmlab.runner.sampling`);
everything it needs comes in the batch (rows, token spans, block-table changes, row
setups), so it never reads the scheduler, the KV cache manager or a ``Request``.

Per-row state, created when a row's first entry arrives (its ``setup``, or a fork) and
dropped when the batch frees the row:

* the block table (:class:`~llmlab.runner.block_tables.BlockTables`, one persistent array
  updated from each entry's change, so a decode step copies no table);
* the sampling state (:class:`~llmlab.sampling.metadata.SamplingRow`: parameters, prompt,
  tokens sampled so far, grammar matcher, seeded stream);
* the attention backend's state (e.g. the CPU decode mirror), created once per engine;
* each plugged-in feature's (:class:`~llmlab.plugin.RunnerPlugin`: LoRA's adapter per row,
  pooling's hidden states, a KV press's kept queries), through its hooks.

If a step fails, all of it is reset and the scheduler re-sends every row's setup (the
engine tells it), so no half-updated state survives a failure.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.attention.backend import AttentionBackend, AttentionContext, AttentionInputs
from llmlab.cache.kv_tensors import HostKVCaches
from llmlab.errors import ComponentError
from llmlab.plugin import RunnerPlugin
from llmlab.runner.cuda_graphs import DecodeGraphs
from llmlab.runner.host_kv import apply_transfers
from llmlab.runner.inputs import batch_inputs, kv_offsets
from llmlab.runner.rows import start_rows
from llmlab.runner.sampling import Sampling
from llmlab.sampling.metadata import GrammarFactory, ParamColumns, SamplingRow
from llmlab.sampling.sampler import Sampler
from llmlab.runner.block_tables import BlockTables
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch
from llmlab.scheduler.columns import columns_of
from llmlab.speculative.speculator import Speculator
from llmlab.threads import ThreadGovernor

logger = logging.getLogger(__name__)

@attrs.define
class ModelRunner(Sampling):
    """Executes batches on ``model`` with the paged KV tensors ``kv_caches``.

    Attributes:
        max_model_len: the longest sequence (sizes the per-row block tables; default: as
            many blocks as the cache has).
        grammars: builds structured-output matchers for rows that ask (None: no tokenizer,
            so no request can ask).
        decode_graphs: replays pure decode steps through CUDA graphs, or None (eager).
        threads: ticked before each step when the CPU thread count is automatic (it
            follows how many other tasks compete for the cores), or None.
        host_kv: the host pools' tensors the batch's ``kv_transfers`` move blocks to and
            from (swap preemption, the KV offload tier), or None.
        speculator: speculative decoding: drafts for entries with a lookahead, verified
            after the forward pass; None: off.
        plugins: the features plugged in on this side (bound here, called in order).
        attention_state: the backend's per-engine state (``create_state``), or None.
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
    max_model_len: int | None = None
    grammars: GrammarFactory | None = None
    decode_graphs: DecodeGraphs | None = None
    threads: ThreadGovernor | None = None
    host_kv: HostKVCaches | None = None
    speculator: Speculator | None = None
    plugins: tuple[RunnerPlugin, ...] = ()
    attention_state: Any = attrs.field(init=False, default=None)
    # It fills PLACEHOLDER tokens (last_tokens: per row, its last sample), so the engine
    # may plan ahead of it, and commit the last batch once its forward began.
    plans_ahead = True
    forward_began: Any = attrs.field(init=False, default=None)
    last_tokens: np.ndarray = attrs.field(init=False)
    block_tables: BlockTables = attrs.field(init=False)
    rows: list[SamplingRow | None] = attrs.field(init=False)
    param_columns: ParamColumns = attrs.field(init=False)
    _started: np.ndarray = attrs.field(init=False)  # per row: it has state

    def __attrs_post_init__(self) -> None:
        max_blocks = self.num_kv_blocks
        if self.max_model_len is not None:
            max_blocks = min(max_blocks, -(-self.max_model_len // self.block_size))
        self.block_tables = BlockTables(self.max_num_seqs, max_blocks)
        self.rows = [None] * self.max_num_seqs
        self.param_columns = ParamColumns(self.max_num_seqs)
        create = getattr(self.attention, "create_state", None)
        if create is not None:
            self.attention_state = create(
                num_rows=self.max_num_seqs,
                num_slots=self.num_kv_blocks * self.block_size,
                device=self.device,
            )
        self._started = np.zeros(self.max_num_seqs, dtype=bool)
        self.last_tokens = np.zeros(self.max_num_seqs, dtype=np.int64)
        for plugin in self.plugins:
            plugin.bind(self)

    def plugin(self, name: str) -> RunnerPlugin | None:
        """The plugged-in feature called ``name``, or None."""
        return next((p for p in self.plugins if p.name == name), None)

    def execute(self, batch: ScheduledBatch) -> BatchOutput:
        """Release freed rows, set up new ones, apply block copies, run the model, sample."""
        if self.threads is not None:
            self.threads.tick()
        try:
            return self._execute(batch)
        except BaseException as err:
            # Per-row state may be half-updated (e.g. a forward interrupted after some
            # layers, a token sampled for some rows only): drop all of it; the scheduler
            # sends every row's setup again, and the attention state is rebuilt from the
            # paged cache.
            self.reset()
            if isinstance(err, Exception) and not isinstance(err, ComponentError):
                raise ComponentError.wrap("executor", self, "execute", err) from err
            raise

    def reset(self) -> None:
        """Forget every row's state (after a failed step)."""
        self.rows = [None] * self.max_num_seqs
        self._started[:] = False
        self.block_tables.reset()
        reset = getattr(self.attention_state, "reset", None)
        if reset is not None:
            reset()
        if self.speculator is not None:
            self.speculator.reset()
        for plugin in self.plugins:
            plugin.reset()

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch) -> BatchOutput:
        if batch.freed_rows:
            release = getattr(self.attention_state, "release", None)
            if release is not None:
                release(batch.freed_rows)
            self.block_tables.release(batch.freed_rows)
            for row in batch.freed_rows:
                self.rows[row] = None
            self._started[list(batch.freed_rows)] = False
            if self.speculator is not None:
                self.speculator.release(batch.freed_rows)
            for plugin in self.plugins:
                plugin.release(batch.freed_rows)
        if batch.kv_transfers:  # first: every move was recorded before these copies
            apply_transfers(self, batch.kv_transfers)
        if batch.block_copies:
            self.attention.copy_blocks(self.kv_caches, list(batch.block_copies), self.block_size)
        if not batch.entries:
            return BatchOutput.empty()
        columns = columns_of(batch)
        start_rows(self, batch, columns)
        self.block_tables.apply(batch.entries, columns)
        plugins = self.plugins
        contexts = [p.before_forward(batch, batch.sides) for p in plugins]
        if self.speculator is not None and any(e.num_lookahead for e in batch.entries):
            batch, drafts = self.speculator.propose(batch, self.rows)
            if drafts:
                hidden = self.run_model(batch, self.kv_caches, self.attention_state,
                                        contexts=contexts)
                return self._after(batch, hidden, self._sample(batch, hidden, drafts), contexts)
        hidden = None
        if self.decode_graphs is not None and not any(
            p.eager_only(c) for p, c in zip(plugins, contexts, strict=True)
        ):
            # None: not a batch a graph serves (a prefill; rows whose layers hold different
            # token counts). A feature may ask for eager steps (LoRA adapters: the graphs
            # were captured without any slot index; a KV press keeping queries).
            dropped, layer_shift = kv_offsets(self.plugins, batch)
            if layer_shift is None:
                hidden = self.decode_graphs.run(batch, self.block_tables, dropped,
                                                self.last_tokens)
        if hidden is None:
            hidden = self.run_model(batch, self.kv_caches, self.attention_state,
                                    contexts=contexts)
        if self.forward_began is not None and self.device.type == "cuda":
            self.forward_began()  # launched: the host now waits only for the sampled tokens
        return self._after(batch, hidden, self._sample(batch, hidden), contexts)

    def _after(self, batch: ScheduledBatch, hidden: torch.Tensor, output: BatchOutput,
               contexts: list[Any]) -> BatchOutput:
        """The plugins' work after sampling (e.g. a KV press compacting rows: the forward
        wrote this step's KV and the row's blocks are only read)."""
        for plugin, context in zip(self.plugins, contexts, strict=True):
            output = plugin.after_forward(batch, hidden, output, context)
        return output

    def shutdown(self) -> None:
        """Release the host KV pools (a disk tier's temporary directory is removed)."""
        if self.host_kv is not None:
            self.host_kv.close()
        for plugin in self.plugins:
            plugin.shutdown()

    # -- tensors -----------------------------------------------------------------------

    def prepare(
        self,
        batch: ScheduledBatch,
        attention_state: Any = None,
        block_tables: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs]:
        """Flat ``input_ids``, ``positions`` and the attention description of a batch
        (:func:`~llmlab.runner.inputs.batch_inputs`). ``block_tables``: ``[len(entries),
        width]`` tables of the entries, for a batch that is not this runner's (a profiling
        pass); by default the rows' own."""
        return batch_inputs(self, batch, attention_state, block_tables)
    def run_model(
        self,
        batch: ScheduledBatch,
        kv_caches: list[torch.Tensor],
        attention_state: Any = None,
        block_tables: np.ndarray | None = None,
        contexts: list[Any] | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of every token in the batch
        (``contexts``: the plugins' per-step contexts, from ``before_forward``)."""
        input_ids, positions, inputs = self.prepare(batch, attention_state, block_tables)
        layer_metadata = None
        try:
            metadata = self.attention.build_metadata(inputs)
            if inputs.layer_shift is not None:
                # A KV press kept different counts per layer: one metadata per distinct
                # shift, shared by the layers that have it.
                built: dict[bytes, Any] = {}
                per_layer = []
                for shift in inputs.layer_shift:
                    key = shift.tobytes()
                    if key not in built:
                        built[key] = (
                            metadata if not shift.any()
                            else self.attention.build_metadata(inputs.shifted(shift))
                        )
                    per_layer.append(built[key])
                layer_metadata = tuple(per_layer)
        except Exception as err:
            raise ComponentError.wrap(
                "attention backend", self.attention, "build_metadata", err
            ) from err
        plugins = self.plugins if contexts is not None else ()
        observe = None
        for plugin, ctx in zip(plugins, contexts or (), strict=True):
            observe = observe or plugin.observe_queries(ctx)
        context = AttentionContext(self.attention, metadata, kv_caches, layer_metadata, observe)
        if self.forward_began is not None and self.device.type != "cuda":
            self.forward_began()  # inputs built: a CPU forward holds the host from here
        if not plugins:
            return self.model(input_ids, positions, context)
        lens = np.asarray(inputs.query_lens, dtype=np.int64)
        for plugin, ctx in zip(plugins, contexts, strict=True):
            plugin.forward_begin(batch, lens, ctx)
        try:
            return self.model(input_ids, positions, context)
        finally:
            for plugin, ctx in zip(plugins, contexts, strict=True):
                plugin.forward_end(ctx)


