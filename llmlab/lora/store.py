"""``AdapterStore``: the LoRA adapters loaded in host memory, least recently used first out.

Input processing loads (and so checks) a request's adapter here before the request is
queued, so a bad adapter fails that request alone at the edge. The model runner takes an
adapter from here when it puts it into a device slot; one dropped from host memory since
(more than ``max_cpu_loras`` adapters in use) is read from its directory again. Both may run
in different threads (the async engine prepares requests off its loop), so the store is
locked; reading files happens outside the lock.
"""

from __future__ import annotations

import collections
import threading

import attrs
import torch

from llmlab.lora.adapter import LoRAAdapter, load_adapter
from llmlab.lora.request import LoRARequest
from llmlab.lora.targets import LoRATargets


@attrs.define
class AdapterStore:
    """Loaded adapters by ``lora_int_id``, at most ``capacity`` (``max_cpu_loras``).

    Attributes:
        targets: the served model's LoRA targets (what adapters are checked against).
        max_lora_rank: the largest rank accepted.
        dtype: the model's dtype (adapters are converted once, when loaded).
        base_model_names: names a ``LoRARequest.base_model_name`` may give (the model's
            path and name; the server adds its served names).
        base_norms: per target path, each slice's base weight norm, which bounds an
            adapter's update there (:mod:`llmlab.lora.bounds`; None: no bound).
        loads: adapters read from disk so far (for tests and views).
    """

    targets: LoRATargets
    max_lora_rank: int
    capacity: int
    dtype: torch.dtype
    base_model_names: set[str] = attrs.field(factory=set)
    base_norms: dict[str, tuple[float, ...]] | None = None
    loads: int = 0
    _adapters: collections.OrderedDict[int, LoRAAdapter] = attrs.field(
        init=False, factory=collections.OrderedDict
    )
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter ``request`` names, loaded (and checked) if it is not in memory.

        An id already loaded from another path is refused: ``lora_int_id`` names one
        adapter. Raises ``ValueError`` naming the field when the adapter cannot run."""
        if not isinstance(request, LoRARequest):
            raise TypeError(
                f"lora_request must be a LoRARequest, got {type(request).__name__}"
            )
        names = self.base_model_names
        if request.base_model_name is not None and names and request.base_model_name not in names:
            raise ValueError(
                f"base_model_name={request.base_model_name!r} of LoRA adapter "
                f"{request.lora_name!r} is not the served model (one of {sorted(names)})"
            )
        with self._lock:
            adapter = self._adapters.get(request.lora_int_id)
            if adapter is not None:
                self._check_same(adapter.request, request)
                self._adapters.move_to_end(request.lora_int_id)
                return adapter
        adapter = load_adapter(
            request, self.targets, max_lora_rank=self.max_lora_rank, dtype=self.dtype,
            base_model_names=frozenset(self.base_model_names), base_norms=self.base_norms,
        )
        with self._lock:
            self.loads += 1
            other = self._adapters.get(request.lora_int_id)
            if other is not None:  # loaded by another thread meanwhile
                self._check_same(other.request, request)
                return other
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
            return adapter

    @staticmethod
    def _check_same(held: LoRARequest, request: LoRARequest) -> None:
        if held.lora_path != request.lora_path:
            raise ValueError(
                f"lora_int_id={request.lora_int_id} is already adapter {held.lora_name!r} "
                f"from {held.lora_path!r}; a different adapter ({request.lora_path!r}) "
                "needs a different lora_int_id"
            )

    def remove(self, lora_int_id: int) -> bool:
        """Drop an adapter from host memory (a server's unload); True if it was there."""
        with self._lock:
            return self._adapters.pop(lora_int_id, None) is not None

    def loaded_ids(self) -> list[int]:
        """Ids in host memory, least recently used first."""
        with self._lock:
            return list(self._adapters)

    def __contains__(self, lora_int_id: int) -> bool:
        with self._lock:
            return lora_int_id in self._adapters
