"""The built-in routers, registered by name.

====================  =======================================================================
name                  sends a request to
====================  =======================================================================
``round_robin``       the next replica in turn
``least_loaded``      the replica with the fewest outstanding tokens (equals take turns)
``prefix_aware``      the replica holding (or last sent) the longest prefix of its prompt,
                      if it covers enough of it, among replicas under a load cap; else the
                      least loaded
``session_affinity``  the replica its session (else its user) went to first; new ones to the
                      least loaded
====================  =======================================================================

Each decision is O(N) in the number of replicas; ``prefix_aware`` adds one hash and one
dict lookup per ``chunk_tokens`` tokens of the prompt. Memories (prefixes, sessions) are
LRU-bounded.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import attrs

from llmlab.registry import register
from llmlab.routing.policy import ReplicaView, RouteRequest
from llmlab.validation import as_int, as_real


def _least_loaded(loads: Sequence[int], candidates: Sequence[int], start: int) -> int:
    """The candidate with the smallest load; among equals the first at or after ``start``
    in cyclic order, so equal replicas take turns instead of the lowest index taking all."""
    n = len(loads)
    lightest = min(loads[i] for i in candidates)
    return min((i for i in candidates if loads[i] == lightest), key=lambda i: (i - start) % n)


@register("router", "round_robin")
@attrs.define(eq=False)
class RoundRobin:
    """Each replica in turn, cycling through 0 to N-1.

    Source: NGINX's default upstream balancing; the ``round_robin`` policy of SGLang's
    router. Blind to load and caches: the baseline the others are measured against. If the number
    of replicas changes, the turn continues modulo the new count.
    """

    name: str = "round_robin"
    _turn: int = attrs.field(default=0, init=False, repr=False)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        choice = self._turn % len(replicas)
        self._turn = choice + 1
        return choice


@register("router", "least_loaded")
@attrs.define(eq=False)
class LeastLoaded:
    """The replica with the fewest outstanding tokens; equal replicas take turns.

    Join the shortest queue (Winston, "Optimality of the shortest line discipline",
    Journal of Applied Probability, 1977), with the queue measured in tokens rather than
    requests, since one long prompt or generation is worth many short ones.

    Ties (an idle cluster, say) rotate: the tied replica at or after the one after the last
    choice wins, so equal replicas share the work evenly.
    """

    name: str = "least_loaded"
    _next: int = attrs.field(default=0, init=False, repr=False)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        loads = [replica.outstanding_tokens for replica in replicas]
        choice = _least_loaded(loads, range(len(loads)), self._next)
        self._next = choice + 1
        return choice


def _chunk_hashes(token_ids: Sequence[int], chunk_tokens: int) -> list[int]:
    """Chained hashes of the full ``chunk_tokens``-token chunks of ``token_ids``: entry k
    stands for the first ``(k + 1) * chunk_tokens`` tokens, as a prefix cache's block
    hashes do. A collision only misplaces a request (a worse cache hit), never corrupts."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        parent = hash((parent, tuple(token_ids[start:start + chunk_tokens])))
        hashes.append(parent)
    return hashes


