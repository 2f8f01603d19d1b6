"""Expert load: how many tokens each expert of a mixture-of-experts model received, per
step and sparse layer (``EngineConfig.record_expert_load``; off by default).

A feature plugin (:mod:`llmlab.plugin`) named ``expert_load``, in two sides:

* :class:`ExpertLoadCounter`, the runner side: for each step it hands every
  :class:`~llmlab.models.moe.SparseMoeBlock` one row of a ``[sparse layers, experts]``
  int64 tensor on the device (``SparseMoeBlock.count_into``) for the length of the forward;
  the block's ``route`` adds its picks there (a bincount of ``chosen``). After sampling the
  tensor is read once (one host copy per step, not per layer) into an :class:`ExpertLoad`,
  returned as the first entry's item of the step's ``BatchOutput.sides["expert_load"]``;
* :class:`ExpertLoadSchedule`, the scheduler side: checks that item (the shape the model's
  config gives) and reports it, so it lands in ``StepEvent.expert_load`` and in recordings.

What is counted: every token the step's forward ran through the model, prefill chunks and
decodes alike, and the draft tokens a speculative step verifies (they go through the
experts too). The model runner's eager forward takes the batch flat, without padding rows;
a padded batch (a CUDA graph captured at a larger size) would count its padding as tokens,
so the counter asks for eager steps (``eager_only``) and a graph never replays while it
counts. Forwards outside a step's (profiling, graph capture, a drafter's own pass) count
nothing: the blocks hold no counter then. Off, no block holds one, so routing does no extra
work at all.

Tensor parallelism: every rank routes the same tokens (the router is replicated), so rank 0
counts and the other ranks do not; rank 0's output is the step's, on the in-process and the
``mp`` / Ray executors alike. Data-parallel replicas each report their own steps' load in
their own events.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from llmlab.plugin import RunnerPlugin, SchedulerPlugin

NAME = "expert_load"


def _ints(field: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of ints >= 0 (numpy's ints too, never floats); checked in C
    (``array``), since the runner builds one :class:`ExpertLoad` per step."""
    try:
        row = tuple(array("q", value))  # plain ints: a recording writes them as JSON
    except (TypeError, OverflowError):
        raise TypeError(f"expert load {field} must be ints, got {value!r}") from None
    if row and min(row) < 0:
        raise ValueError(f"expert load {field} must be >= 0, got {row!r}")
    return row


def _layers(value: Any) -> tuple[int, ...]:
    return _ints("layers", value)


def _counts(value: Any) -> tuple[tuple[int, ...], ...]:
    rows = tuple(_ints("counts", row) for row in value)
    widths = {len(row) for row in rows}
    if len(widths) > 1:
        raise ValueError(
            f"expert load counts must have as many experts in every layer, got rows of "
            f"{sorted(widths)}"
        )
    return rows


def _top_k(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"expert load top_k must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"expert load top_k must be >= 1, got {value}")
    return int(value)


@attrs.frozen
class ExpertLoad:
    """Tokens per expert in one step (or summed over steps), per sparse layer.

    Attributes:
        layers: the model's layer index of each row of ``counts`` (its sparse layers).
        counts: ``[len(layers), num_experts]``: how many of the step's tokens picked each
            expert in that layer. A row sums to ``top_k`` times the tokens that ran.
        top_k: experts each token picks.
    """

    layers: tuple[int, ...] = attrs.field(converter=_layers)
    counts: tuple[tuple[int, ...], ...] = attrs.field(converter=_counts)
    top_k: int = attrs.field(converter=_top_k)

    def __attrs_post_init__(self) -> None:
        if len(self.layers) != len(self.counts):
            raise ValueError(
                f"expert load names {len(self.layers)} layers but has {len(self.counts)} rows"
            )

    @property
    def num_experts(self) -> int:
        return len(self.counts[0]) if self.counts else 0

    @property
    def num_tokens(self) -> int:
        """Tokens that ran (every layer routes each of them once)."""
        return sum(self.counts[0]) // self.top_k if self.counts else 0

    def imbalance(self) -> tuple[float, ...]:
        """Per layer, the most loaded expert's tokens over the mean per expert (1.0: every
        expert got as many; ``num_experts / top_k`` for one token). A layer that got no
        tokens reads 1.0: nothing waits."""
        out = []
        for row in self.counts:
            total = sum(row)
            out.append(max(row) * len(row) / total if total else 1.0)
        return tuple(out)

    @classmethod
    def total(cls, loads: Iterable[ExpertLoad]) -> ExpertLoad:
        """The sum of several steps' loads (same layers, experts and ``top_k``)."""
        loads = list(loads)
        if not loads:
            raise ValueError("total() needs at least one ExpertLoad")
        first = loads[0]
        for load in loads[1:]:
            if (load.layers, load.num_experts, load.top_k) != (
                    first.layers, first.num_experts, first.top_k):
                raise ValueError(
                    f"cannot add expert loads of layers {load.layers} x {load.num_experts} "
                    f"experts (top_k {load.top_k}) to {first.layers} x {first.num_experts} "
                    f"(top_k {first.top_k})"
                )
        summed = np.sum([load.counts for load in loads], axis=0, dtype=np.int64)
        return cls(first.layers, summed.reshape(len(first.layers), -1).tolist(), first.top_k)


@attrs.frozen
class ExpertLayout:
    """What a model's config says about its experts: the sparse layers' indices, the
    experts per layer and per token (the shape every step's :class:`ExpertLoad` has)."""

    layers: tuple[int, ...]
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, model_class: type, hf_config: Any, architecture: str = "") -> ExpertLayout:
        """From an architecture's class and its config; ``ValueError`` naming the setting
        when the model has no experts."""
        moe_from_config = getattr(model_class, "moe_from_config", None)
        spec = moe_from_config(hf_config) if moe_from_config is not None else None
        layers = () if spec is None else tuple(
            i for i, sparse in enumerate(spec.sparse_layers) if sparse)
        if not layers:
            name = architecture or getattr(model_class, "__name__", str(model_class))
            raise ValueError(
                f"record_expert_load=True needs a mixture-of-experts model (Mixtral, "
                f"Qwen3-MoE, OLMoE) with at least one sparse layer; {name} has none: "
                "leave record_expert_load=False"
            )
        return cls(layers, spec.num_experts, spec.top_k)


