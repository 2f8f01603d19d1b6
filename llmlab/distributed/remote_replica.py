"""``RemoteReplica``: a replica in another process, as a router sees it.

The data-parallel front end (:mod:`llmlab.distributed.data_parallel`) keeps one per
replica and feeds it every ``StepEvent`` the replica reports. It answers a
:class:`~llmlab.routing.policy.ReplicaView`'s questions without asking the replica:
outstanding tokens with :class:`~llmlab.routing.replica.EngineReplica`'s bookkeeping,
queue lengths from the latest event plus what was sent since, and the prefix probe from a
shadow of the replica's prefix index (``{block id: chained hash}``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llmlab.cache.prefix_index import ROOT_HASH, chain_hash
from llmlab.distributed.liveness import Liveness
from llmlab.distributed.replica_handle import ReplicaHandle
from llmlab.distributed.replica_process import ReplicaInfo
from llmlab.observe.events import StepEvent
from llmlab.routing.replica import EngineReplica


class PromptHashes:
    """The chained block hashes of the prompt being routed, shared by every replica's
    probe (asked in turn about the same prompt) and grown only as far as one matches."""

    def __init__(self) -> None:
        # The prompt itself is held, not its id(): a new prompt may reuse a freed id.
        self._prompt: Sequence[int] | None = None
        self._block_size = 0
        self.hashes: list[int] = []

    def of(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        if token_ids is not self._prompt or block_size != self._block_size:
            self._prompt, self._block_size, self.hashes = token_ids, block_size, []
        return self.hashes


class RemoteReplica(EngineReplica):
    """A replica in another process, as a router sees it (a
    :class:`~llmlab.routing.policy.ReplicaView`), followed from its reported events.

    ``index`` is the replica's position in the list the router is shown (only live
    replicas are shown); ``replica_index`` is its own index. Outstanding tokens are
    :class:`EngineReplica`'s bookkeeping (inherited); queue lengths are those of its
    latest event plus requests sent but not yet reported; the prefix probe reads a shadow
    of its prefix index: the chained hash of each block it reported cached, dropped when
    reported evicted (same hashing as :mod:`llmlab.cache.prefix_index`; a collision only
    misplaces a request).

    ``liveness`` is what the front end has heard from it (None: never judged), and
    ``unresponsive`` the verdict while it does not answer (``"silent"``, ``"wedged"``):
    an unresponsive replica is live (it may answer again) but not shown to routers.
    """

    def __init__(self, index: int, handle: ReplicaHandle, info: ReplicaInfo,
                 prompt_hashes: PromptHashes, liveness: Liveness | None = None) -> None:
        # No engine in this process: EngineReplica's state, set up without subscribing.
        self.index = self.replica_index = index
        self.engine = None
        self.handle = handle
        self.info = info
        self.outstanding_tokens = 0
        self._owed: dict[str, int] = {}
        self._computed: dict[str, int] = {}
        self._prompt_hashes = prompt_hashes
        self._last_waiting = 0
        self._last_running = 0
        self.unreported: set[str] = set()  # sent; no event has shown them arriving yet
        self.requests: set[str] = set()  # caller ids in flight here
        self.commands_sent = 0
        self.commands_done = 0
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}
        self.dead_reason: str | None = None
        self.liveness = liveness
        self.unresponsive: str | None = None

    @property
    def num_waiting(self) -> int:
        return self._last_waiting + len(self.unreported)

    @property
    def num_running(self) -> int:
        return self._last_running

    @property
    def is_live(self) -> bool:
        return self.dead_reason is None and self.handle.is_alive()

    @property
    def is_responsive(self) -> bool:
        """Live and answering: a replica a request may be sent to."""
        return self.unresponsive is None and self.is_live

    def follow(self, event: StepEvent, cached: Iterable[tuple[int, int]]) -> None:
        """Apply one reported event (and the hashes of its cached blocks)."""
        self.observe(event)
        self._last_waiting, self._last_running = event.num_waiting, event.num_running
        for arrival in event.arrived:
            self.unreported.discard(arrival.request_id)
        for block_id in event.blocks_evicted:
            block_hash = self._hash_of_block.pop(block_id, None)
            if block_hash is not None and self._block_of_hash.get(block_hash) == block_id:
                del self._block_of_hash[block_hash]
        for block_id, block_hash in cached:
            if block_hash is None:
                continue
            old = self._hash_of_block.pop(block_id, None)
            if old is not None and self._block_of_hash.get(old) == block_id:
                del self._block_of_hash[old]
            self._hash_of_block[block_id] = block_hash
            self._block_of_hash[block_hash] = block_id

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended without an event saying so (failed, or the replica died)."""
        for request_id in request_ids:
            left = self._owed.pop(request_id, None)
            if left is not None:
                self._computed.pop(request_id, None)
                self.outstanding_tokens -= left
            self.unreported.discard(request_id)

    def died(self, reason: str) -> None:
        self.dead_reason = reason
        self.forget(list(self._owed))
        self.unreported.clear()
        self.outstanding_tokens = 0
        self._last_waiting = self._last_running = 0
        self._hash_of_block.clear()
        self._block_of_hash.clear()

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` whose full blocks the replica reported cached
        (the last token never counts: it is always computed)."""
        if not self.info.enable_prefix_caching or not self._block_of_hash:
            return 0
        bs = self.info.block_size
        num_blocks = (len(token_ids) - 1) // bs
        hashes = self._prompt_hashes.of(token_ids, bs)
        for i in range(num_blocks):
            if i == len(hashes):
                parent = hashes[-1] if hashes else ROOT_HASH
                hashes.append(chain_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if hashes[i] not in self._block_of_hash:
                return i * bs
        return num_blocks * bs
