"""``LoRALinear``: a linear module of the model with stacked adapter slots beside it.

It wraps whatever module is there (``nn.Linear``, a oneDNN ``PackedLinear``, a quantized
linear), relying only on ``in_features``, ``out_features`` and ``forward(x)``:

    y = base(x) + (x A[slot]^T) B[slot]^T      for each token with an adapter slot

``lora_a`` is ``[max_loras, n * R, in]`` and ``lora_b`` ``[max_loras, R, out]`` (B
transposed, so ``x A^T B`` needs no transpose and the slots stack into one matrix) for a
module hosting ``n`` PEFT modules (3 for ``qkv_proj``: q, k, v; 2 for ``gate_up_proj``),
``R = max_lora_rank``: slice ``j``'s A rows sit at ``[j R, j R + r)``, its B rows at
``[0, r)`` of its own output columns, so the fused module runs one shrink for all its
slices and one expand per slice, with no block-diagonal zeros. Unused ranks are zero
padding.

Which slot each token uses is the step's :class:`LoRAStep`, set on the shared
:class:`LoRAContext` by the model runner before the forward pass; with no adapter in the
step the context holds None and the module costs one attribute read over ``base``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

from llmlab.lora.ops import lora_update
from llmlab.lora.targets import LoRATarget


@attrs.frozen(eq=False)
class LoRAStep:
    """One step's tokens by adapter slot (built once, read by every module).

    Attributes:
        kernel: ``"torch"`` (:func:`~llmlab.lora.ops.lora_update`) or ``"triton"``.
        runs: torch path: ``(start, end, slot)`` rows run in place as one matmul pair.
        gather_index: torch path: the short spans' rows with an adapter, sorted by slot
            (None: nothing to gather).
        gathered_runs: torch path: ``(start, end, slot)`` over the gathered rows.
        perm, seg_starts, seg_slots, max_segment_len, num_lora_tokens: Triton path: the
            tokens with an adapter grouped by slot (device tensors) and the segments.
    """

    kernel: str = "torch"
    runs: tuple[tuple[int, int, int], ...] = ()
    gather_index: torch.Tensor | None = None
    gathered_runs: tuple[tuple[int, int, int], ...] = ()
    perm: torch.Tensor | None = None
    seg_starts: torch.Tensor | None = None
    seg_slots: torch.Tensor | None = None
    max_segment_len: int = 0
    num_lora_tokens: int = 0


class LoRAContext:
    """What every wrapped module of one model reads each step (one per engine)."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """``base`` plus per-token adapter updates (see the module)."""

    def __init__(
        self, base: nn.Module, target: LoRATarget, context: LoRAContext, max_loras: int,
        max_rank: int, dtype: torch.dtype, device: torch.device,
    ) -> None:
        super().__init__()
        in_features, out_features = int(base.in_features), int(base.out_features)
        if (in_features, out_features) != (target.in_features, target.out_features):
            raise ValueError(
                f"{target.path}: the module is {in_features} -> {out_features}, but LoRA "
                f"expects {target.in_features} -> {target.out_features}"
            )
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        self.target = target
        self.context = context
        self.max_rank = max_rank
        width = len(target.slices) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, width, in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, max_rank, out_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.slices = tuple((first, size) for _, first, size in target.slices)
        # Whether slot s holds an adapter that targets this module (the torch path skips
        # the others' long spans).
        self.targeted = [False] * max_loras

    def set_slot(
        self, slot: int, slices: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None
    ) -> None:
        """Write an adapter's weights for this module into ``slot`` (None: it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.targeted[slot] = False
        if slices is None:
            return
        rank = self.max_rank
        for j, pair in enumerate(slices):
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            _, first, size = self.target.slices[j]
            self.lora_a[slot, j * rank : j * rank + r].copy_(a, non_blocking=True)
            self.lora_b[slot, :r, first : first + size].copy_(b.t(), non_blocking=True)
            self.targeted[slot] = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.context.step
        if step is None:
            return y
        shape = y.shape
        x2, y2 = x.reshape(-1, self.in_features), y.reshape(-1, self.out_features)
        if step.kernel == "triton":
            from llmlab.lora.triton_ops import sgmv_lora

            sgmv_lora(
                x2, y2, self.lora_a, self.lora_b, self.slices, step.perm, step.seg_starts,
                step.seg_slots, step.max_segment_len, step.num_lora_tokens,
            )
        else:
            # Runs of adapters that leave this module alone are skipped.
            targeted = self.targeted
            lora_update(
                x2, y2, self.lora_a, self.lora_b, self.slices,
                [run for run in step.runs if targeted[run[2]]], step.gather_index,
                [run for run in step.gathered_runs if targeted[run[2]]],
            )
        return y2.view(shape)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"slots={self.lora_a.shape[0]}, max_rank={self.max_rank}, "
            f"hosts={[name for name, _, _ in self.target.slices]}"
        )


def wrap_linears(
    model: nn.Module, targets: Sequence[LoRATarget], max_loras: int, max_rank: int,
    dtype: torch.dtype, device: torch.device,
) -> tuple[LoRAContext, dict[str, LoRALinear]]:
    """Replace each target module of ``model`` by a :class:`LoRALinear` around it."""
    context = LoRAContext()
    wrapped = {}
    for target in targets:
        parent_name, _, child = target.path.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, child)
        if isinstance(base, LoRALinear):
            raise ValueError(f"{target.path} already carries LoRA slots")
        module = LoRALinear(base, target, context, max_loras, max_rank, dtype, device)
        setattr(parent, child, module)
        wrapped[target.path] = module
    return context, wrapped
