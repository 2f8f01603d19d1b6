"""``EngineReplica``: a running :class:`~llmlab.engine.engine.Engine` as a router sees it.

The view answers a :class:`~llmlab.routing.policy.ReplicaView`'s questions from what the
engine tells everyone: its queue lengths, its ``StepEvent``s (subscribed as an observer)
and a read-only probe of its prefix index. It works the same for a simulated engine
(virtual clock) and a real one, which is what lets the simulator's routers run in front
of real replicas unchanged.

Outstanding tokens are the work still owed to the requests routed here: each starts at
its prompt plus ``max_tokens`` (less what a prefix-cache hit saves at admission), every
scheduled token pays some off, a preemption puts back what was computed (it will be
computed again), and finishing or aborting clears the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmlab.cache.prefix_index import ROOT_HASH, chain_hash
from llmlab.observe.events import StepEvent


class EngineReplica:
    """One replica of a cluster: ``index`` among the replicas, and its ``engine``.

    Call :meth:`routed` when a request is sent to it; subscribe the view to the engine
    (done here) so it follows every step.
    """

    def __init__(self, index: int, engine: Any) -> None:
        self.index = index
        self.engine = engine
        self.outstanding_tokens = 0
        self._owed: dict[str, int] = {}  # per request: tokens still owed
        self._computed: dict[str, int] = {}  # per request: tokens in its KV now
        engine.subscribe(self.observe)

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def routed(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
        """A request was sent here."""
        owed = num_prompt_tokens + max_tokens
        self._owed[request_id] = owed
        self._computed[request_id] = 0
        self.outstanding_tokens += owed

    def observe(self, event: StepEvent) -> None:
        """Follow one step of the engine (an engine observer)."""
        owed, computed = self._owed, self._computed
        paid = 0
        for request_id in event.preempted:
            if request_id in owed:
                back = computed[request_id]
                owed[request_id] += back
                paid -= back
                computed[request_id] = 0
        for admission in event.admitted:
            rid = admission.request_id
            if rid in owed and admission.num_cached_tokens:
                hit = min(admission.num_cached_tokens, owed[rid])
                owed[rid] -= hit
                computed[rid] += admission.num_cached_tokens
                paid += hit
        for request_id, num_new in event.scheduled:
            if request_id in owed:
                step = min(num_new, owed[request_id])
                owed[request_id] -= step
                computed[request_id] += num_new
                paid += step
        for request_id, _ in event.finished:
            left = owed.pop(request_id, None)
            if left is not None:
                computed.pop(request_id)
                paid += left
        for request_id in event.aborted:
            left = owed.pop(request_id, None)
            if left is not None:
                computed.pop(request_id)
                paid += left
        self.outstanding_tokens -= paid

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` whose full blocks this replica's prefix cache
        holds now (read-only: no eviction policy hears of it)."""
        kv = self.engine.kv_cache
        if not kv.enable_prefix_caching:
            return 0
        bs = kv.block_size
        index = kv.index
        num_blocks = (len(token_ids) - 1) // bs  # the last token is always computed
        hashes = _block_hashes(token_ids, bs)
        for i in range(num_blocks):
            if i == len(hashes):
                parent = hashes[-1] if hashes else ROOT_HASH
                hashes.append(chain_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs])))
            if index.get(hashes[i], tuple(token_ids[i * bs : (i + 1) * bs])) is None:
                return i * bs
        return num_blocks * bs

    def __repr__(self) -> str:
        return (
            f"EngineReplica(index={self.index}, waiting={self.num_waiting}, "
            f"running={self.num_running}, outstanding_tokens={self.outstanding_tokens})"
        )


# The block hashes of the prompt being routed, shared by every replica's probe (they are
# asked in turn about the same prompt) and grown only as far as some replica matches.
_memo: list = [None, 0, []]


def _block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    if _memo[0] is not token_ids or _memo[1] != block_size:
        _memo[:] = [token_ids, block_size, []]
    return _memo[2]
