"""The dtype names llmlab accepts (``dtype="bf16"``, ``"torch.float16"``, ...): a leaf, so the
config can check a name without importing the model loader.

The loader (:func:`llmlab.models.loader.resolve_dtype`) adds what ``"auto"`` means for a
checkpoint; this module only maps names to torch dtypes.
"""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    # Not a serving dtype, but exact enough that numerical ties never flip a greedy token:
    # tests comparing schedules (preemption vs none) use it.
    "float64": torch.float64,
    "double": torch.float64,
}
# What ``"auto"`` keeps from a checkpoint's config; anything else there reads as float32.
AUTO_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_from_name(dtype: str | torch.dtype) -> torch.dtype | None:
    """The torch dtype ``dtype`` names (a ``torch.dtype`` is checked and returned as is), or
    None for ``"auto"``, which the loader resolves against the checkpoint. Raises
    ``ValueError`` for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPE_NAMES.values():
            raise ValueError(
                f"dtype {dtype} is not supported; use float32, float16, bfloat16 or float64"
            )
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a str or torch.dtype, got {dtype!r}")  # noqa: TRY004
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        return None
    resolved = DTYPE_NAMES.get(name)
    if resolved is None:
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto' or one of {', '.join(DTYPE_NAMES)}")
    return resolved
