"""The router contract: what a routing policy sees of a request and of each replica.

A router picks, for each new request, which of N engine replicas serves it. It sees two
small read-only views and nothing else, so the same router runs in the cluster simulator
and in front of real data-parallel engines:

* :class:`RouteRequest`: the request's id, prompt token ids, ``max_tokens``, user and
  session.
* :class:`ReplicaView`: one replica's queue lengths, the tokens it still has to compute,
  and a side-effect-free question to its prefix cache.

Only :meth:`RoutingPolicy.route` is required. Callers pass every answer through
:func:`check_choice`, so a router that returns something other than an index into the
replicas fails the same way everywhere, naming the router.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from llmlab.errors import component_name
from llmlab.validation import as_int


class RouteRequest(Protocol):
    """What a router sees of a request (read-only).

    Attributes:
        request_id: the request's id, unique among requests in flight.
        prompt_token_ids: its prompt, oldest token first.
        max_tokens: the most tokens it may generate.
        user: who sent it, or None.
        session: its conversation or session id, or None when unknown.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    user: str | None
    session: str | None


class ReplicaView(Protocol):
    """What a router sees of one replica (read-only; every attribute is cheap to read).

    Attributes:
        index: the replica's position in the ``replicas`` sequence given to ``route``.
        num_waiting: requests queued there, not yet running.
        num_running: requests running there.
        outstanding_tokens: tokens still to compute for the requests routed to it: prompt
            tokens not yet computed plus output tokens not yet generated (``max_tokens``
            counts as the output length).
    """

    index: int
    num_waiting: int
    num_running: int
    outstanding_tokens: int

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` this replica's prefix cache holds now.

        A question only: it takes no reference on blocks and changes no eviction order.
        """
        ...


@runtime_checkable
class RoutingPolicy(Protocol):
    """Picks the replica for each new request. A complete example, fewest requests first::

        @register("router", "fewest_requests")
        class FewestRequests:
            name = "fewest_requests"

            def route(self, request, replicas):
                loads = [r.num_waiting + r.num_running for r in replicas]
                return loads.index(min(loads))

    Optional hook, called only when the router defines it:

    * ``on_finish(request_id, replica)``: the request routed to ``replica`` (its index in
      the sequence ``route`` saw) finished or was aborted; per-request state keyed on it
      is dead.

    A router with memory (where prefixes or sessions went) stores indices; it must answer
    within ``range(len(replicas))`` even when the number of replicas changed since.
    """

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> int:
        """The index into ``replicas`` (never empty) of the replica that serves ``request``."""
        ...


def check_choice(policy: object, answer: object, num_replicas: int) -> int:
    """``answer``, what ``policy.route`` returned for ``num_replicas`` replicas, as a plain
    ``int`` in ``range(num_replicas)``.

    Integers of numpy and 0-d torch are accepted; ``bool`` (of any kind), floats, strings
    and out-of-range indices raise ``ValueError`` naming the router.
    """
    label = f"router {component_name(policy)}"
    if num_replicas < 1:
        raise ValueError(f"{label}: there are no replicas to route to (got {num_replicas})")
    allowed = f"an int in [0, {num_replicas - 1}] (an index into the {num_replicas} replicas)"
    try:
        return as_int("route()", answer, min=0, max=num_replicas - 1, allowed=allowed)
    except (TypeError, ValueError):
        got = f"{type(answer).__name__} {answer!r}"
        raise ValueError(f"{label}: route() must return {allowed}, got {got}") from None
