"""A tensor-parallel group as a model sees it: its rank, its size, two collectives.

Megatron-style tensor parallelism (Shoeybi et al., "Megatron-LM", 2019) splits each
transformer block so that it costs two all-reduces: the q/k/v and gate/up projections are
split by output (column-parallel: each rank computes its own heads and its own slice of the
MLP's inner width, with no communication), and the attention output and down projections
are split by input (row-parallel: each rank's partial products are summed with one
all-reduce). The vocabulary is split by rows: the embedding looks up the ids a rank holds
and an all-reduce fills in the rest; the LM head computes a rank's slice of the logits and
an all-gather joins them.

A model is built with a :class:`TensorParallel` (``cls(hf_config, tp=...)``) and sizes its
parameters by it; ``TensorParallel.single()`` (the default) makes every collective a no-op,
so one code path serves both. The shapes are decided here, in one place, for every model:
:meth:`split` (heads, MLP width), :meth:`kv_heads` (replicated when there are fewer KV
heads than ranks) and :meth:`vocab_range`.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch


@attrs.define
class CommStats:
    """Time this rank spent in the model's collectives (waiting for the slowest rank
    included: that is what the step pays), how many, and the bytes it contributed."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0

    def add(self, started: float, x: torch.Tensor) -> None:
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.bytes += x.numel() * x.element_size()


@attrs.frozen
class TensorParallel:
    """This rank's place in a tensor-parallel group.

    Attributes:
        rank: 0 .. size - 1.
        size: ranks in the group (1: no parallelism; the collectives do nothing).
        group: the ``torch.distributed`` process group of the ranks (None when size is 1,
            or for a group that only describes shapes, as the build-time checks use).
        expert_parallel: a mixture-of-experts layer places whole experts on the ranks
            (:meth:`expert_range`) instead of splitting each one (``enable_expert_parallel``).
    """

    rank: int = 0
    size: int = 1
    group: Any = attrs.field(default=None, eq=False, repr=False)
    expert_parallel: bool = False
    stats: CommStats = attrs.field(factory=CommStats, eq=False, repr=False)

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    # -- shapes ---------------------------------------------------------------------------

    def split(self, total: int, what: str) -> int:
        """This rank's share of ``total`` units (heads, channels) that must divide evenly.

        Raises ``ValueError`` naming ``what`` and ``tensor_parallel_size`` otherwise.
        """
        if total % self.size:
            raise ValueError(
                f"tensor_parallel_size={self.size} must divide the model's {what} ({total}); "
                f"allowed sizes: {', '.join(str(d) for d in _divisors(total))}"
            )
        return total // self.size

    def kv_heads(self, num_kv_heads: int, num_heads: int) -> tuple[int, int]:
        """``(first KV head, count)`` this rank holds.

        With at least as many KV heads as ranks they are split like the query heads. With
        fewer, each KV head is replicated on ``size // num_kv_heads`` consecutive ranks,
        which are exactly the ranks whose query heads read it (vLLM does the same).
        """
        if num_heads % self.size:
            self.split(num_heads, "attention heads")
        if num_kv_heads >= self.size:
            count = self.split(num_kv_heads, "key/value heads")
            return self.rank * count, count
        if self.size % num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={self.size} is larger than the model's key/value heads "
                f"({num_kv_heads}) and not a multiple of them, so the heads cannot be "
                f"replicated evenly; use a divisor or a multiple of {num_kv_heads}"
            )
        return self.rank // (self.size // num_kv_heads), 1

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """``[start, end)`` of the vocabulary rows this rank holds: ``ceil(vocab / size)``
        per rank, the last rank taking what is left (the vocabulary need not divide)."""
        per_rank = -(-vocab_size // self.size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)

    def expert_range(self, num_experts: int) -> range:
        """The experts this rank holds whole under expert parallelism: a contiguous run,
        ``num_experts // size`` each and one more on the first ``num_experts % size`` ranks
        (every rank needs at least one)."""
        if num_experts < self.size:
            raise ValueError(
                f"enable_expert_parallel=True places whole experts on tensor_parallel_size="
                f"{self.size} ranks, but the model has {num_experts} experts per layer; "
                f"use at most {num_experts} ranks, or enable_expert_parallel=False to split "
                "each expert"
            )
        base, extra = divmod(num_experts, self.size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))

    def shard(self, dim: int, start: int, length: int) -> tuple[int, int, int] | None:
        """A checkpoint slice for a :class:`~llmlab.models.weights.WeightTarget` (None, the
        whole tensor, when not parallel, so one rank reads exactly what it always did)."""
        return (dim, start, length) if self.size > 1 else None

    # -- collectives ----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks (in place); ``x`` itself when not parallel."""
        if self.size > 1:
            # The group's own method: it need not be registered as torch.distributed's
            # default (several engines, each with its group, may live in one process).
            started = time.perf_counter()
            self.group.allreduce([x]).wait()
            self.stats.add(started, x)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """The smallest ``x`` over the ranks (in place)."""
        if self.size > 1:
            options = torch.distributed.AllreduceOptions()
            options.reduceOp = torch.distributed.ReduceOp.MIN
            self.group.allreduce([x], options).wait()
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Join every rank's ``[N, rows]`` slice of the vocabulary into ``[N, vocab_size]``.

        Slices are padded to the same width for the all-gather (the last rank may hold
        fewer rows) and the padding is cut off again. Every rank gets the same result.
        """
        if self.size == 1:
            return local
        per_rank = -(-vocab_size // self.size)
        if local.shape[-1] < per_rank:
            local = torch.nn.functional.pad(local, (0, per_rank - local.shape[-1]))
        started = time.perf_counter()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        self.group.allgather([parts], [local.contiguous()]).wait()
        self.stats.add(started, local)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


def vocab_parallel_embed(
    embedding: torch.nn.Embedding, input_ids: torch.Tensor, tp: TensorParallel, vocab_size: int
) -> torch.Tensor:
    """Look up ``input_ids`` in a vocabulary split across ranks: each rank embeds the ids
    it holds (zeros for the others) and one all-reduce sums the ranks' rows."""
    if tp.size == 1:
        return embedding(input_ids)
    start, end = tp.vocab_range(vocab_size)
    outside = (input_ids < start) | (input_ids >= end)
    local_ids = (input_ids - start).masked_fill(outside, 0)
    hidden = embedding(local_ids)
    hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
    return tp.all_reduce(hidden)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
