"""How many bytes a loaded model's weights take, and how many bits its quantized layers
spend per weight (logged when a quantized model loads; :func:`weight_memory` for anyone).

Counted: every parameter and buffer of the model, each storage once (a tied head, or a
kernel handle's view of a layer's own buffer, is not counted twice), plus the tensors a
4-bit layer's kernel handle holds beside its buffers (its repacked copy, if it makes one).
A quantized layer's bits per weight include its scales, zero points and act-order
permutation: an int8 layer ``8 + 32 / in`` bits, a 4-bit one ``4 + 40 / group_size``
(float32 scales, uint8 zero points): 4.31 at group 128.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch
from torch import nn

from llmlab.quantization.base import QuantizedLinear
from llmlab.quantization.w4a16 import W4A16Linear


@attrs.frozen
class WeightMemory:
    """A model's weight bytes.

    Attributes:
        total_bytes: every parameter and buffer (each storage once).
        quantized_bytes: the part held by quantized linears (values, scales, zero points,
            permutations, kernel handles).
        quantized_weights: how many weights those linears hold (``out * in`` each).
        schemes: the quantized linears' kinds (``"int8"``, ``"w4a16"``, ...), sorted.
    """

    total_bytes: int
    quantized_bytes: int
    quantized_weights: int
    schemes: tuple[str, ...]

    @property
    def bits_per_quantized_weight(self) -> float:
        """Bits the quantized linears spend per weight, overheads included (0: none)."""
        if not self.quantized_weights:
            return 0.0
        return 8 * self.quantized_bytes / self.quantized_weights

    def describe(self) -> str:
        line = f"weights: {self.total_bytes / 2**20:.2f} MiB"
        if self.quantized_weights:
            line += (
                f", of which {'/'.join(self.schemes)} linears {self.quantized_bytes / 2**20:.2f}"
                f" MiB ({self.bits_per_quantized_weight:.2f} bits per weight, scales and zero "
                "points included)"
            )
        return line


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """Tensors inside a kernel handle: a tensor, or any nesting of tuples, lists, dicts and
    objects with attributes (an attrs class, a namedtuple) around them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif hasattr(value, "__dict__") or hasattr(value, "__slots__"):
        names = getattr(value, "__slots__", ()) or vars(value)
        for name in names:
            yield from _tensors(getattr(value, name, None))


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    if isinstance(module, W4A16Linear):
        tensors.extend(_tensors(module._handle))
    return tensors


def weight_memory(model: nn.Module) -> WeightMemory:
    """Count ``model``'s weight bytes (see the module docstring)."""
    seen: set[tuple[torch.device, int]] = set()

    def new_bytes(tensors: list[torch.Tensor]) -> int:
        count = 0
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (tensor.device, storage.data_ptr())
            if key not in seen and tensor.device.type != "meta":
                seen.add(key)
                count += storage.nbytes()
        return count

    total = quantized = weights = 0
    schemes: set[str] = set()
    for module in model.modules():
        tensors = _module_tensors(module)
        if isinstance(module, (QuantizedLinear, W4A16Linear)):
            # The bias stays in the model dtype: not part of the quantized weight's cost.
            size = new_bytes([t for t in tensors if t is not module.bias])
            quantized += size
            total += size
            weights += module.in_features * module.out_features
            schemes.add(module.scheme if isinstance(module, QuantizedLinear) else "w4a16")
        total += new_bytes(tensors)  # what is left: everything, or a quantized one's bias
    return WeightMemory(total, quantized, weights, tuple(sorted(schemes)))
