"""Multi-LoRA serving: many PEFT adapters over one base model, in one batch (docs/lora.md).

``request.py`` (``LoRARequest``, plain data in the step contract), ``targets.py`` (where
PEFT modules land in the fused projections), ``adapter.py`` (loading and checking a PEFT
adapter), ``bounds.py`` (how large its scale and updates may be), ``store.py`` (host-memory
LRU), ``layer.py`` (``LoRALinear``: stacked slots
around any linear), ``ops.py`` and ``triton_ops.py`` (the batched computation),
``slots.py`` (the runner's device slots and per-row adapters), ``attach.py`` (the
builder's call). Only the request is imported here, so importing it stays cheap.
"""

from llmlab.lora.request import LoRARequest

__all__ = ["LoRARequest"]
