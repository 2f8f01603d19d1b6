"""Content-addressed lookup of full KV blocks (automatic prefix caching).

Block ``i`` of a sequence is named by a chained hash of its parent block's hash and its own
token ids, so equal hashes mean equal prefixes up to and including that block. Only full
blocks are indexed. Hash collisions are guarded by comparing the stored token ids on every
hit.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView, Sequence

import attrs

# The parent "hash" of a sequence's first block; any fixed value works.
ROOT_HASH = 0x6C6C6D6C6162


def chain_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Hash of one full block given its parent's hash (deterministic across processes)."""
    return hash((parent_hash, token_ids))


def root_hash(salt: int | None = None) -> int:
    """The parent hash of a sequence's first block: :data:`ROOT_HASH`, or with a ``salt``
    (a LoRA adapter's ``hash_salt``) a root of its own, so sequences under different salts
    never share a block hash (a 3-tuple, never the 2-tuple of a block's hash)."""
    return ROOT_HASH if salt is None else hash((ROOT_HASH, salt, -1))


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, salt: int | None = None
) -> None:
    """Append the hashes of any newly full blocks of ``token_ids`` to ``hashes`` in place
    (``salt``: see :func:`root_hash`)."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), num_full):
        parent = chain_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)


@attrs.define
class PrefixIndex:
    """Chained block hash -> block id, and block id -> (hash, token ids) to verify hits.

    Sized by the cached blocks only (two dict entries and one token tuple each), never by
    the pool.
    """

    _block_of_hash: dict[int, int] = attrs.field(factory=dict, repr=False)
    _entry_of_block: dict[int, tuple[int, tuple[int, ...]]] = attrs.field(factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self._block_of_hash)

    def get(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block holding exactly ``token_ids`` under ``block_hash``, or None."""
        block_id = self._block_of_hash.get(block_hash)
        if block_id is None or self._entry_of_block[block_id][1] != token_ids:
            return None
        return block_id

    def contains(self, block_hash: int) -> bool:
        return block_hash in self._block_of_hash

    def hash_of(self, block_id: int) -> int | None:
        entry = self._entry_of_block.get(block_id)
        return None if entry is None else entry[0]

    def entry(self, block_id: int) -> tuple[int, tuple[int, ...]] | None:
        """``(block_hash, token_ids)`` of an indexed block, or None."""
        return self._entry_of_block.get(block_id)

    def block_ids(self) -> KeysView[int]:
        """Ids of the indexed blocks (a live view)."""
        return self._entry_of_block.keys()

    def insert(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if block_hash in self._block_of_hash or block_id in self._entry_of_block:
            raise ValueError(
                f"block {block_id} with hash {block_hash:#x} is already indexed; remove it first"
            )
        self._block_of_hash[block_hash] = block_id
        self._entry_of_block[block_id] = (block_hash, token_ids)

    def remove(self, block_ids: Iterable[int]) -> None:
        """Forget these blocks; ids that are not indexed are ignored."""
        for block_id in block_ids:
            entry = self._entry_of_block.pop(block_id, None)
            if entry is not None:
                del self._block_of_hash[entry[0]]
