"""How large an adapter may be: the bounds :func:`~llmlab.lora.adapter.load_adapter` checks,
so that absurd adapters are refused at the edge instead of computing garbage in a step.

Finite weights are not enough: ``lora_alpha`` 1e308, or A entries of 1e38 with ordinary B,
are finite on disk and overflow once multiplied. Two bounds stop them, both with a wide
margin over any trained adapter:

* the scale ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) is at most
  :data:`MAX_LORA_SCALE` in size. Trained adapters use about 0.25 to 4 (``lora_alpha``
  from ``r / 4`` to ``4 r``; Hu et al., 2021; Dettmers et al., 2023; Kalajdzievski,
  2023); ten thousand is a broken config, not a training choice;
* each PEFT module's update ``scale * B A`` has a Frobenius norm at most
  :data:`MAX_UPDATE_RATIO` times that of the base weight it adds to. LoRA learns a small
  correction: Hu et al. (2021, section 7.3) measure ``||dW_q||_F`` at 0.06 to 0.11 of
  ``||W_q||_F`` on GPT-3, and random test adapters sit below 1; a hundred times the base
  weight is no fine-tune of it.

The base norms are measured once, when the model gets its slots, through each module's
``forward`` (:func:`base_norms`), so plain, oneDNN-packed and quantized linears are all
measured the same way. The update's norm is computed exactly from ``r x r`` Gram matrices
in float64, with each factor divided by its largest entry first, so the check itself cannot
overflow (:func:`update_norm`). The loader also refuses factors that overflow the model's
dtype once the scale is folded into B.

Not covered: finite factors of harmless product but wildly unbalanced size (A of 1e30,
B of 1e-30) can still overflow in ``x A^T``. That reaches the adapter's own rows only: the
batched ops select each row's own slot, never mask the others (:mod:`llmlab.lora.ops`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmlab.lora.targets import LoRATarget

MAX_LORA_SCALE = 1e4
MAX_UPDATE_RATIO = 100.0
# Gaussian probes per module for its base norm (below), drawn from a seed of their own:
# not 0, which initialises many test models, whose weight rows would then be the probes.
NUM_PROBES = 64
PROBE_SEED = 2718281828


@torch.no_grad()
def base_norms(
    module: nn.Module, target: LoRATarget, dtype: torch.dtype, device: torch.device
) -> tuple[float, ...]:
    """The Frobenius norm of each output slice of ``module``'s weight (as ``target.slices``),
    from its ``forward`` alone: Hutchinson's estimator ``||W||_F^2 = E ||W g||^2`` over
    :data:`NUM_PROBES` standard Gaussian ``g`` (a fixed seed, so the same every run), with
    the bias taken off by a zero input. With 64 probes the estimate is within a few
    percent on a full-rank weight, and below a tenth of the truth with negligible
    probability even on a rank-1 one: ample for a bound of a hundred times."""
    gen = torch.Generator().manual_seed(PROBE_SEED)
    probes = torch.randn(NUM_PROBES, target.in_features, generator=gen)
    x = torch.cat([torch.zeros(1, target.in_features), probes]).to(device, dtype)
    y = module(x).double()
    wg = y[1:] - y[:1]
    return tuple(
        math.sqrt(float(wg[:, first : first + size].square().sum()) / NUM_PROBES)
        for _, first, size in target.slices
    )


def update_norm(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """``||scale * B A||_F`` for ``A`` ``[r, in]`` and ``B`` ``[out, r]`` (finite), exact up
    to float64 rounding: ``||B A||_F^2 = sum((B^T B) * (A A^T))`` needs only ``r x r``
    matrices. Each factor is divided by its largest entry first, so no square overflows;
    the result is ``inf`` only when the true norm is beyond float64."""
    a64, b64 = a.double(), b.double()
    a_max, b_max = float(a64.abs().max()), float(b64.abs().max())
    if a_max == 0.0 or b_max == 0.0:
        return 0.0
    a64, b64 = a64 / a_max, b64 / b_max
    squared = float(((b64.t() @ b64) * (a64 @ a64.t())).sum())
    # Python floats overflow to inf (never an exception) in these products.
    return abs(scale) * a_max * b_max * math.sqrt(max(squared, 0.0))
