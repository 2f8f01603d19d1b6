"""``ExpertRouting``: how a mixture-of-experts model's tokens spread over its experts, as
the roofline cost model (:mod:`llmlab.sim.roofline`) prices it.

Two numbers decide what experts cost a step beyond their active parameters:

* which experts run, so whose weights are read: an expert runs when at least one of the
  step's tokens picks it. Under uniform routing a decode of one token reads ``top_k``
  experts a layer and a long prefill reads them all; with ``shares`` (each expert's chance
  of being picked, from a recorded run) popular experts are read sooner and rare ones later
  (:meth:`~llmlab.sim.model_shape.ModelShape.expected_experts_read`);
* how evenly the tokens spread: ``imbalance``, the most loaded expert's tokens over the mean
  per expert. Where the experts run side by side and the step waits for the busiest (expert
  parallelism: each device holds some experts; a kernel giving each expert an equal share
  of the device), the experts' compute takes ``imbalance`` times its balanced time. One
  device running a grouped GEMM over the experts pays their total work instead:
  ``imbalance=1`` (the default) prices that.

:meth:`ExpertRouting.from_loads` reads both from a real run's
:class:`~llmlab.models.expert_load.ExpertLoad`\\ s (``StepEvent.expert_load``, with
``record_expert_load=True``), summed over the run: the skew the router shows over many
steps, not a small step's sampling noise (one decode token always reads
``num_experts / top_k`` over the mean).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import attrs

from llmlab.models.expert_load import ExpertLoad
from llmlab.validation import as_real


def _shares(value: Any) -> tuple[tuple[float, ...], ...] | None:
    if value is None:
        return None
    rows = tuple(tuple(as_real("shares", q, min=0, max=1) for q in row) for row in value)
    if not rows or len({len(row) for row in rows}) != 1 or not rows[0]:
        raise ValueError(
            f"shares must be one row per sparse layer, each a share per expert (all rows as "
            f"long); got rows of {sorted({len(row) for row in rows})}"
        )
    return rows


@attrs.frozen
class ExpertRouting:
    """How tokens spread over the experts (see the module docstring).

    Attributes:
        shares: per sparse layer, the chance that a token picks each expert (a row sums to
            ``top_k``); None: uniform routing.
        imbalance: the most loaded expert's tokens over the mean per expert, >= 1; the
            experts' compute is priced at that expert's pace (1: balanced, or one device's
            grouped GEMM).
    """

    shares: tuple[tuple[float, ...], ...] | None = attrs.field(default=None, converter=_shares)
    imbalance: float = attrs.field(
        default=1.0, converter=functools.partial(as_real, "imbalance", min=1.0)
    )

    @classmethod
    def from_loads(cls, loads: Iterable[ExpertLoad | Any]) -> ExpertRouting:
        """From recorded loads: :class:`ExpertLoad`\\ s, or step events (those without a
        load are skipped). ``shares``: each expert's tokens over the tokens that ran, per
        layer; ``imbalance``: over the run's totals, the mean over layers of the busiest
        expert's tokens over the mean per expert."""
        found = [getattr(item, "expert_load", item) for item in loads]
        found = [load for load in found if load is not None]
        if not found:
            raise ValueError(
                "no expert load to read: record the run with record_expert_load=True (its "
                "StepEvents then carry expert_load)"
            )
        total = ExpertLoad.total(found)
        tokens = total.num_tokens
        if tokens == 0:
            raise ValueError("the recorded expert loads hold no tokens")
        imbalance = total.imbalance()
        return cls(
            shares=tuple(tuple(c / tokens for c in row) for row in total.counts),
            imbalance=max(1.0, sum(imbalance) / len(imbalance)),
        )
