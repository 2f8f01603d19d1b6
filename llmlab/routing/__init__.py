"""Request routing: which of N engine replicas serves each new request (the ``router``
component kind).

A router is one method, ``route(request, replicas) -> int``, the index of the chosen
replica. It sees only read-only views (:mod:`llmlab.routing.policy`): of the request
(:class:`RouteRequest`: id, prompt token ids, ``max_tokens``, user, session) and of each
replica (:class:`ReplicaView`: waiting and running counts, outstanding tokens, and
``cached_prefix_tokens(token_ids)``, a side-effect-free question to its prefix cache). It
knows nothing of what stands behind a view, so the same router serves the cluster
simulator and a real data-parallel front end. Callers check every answer with
:func:`check_choice`. A whole router, registered under a name::

    from llmlab import register

    @register("router", "fewest_requests")
    class FewestRequests:
        \"\"\"The replica with the fewest requests waiting or running.\"\"\"
        name = "fewest_requests"

        def route(self, request, replicas):
            loads = [r.num_waiting + r.num_running for r in replicas]
            return loads.index(min(loads))

An optional ``on_finish(request_id, replica)`` hook, called when present, tells a router
that a request it placed is done.

Built-ins (registered by name): ``round_robin``, ``least_loaded`` (fewest outstanding
tokens), ``prefix_aware`` (longest cached or recently routed prefix under a load cap) and
``session_affinity`` (sticky sessions); see :mod:`llmlab.routing.policies`.
"""

from llmlab.routing.policies import LeastLoaded, PrefixAware, RoundRobin, SessionAffinity
from llmlab.routing.policy import ReplicaView, RouteRequest, RoutingPolicy, check_choice

__all__ = [
    "LeastLoaded",
    "PrefixAware",
    "ReplicaView",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "SessionAffinity",
    "check_choice",
]
