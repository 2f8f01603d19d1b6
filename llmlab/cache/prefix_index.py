"""Content-addressed lookup of full KV blocks (automatic prefix caching).

Block ``i`` of a sequence is named by a chained hash of its parent block's hash and its own
token ids, so equal hashes mean equal prefixes up to and including that block. Only full
blocks are indexed. Hash collisions are guarded by comparing the stored token ids on every
hit.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from llmlab.cache.block_pool import Block

# The parent "hash" of a sequence's first block; any fixed value works.
ROOT_HASH = 0x6C6C6D6C6162


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given its parent's hash (deterministic across processes)."""
    return hash((parent_hash, token_ids))


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int) -> None:
    """Append the hashes of any newly full blocks of ``token_ids`` to ``hashes`` in place."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), num_full):
        parent = chain_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)


@attrs.define
class PrefixIndex:
    """Map from chained block hash to the block holding that content."""

    _by_hash: dict[int, Block] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        block = self._by_hash.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def insert(self, block: Block, block_hash: int, token_ids: tuple[int, ...]) -> None:
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._by_hash[block_hash] = block

    def remove(self, block: Block) -> None:
        if block.block_hash is not None and self._by_hash.get(block.block_hash) is block:
            del self._by_hash[block.block_hash]