@register("router", "prefix_aware")
@attrs.define(eq=False)
class PrefixAware:
    """The replica holding the longest prefix of the prompt, among those under a load cap.

    Cache-aware routing as in SGLang's router (a per-replica approximate tree of what was
    routed, with a load-balance override) and Preble (Srivatsa et al.,
    "Preble: Efficient Distributed Prompt Scheduling for LLM Serving", ICLR 2025).

    Load cap: a replica is a candidate when its ``outstanding_tokens`` is at most
    ``load_cap * lightest + (load_cap - 1) * mean + len(prompt) + max_tokens`` (lightest
    and mean over the replicas' outstanding tokens). Measured from the least loaded
    replica, so an idle replica draws work as soon as the others carry more than a share
    of the mean above it (against the mean alone, an idle replica drags the mean down
    until the busy ones never look over it, and it stays idle); the request's own size is
    slack, so on an idle cluster a replica holding one queued request that shares the
    prompt's prefix still gets the next. The least loaded replica is always a candidate.

    Score of a candidate: the longer of ``cached_prefix_tokens(prompt)`` (what its cache
    holds now) and the prefix the router itself last sent there. The router's memory maps
    chained hashes of the prompt's ``chunk_tokens``-token chunks to the replica they were
    last sent to (LRU, at most ``max_prefixes`` entries), so requests that share a prefix
    and arrive before the first one's KV is cached still go together. A score below
    ``min_prefix_tokens``, or below ``match_ratio`` of the prompt, counts as 0 (as SGLang's
    cache threshold does): a short prefix that most prompts share (a brief system prompt)
    then does not pull every new conversation to the replicas that served one. The highest score wins; equal scores (all zero included) go to the least loaded
    of them, equals taking turns.
    """

    name: str = "prefix_aware"
    load_cap: float = attrs.field(
        default=1.5, converter=functools.partial(as_real, "load_cap", min=1.0))
    chunk_tokens: int = attrs.field(
        default=16, converter=functools.partial(as_int, "chunk_tokens", min=1))
    min_prefix_tokens: int = attrs.field(
        default=1, converter=functools.partial(as_int, "min_prefix_tokens", min=0))
    max_prefixes: int = attrs.field(
        default=100_000, converter=functools.partial(as_int, "max_prefixes", min=1))
    match_ratio: float = attrs.field(
        default=0.5, converter=functools.partial(as_real, "match_ratio", min=0.0, max=1.0))
    # chained chunk hash -> the replica that prefix was last sent to, oldest first
    _sent: OrderedDict[int, int] = attrs.field(factory=OrderedDict, init=False, repr=False)
    _next: int = attrs.field(default=0, init=False, repr=False)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        prompt = request.prompt_token_ids
        loads = [replica.outstanding_tokens for replica in replicas]
        lightest, mean = min(loads), sum(loads) / len(loads)
        cap = (self.load_cap * lightest + (self.load_cap - 1) * mean + len(prompt)
               + (request.max_tokens or 0))
        candidates = [i for i, load in enumerate(loads) if load <= cap] or range(len(loads))
        hashes = _chunk_hashes(prompt, self.chunk_tokens)
        remembered = self._remembered(hashes, len(replicas))
        scores = {
            i: max(replicas[i].cached_prefix_tokens(prompt), remembered.get(i, 0))
            for i in candidates
        }
        best = max(scores.values())
        if best >= max(self.min_prefix_tokens, 1, self.match_ratio * len(prompt)):
            candidates = [i for i in candidates if scores[i] == best]
        choice = _least_loaded(loads, candidates, self._next)
        self._next = choice + 1
        self._remember(hashes, choice)
        return choice

    def _remembered(self, hashes: list[int], num_replicas: int) -> dict[int, int]:
        """Replica -> prefix tokens this router last sent it, for the prompt's chunks."""
        matched: dict[int, int] = {}
        for k, chunk_hash in enumerate(hashes, 1):
            replica = self._sent.get(chunk_hash)
            if replica is None:
                break  # chained: a longer prefix was recorded with this one
            if replica < num_replicas:
                matched[replica] = k * self.chunk_tokens  # sent the whole prefix up to k
        return matched

    def _remember(self, hashes: list[int], replica: int) -> None:
        # The head of the chain goes in last, so it is forgotten last: a lookup needs a
        # prefix's first chunks to find its later ones.
        sent = self._sent
        for chunk_hash in reversed(hashes):
            sent[chunk_hash] = replica
            sent.move_to_end(chunk_hash)
        while len(sent) > self.max_prefixes:
            sent.popitem(last=False)


@register("router", "session_affinity")
@attrs.define(eq=False)
class SessionAffinity:
    """Each session (else user) sticks to the replica its first request went to.

    Sticky sessions, as in vLLM production-stack's session router, so a conversation's
    growing prefix stays in one cache.

    A new session, and a request with neither a session nor a user, goes to the least
    loaded replica (equals taking turns). Stickiness ignores load. The router remembers
    at most ``max_sessions`` sessions and users, least recently seen forgotten first; a
    forgotten one, or one whose replica no longer exists, is placed afresh.
    """

    name: str = "session_affinity"
    max_sessions: int = attrs.field(
        default=100_000, converter=functools.partial(as_int, "max_sessions", min=1))
    # ("session", id) or ("user", id) -> replica, least recently seen first
    _replica_of: OrderedDict[Hashable, int] = attrs.field(
        factory=OrderedDict, init=False, repr=False)
    _next: int = attrs.field(default=0, init=False, repr=False)

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        if request.session is not None:
            key: Hashable = ("session", request.session)
        elif request.user is not None:
            key = ("user", request.user)
        else:
            key = None
        known = self._replica_of.get(key) if key is not None else None
        if known is not None and known < len(replicas):
            self._replica_of.move_to_end(key)
            return known
        loads = [replica.outstanding_tokens for replica in replicas]
        choice = _least_loaded(loads, range(len(loads)), self._next)
        self._next = choice + 1
        if key is not None:
            self._replica_of[key] = choice
            self._replica_of.move_to_end(key)
            if len(self._replica_of) > self.max_sessions:
                self._replica_of.popitem(last=False)
        return choice