class ExpertLoadSchedule(SchedulerPlugin):
    """The scheduler side (see the module docstring): checks each step's
    :class:`ExpertLoad` against the model's ``layout`` and reports it for the step event."""

    name = NAME

    def __init__(self, layout: ExpertLayout) -> None:
        self.layout = layout
        self._pending: ExpertLoad | None = None

    def check(self, batch: Any, output: Any) -> None:
        items = output.side(NAME)
        n = len(batch.entries)
        if items is None:
            raise ValueError(
                f"record_expert_load=True but the executor returned no expert load for a "
                f"step of {n} entries (its runner has no {ExpertLoadCounter.__name__})"
            )
        load = items[0] if items else None
        layout = self.layout
        if (not isinstance(load, ExpertLoad) or any(i is not None for i in items[1:])
                or (load.layers, load.num_experts, load.top_k)
                != (layout.layers, layout.num_experts, layout.top_k)):
            raise ValueError(
                f"expert load must be one ExpertLoad of layers {layout.layers} x "
                f"{layout.num_experts} experts (top_k {layout.top_k}) in the first entry's "
                f"item, None in the others; got {items!r}"
            )
        self._pending = load

    def begin_step(self) -> None:
        # A step whose commit failed after this check never reported its load: drop it.
        # (Overlapped, the next batch is planned before this one commits: still before.)
        self._pending = None

    def report(self) -> ExpertLoad | None:
        load, self._pending = self._pending, None
        return load

    def plans_ahead(self, batch: Any) -> bool:
        return True  # it decides nothing: overlapped scheduling stays on


class ExpertLoadCounter(RunnerPlugin):
    """The runner side (see the module docstring): the step's counts tensor is its per-step
    context, bound to the blocks between ``forward_begin`` and ``forward_end``."""

    name = NAME

    def __init__(self, layout: ExpertLayout) -> None:
        self.layout = layout
        self._blocks: tuple[Any, ...] = ()
        self._device: torch.device | None = None
        self._counting = False

    def __getstate__(self) -> dict[str, Any]:
        return {"layout": self.layout}  # unbound: each rank binds its own model

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["layout"])

    def bind(self, runner: Any) -> None:
        from llmlab.models.moe import SparseMoeBlock

        model = runner.model
        sparse = [(i, layer.mlp) for i, layer in enumerate(getattr(model, "layers", ()))
                  if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)]
        layers = tuple(i for i, _ in sparse)
        if layers != self.layout.layers:
            raise ValueError(
                f"record_expert_load: the config names sparse layers {self.layout.layers}, "
                f"the model {type(model).__name__} has {layers}"
            )
        self._blocks = tuple(block for _, block in sparse)
        self._device = runner.device
        tp = getattr(model, "tp", None)
        self._counting = tp is None or tp.rank == 0  # the ranks route alike: one counts

    def before_forward(self, batch: Any, sides: Any) -> torch.Tensor | None:
        if not self._counting:
            return None
        shape = (len(self._blocks), self.layout.num_experts)
        return torch.zeros(shape, dtype=torch.int64, device=self._device)

    def eager_only(self, context: Any) -> bool:
        return True  # on every rank alike: a replayed graph would skip the counting

    def forward_begin(self, batch: Any, query_lens: Any, context: Any) -> None:
        if context is not None:
            for block, row in zip(self._blocks, context, strict=True):
                block.count_into = row

    def forward_end(self, context: Any) -> None:
        for block in self._blocks:
            block.count_into = None

    def after_forward(self, batch: Any, hidden: Any, output: Any, context: Any) -> Any:
        if context is None:
            return output
        load = ExpertLoad(self.layout.layers, context.tolist(), self.layout.top_k)
        return output.with_side(NAME, (load,) + (None,) * (len(batch.entries) - 1))

    def shutdown(self) -> None:
        self.forward_end(None)


def expert_load_plugins(config: Any, hf_config: Any) -> Sequence[Any]:
    """The scheduler and runner sides for ``config.record_expert_load`` (none when it is
    off); ``ValueError`` before any weights load for a model without experts."""
    if not getattr(config, "record_expert_load", False):
        return ()
    from llmlab.models.registry import get_model_class

    architectures = getattr(hf_config, "architectures", None)
    layout = ExpertLayout.of(get_model_class(architectures), hf_config,
                             ", ".join(architectures or ()))
    return (ExpertLoadSchedule(layout), ExpertLoadCounter(layout))
