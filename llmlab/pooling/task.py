"""Pooling tasks: what a model can do with a pooled vector, and each task's last step.

:class:`PoolingSpec` is plain data decided when the engine is built (the model's tasks,
hidden size, number of labels, the pooler's needs and the defaults); input processing
checks each request's :class:`~llmlab.pooling_params.PoolingParams` against it and fills
in the defaults, so a request that cannot run is refused before anything is queued.
:func:`finish` is the executor's last step for the requests whose prompts were pooled:

* ``embed``: Matryoshka truncation to ``dimensions``, then L2 normalization (vLLM's order);
* ``classify`` / ``score``: the model's classifier (``score`` head) on the pooled vector,
  then the activation: softmax over the labels, or sigmoid for one label (a
  cross-encoder's relevance score), as vLLM and sentence-transformers apply it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

from llmlab.pooling_params import PoolingParams


@attrs.frozen
class PoolingSpec:
    """A pooling engine's fixed facts (picklable; the executor and input processing share
    it).

    Attributes:
        tasks: the tasks this model runs (``"encode"`` means ``default_task``).
        default_task: the task of a request that names none.
        hidden_size: the pooled vector's width (bounds ``dimensions``).
        num_labels: the classifier's outputs (0: no classifier).
        pooling_type: the pooler's registered name.
        uses_all_positions: the pooler reads every prompt position (no prefix-cache hits).
        normalize, use_activation: the defaults for requests that leave them None.
    """

    tasks: tuple[str, ...]
    default_task: str
    hidden_size: int
    num_labels: int = 0
    pooling_type: str = "last"
    uses_all_positions: bool = False
    normalize: bool = True
    use_activation: bool = True

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's own copy of ``params`` with the task and defaults filled in, or
        ``ValueError`` naming the field, the value and what this model allows."""
        task = params.task or self.default_task
        if task == "encode":
            task = self.default_task
        if task not in self.tasks:
            allowed = ", ".join(repr(t) for t in self.tasks)
            raise ValueError(
                f"task={task!r} is not supported by this model (a {self.default_task} "
                f"model); allowed: {allowed}"
            )
        if task == "score" and self.num_labels != 1:
            raise ValueError(
                f"task='score' needs a classifier with one label (a cross-encoder); this "
                f"model has num_labels={self.num_labels}"
            )
        if params.dimensions is not None:
            if task != "embed":
                raise ValueError(
                    f"dimensions={params.dimensions} applies to embeddings only, but the "
                    f"task is {task!r}"
                )
            if params.dimensions > self.hidden_size:
                raise ValueError(
                    f"dimensions must be at most the model's hidden size {self.hidden_size}, "
                    f"got {params.dimensions}"
                )
        return params.with_defaults(
            task=task, normalize=self.normalize, use_activation=self.use_activation
        )


def finish(
    pooled: torch.Tensor,
    params: Sequence[PoolingParams],
    classifier: Callable[[torch.Tensor], torch.Tensor] | None,
) -> list[torch.Tensor]:
    """Each request's output from its pooled vector (row ``i`` of ``pooled`` is request
    ``i``'s, its parameters resolved by :meth:`PoolingSpec.resolve`): float32 tensors on the
    CPU (what crosses the executor boundary)."""
    out: list[torch.Tensor | None] = [None] * len(params)
    classify = [i for i, p in enumerate(params) if p.task in ("classify", "score")]
    if classify:
        if classifier is None:
            raise ValueError("a classify/score request reached a model without a classifier")
        logits = classifier(pooled[classify]).float()
        for j, i in enumerate(classify):
            row = logits[j]
            if params[i].use_activation:
                row = torch.sigmoid(row) if row.numel() == 1 else torch.softmax(row, dim=-1)
            out[i] = row
    for i, p in enumerate(params):
        if out[i] is not None:
            continue
        row = pooled[i].float()
        if p.dimensions is not None:
            row = row[: p.dimensions]
        if p.normalize:
            row = F.normalize(row, p=2, dim=-1)
        out[i] = row
    return [t.detach().to("cpu", torch.float32).contiguous() for t in out]
