"""KV transfers: block copies between the device pool and the host pools, as plain data.

The KV cache manager records one :class:`KVTransfer` per move as it decides it (a
preempted request swapped out, a swapped request swapped back in, an evicted prefix
block spilled to the second tier, a second-tier hit loaded back); the scheduler hands
them to the executor in ``ScheduledBatch.kv_transfers``, which applies them in order
before the step's ``block_copies`` and its forward pass. Copy-on-write copies recorded
before a transfer travel in the same list (kind ``"copy"``), so "``kv_transfers`` in
order, then ``block_copies``" is exactly the order the cache manager recorded every
move: a transfer never reads a block a later move writes, nor the reverse.

Nothing here holds a tensor: block ids only (the executor owns the tensors).
"""

from __future__ import annotations

from typing import NamedTuple

# kind -> (source pool, destination pool); "device" is the paged KV cache the model reads,
# "swap" the host pool of swapped-out requests, "offload" the prefix cache's second tier.
TRANSFER_KINDS: dict[str, tuple[str, str]] = {
    "copy": ("device", "device"),
    "swap_out": ("device", "swap"),
    "swap_in": ("swap", "device"),
    "spill": ("device", "offload"),
    "load": ("offload", "device"),
}


class KVTransfer(NamedTuple):
    """Whole KV blocks (every layer, keys and values) copied between two pools.

    Attributes:
        kind: one of :data:`TRANSFER_KINDS`: ``"copy"`` (device to device,
            copy-on-write), ``"swap_out"`` / ``"swap_in"`` (device to / from the swap
            space), ``"spill"`` / ``"load"`` (device to / from the offload tier).
        blocks: ``(src_block, dst_block)`` pairs, ids in the source and destination pools
            of ``kind``; applied as one gather and one scatter per layer.
    """

    kind: str
    blocks: tuple[tuple[int, int], ...]

    @property
    def source(self) -> str:
        return TRANSFER_KINDS[self.kind][0]

    @property
    def destination(self) -> str:
        return TRANSFER_KINDS[self.kind][1]
