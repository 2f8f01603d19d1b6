"""Stand-in models that make the engine's host work visible on a CPU.

Both keep the runner's model contract (``model(input_ids, positions, context)`` returns one
hidden row per token, ``model.compute_logits(hidden)`` the logits at the rows given) and
compute next to nothing, so a step's wall time is the engine's own Python:

* :class:`NullModel`: logits at no cost (a view into a fixed random table at an offset
  that moves every call, so greedy tokens vary and detokenization sees real text). The
  host work per step is the step's wall time minus :attr:`NullModel.seconds`.
* :class:`FixedTimeModel`: the same logits after a forward that *sleeps* a set time. A
  sleep releases the GIL, as a GPU kernel leaves the host free while it runs, so a loop
  that plans the next step during the forward shows its overlap on a CPU: a synchronous
  step takes the sleep plus the host work, an overlapped one ``max`` of the two.

Neither touches the KV cache: what they return depends only on positions, which the
engine computes exactly as for a real model. :func:`swap_model` puts one into a built
engine's runner (``benchmarks/host_overhead.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

# Rows of the random logits table the views start in (it holds this many more: a batch).
_TABLE_ROWS = 1024


class NullModel(torch.nn.Module):
    """Logits at no cost (see the module). ``seconds``: time spent inside the model's
    two calls, to subtract from a step's wall time."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(2 * _TABLE_ROWS, vocab_size, generator=generator)
        self.seconds = 0.0
        self._calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: Any
                ) -> torch.Tensor:
        start = time.perf_counter()
        hidden = self._forward(input_ids, positions)
        self.seconds += time.perf_counter() - start
        return hidden

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return positions.unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        n = hidden.shape[0]
        if n > _TABLE_ROWS:
            raise ValueError(f"NullModel serves at most {_TABLE_ROWS} rows a call, got {n}")
        self._calls += 1
        offset = (self._calls * 97) % _TABLE_ROWS
        logits = self.table[offset : offset + n]
        if logits.device != hidden.device:
            logits = logits.to(hidden.device)
        self.seconds += time.perf_counter() - start
        return logits


class FixedTimeModel(NullModel):
    """A :class:`NullModel` whose forward takes ``forward_s`` seconds, sleeping (the GIL
    released, as while a GPU kernel runs). ``seconds`` counts the sleep too."""

    def __init__(self, vocab_size: int, forward_s: float, seed: int = 0) -> None:
        super().__init__(vocab_size, seed)
        self.forward_s = forward_s

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s)
        return positions.unsqueeze(1)


def swap_model(engine: Any, model: NullModel) -> torch.nn.Module:
    """Put ``model`` into ``engine``'s runner in place of its model; returns the model it
    replaced. The engine must run on one device without CUDA graphs (they captured the
    real model's kernels)."""
    runner = engine.executor
    if getattr(runner, "decode_graphs", None) is not None:
        raise ValueError("swap_model needs an eager engine (enforce_eager=True)")
    original = runner.model
    runner.model = model
    return original
