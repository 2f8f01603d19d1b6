"""The built-in routers' defining properties, on fake replicas (no engine), and the
router kind's registry entry and answer check."""

import random

import attrs
import numpy as np
import pytest

from llmlab import register, registry
from llmlab.routing import (
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    RoutingPolicy,
    SessionAffinity,
    check_choice,
)
from tests.helpers import builtin_names

BLOCK = 4  # the fake caches hold whole blocks of this many tokens, as a paged cache does

BUILTINS = ["round_robin", "least_loaded", "prefix_aware", "session_affinity"]


@attrs.frozen
class FakeRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int = 16
    user: str | None = None
    session: str | None = None
    request_id: str = "r"


@attrs.define
class FakeReplica:
    """A replica whose load we set and whose prefix cache is a set of block-aligned token
    tuples."""

    index: int
    outstanding_tokens: int = 0
    num_waiting: int = 0
    num_running: int = 0
    cached: set[tuple[int, ...]] = attrs.field(factory=set)

    def cached_prefix_tokens(self, token_ids):
        hit = 0
        while hit + BLOCK <= len(token_ids) and tuple(token_ids[: hit + BLOCK]) in self.cached:
            hit += BLOCK
        return hit

    def cache(self, token_ids):
        for end in range(BLOCK, len(token_ids) + 1, BLOCK):
            self.cached.add(tuple(token_ids[:end]))


def replicas(*loads):
    return [FakeReplica(index=i, outstanding_tokens=load) for i, load in enumerate(loads)]


def request(tokens, **fields):
    return FakeRequest(prompt_token_ids=tuple(tokens), **fields)


def route(policy, req, views):
    return check_choice(policy, policy.route(req, views), len(views))


# -- registry ---------------------------------------------------------------------------


def test_builtin_names_are_exactly_the_four_and_each_meets_the_contract():
    assert builtin_names("router") == BUILTINS
    for name in BUILTINS:
        policy = registry.create("router", name)
        registry.check("router", policy)
        assert isinstance(policy, RoutingPolicy)
        assert policy.name == name
        assert policy.__doc__ and "," in policy.__doc__  # cites its source


def test_an_unknown_router_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown router 'nope'; available: round_robin, "
                                         "least_loaded, prefix_aware, session_affinity"):
        registry.resolve("router", "nope")


def test_a_router_without_route_or_with_the_wrong_call_shape_is_refused():
    class NoRoute:
        def pick(self, request, replicas): ...

    class RequestOnly:
        def route(self, request): ...

    with pytest.raises(TypeError, match=r"router NoRoute is missing method 'route'; expected "
                                        r"route\(self, request, replicas\) -> int"):
        registry.check("router", NoRoute())
    with pytest.raises(TypeError, match=r"RequestOnly.route.*cannot take the engine's call"):
        registry.check("router", RequestOnly())


def test_a_custom_router_registers_and_resolves_by_name():
    @register("router", "fewest_requests")
    class FewestRequests:
        name = "fewest_requests"

        def route(self, request, replicas):
            loads = [r.num_waiting + r.num_running for r in replicas]
            return loads.index(min(loads))

    try:
        policy = registry.create("router", "fewest_requests")
        registry.check("router", policy)
        views = replicas(0, 0, 0)
        views[0].num_running, views[2].num_waiting = 2, 1
        assert route(policy, request(range(4)), views) == 1
    finally:
        registry.table("router").pop("fewest_requests", None)


# -- check_choice -----------------------------------------------------------------------


@pytest.mark.parametrize("answer", [-1, 4, 1.5, True, np.bool_(False), "0", None],
                         ids=repr)
def test_check_choice_refuses_anything_but_an_index_naming_the_router(answer):
    with pytest.raises(ValueError, match=r"router 'round_robin' \(RoundRobin\): route\(\) must "
                                         r"return an int in \[0, 3\]"):
        check_choice(RoundRobin(), answer, 4)


def test_check_choice_returns_a_plain_int_for_numpy_integers():
    answer = check_choice(RoundRobin(), np.int64(3), 4)
    assert answer == 3 and type(answer) is int


def test_every_builtin_answers_in_range_when_replicas_are_removed():
    for name in BUILTINS:
        policy = registry.create("router", name)
        for num_replicas in (4, 2):  # 4: every replica gets remembered prefixes and sessions
            for i in range(8):
                req = request(range(i, i + 32), session=f"s{i}", user="u")
                route(policy, req, replicas(*[0] * num_replicas))


# -- round_robin and least_loaded -------------------------------------------------------


def test_round_robin_cycles_through_the_replicas():
    policy, views = RoundRobin(), replicas(50, 0, 9, 0)
    choices = [route(policy, request(range(4)), views) for _ in range(9)]
    assert choices == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_least_loaded_picks_the_fewest_outstanding_tokens_and_equals_take_turns():
    policy = LeastLoaded()
    assert route(policy, request(range(4)), replicas(5, 2, 9)) == 1
    idle = replicas(0, 0, 0, 0)
    assert [route(policy, request(range(4)), idle) for _ in range(6)] == [2, 3, 0, 1, 2, 3]
    assert route(policy, request(range(4)), replicas(3, 7, 3, 7)) == 0  # next at or after 0


def spread_over_time(policy, sizes, num_replicas=4, drain_tokens=30):
    """Route one request per tick (skewed sizes); each replica computes ``drain_tokens`` a
    tick. Returns the largest max-min spread of outstanding tokens seen."""
    views, worst = replicas(*[0] * num_replicas), 0
    for size in sizes:
        views[route(policy, request(range(4), max_tokens=size), views)].outstanding_tokens += size
        for view in views:
            view.outstanding_tokens = max(view.outstanding_tokens - drain_tokens, 0)
        loads = [view.outstanding_tokens for view in views]
        worst = max(worst, max(loads) - min(loads))
    return worst


def test_least_loaded_keeps_replicas_even_on_skewed_sizes_where_round_robin_does_not():
    sizes = [400, 20, 20, 20] * 200  # every fourth request is big: round robin stacks them
    balanced = spread_over_time(LeastLoaded(), sizes)
    assert balanced <= max(sizes)
    assert spread_over_time(RoundRobin(), sizes) > 50 * balanced


# -- prefix_aware -----------------------------------------------------------------------


def test_prefix_aware_follows_the_longest_cached_prefix():
    prompt = list(range(100, 164))
    views = replicas(0, 0, 0, 0)
    views[1].cache(prompt[:16])
    views[2].cache(prompt[:40])
    assert route(PrefixAware(), request(prompt + [7, 8]), views) == 2


def test_prefix_aware_keeps_a_prefix_together_before_anything_is_cached():
    policy, views = PrefixAware(), replicas(0, 0, 0, 0)
    shared = list(range(1000, 1064))
    first = route(policy, request(shared + [1, 2, 3]), views)
    views[first].outstanding_tokens += 67 + 16  # queued, nothing computed or cached yet
    assert route(policy, request(shared + [4, 5]), views) == first
    other = route(policy, request(list(range(5000, 5064))), views)
    assert other != first  # no shared prefix: the least loaded


def test_prefix_aware_memory_is_bounded_and_keeps_the_head_of_each_prefix():
    policy, views = PrefixAware(chunk_tokens=4, max_prefixes=3), replicas(0, 0, 0)
    first = route(policy, request(range(40)), views)
    assert len(policy._sent) == 3
    # only the first 12 tokens are shared; they are what the bounded memory kept
    assert route(policy, request([*range(12), 99, 98, 97, 96]), views) == first


def test_prefix_aware_skips_a_cached_replica_over_the_load_cap():
    prompt = list(range(64))
    views = replicas(10_000, 100, 100, 100)  # cap: 1.5 * 2575 + 64 + 16 tokens
    views[0].cache(prompt)
    views[2].cache(prompt[:32])
    assert route(PrefixAware(), request(prompt), views) == 2  # the best prefix under the cap
    views = replicas(300, 100, 100, 100)  # cap: 1.5 * 150 + 80 = 305
    views[0].cache(prompt)
    assert route(PrefixAware(), request(prompt), views) == 0
    assert route(PrefixAware(load_cap=1.0), request(prompt), replicas(300, 100, 100, 100)) != 0


def conversation_hits(policy, *, num_conversations=16, turns=6, num_replicas=4, drain_tokens=20,
                      seed=0):
    """A multi-turn stream: each turn's prompt is the conversation so far plus a new user
    message; its answer joins the history. After routing, the replica's cache gains the
    prompt and answer. Returns (prompt tokens found cached, largest load spread)."""
    rng = random.Random(seed)
    system = [rng.randrange(50_000) for _ in range(20)]
    history = {c: system + [rng.randrange(50_000) for _ in range(40)]
               for c in range(num_conversations)}
    order = [c for c in range(num_conversations) for _ in range(turns)]
    rng.shuffle(order)
    views, hits, spread = replicas(*[0] * num_replicas), 0, 0
    for c in order:
        prompt = history[c] + [rng.randrange(50_000) for _ in range(20)]
        answer = [rng.randrange(50_000) for _ in range(30)]
        view = views[route(policy, request(prompt, max_tokens=30, session=f"c{c}"), views)]
        hit = view.cached_prefix_tokens(prompt)
        hits += hit
        view.cache(prompt + answer)
        view.outstanding_tokens += len(prompt) - hit + len(answer)
        for v in views:
            v.outstanding_tokens = max(v.outstanding_tokens - drain_tokens, 0)
        loads = [v.outstanding_tokens for v in views]
        spread = max(spread, max(loads) - min(loads))
        history[c] = prompt + answer
    return hits, spread


class AllOnOne:
    """Every request to replica 0: every reusable prefix is hit, and the load piles up."""

    def route(self, request, replicas):
        return 0


def test_prefix_aware_and_session_affinity_beat_round_robin_on_a_multi_turn_stream():
    most, piled_up = conversation_hits(AllOnOne())
    blind, _ = conversation_hits(RoundRobin())
    aware, aware_spread = conversation_hits(PrefixAware())
    sticky, _ = conversation_hits(SessionAffinity())
    assert blind < 0.65 * most  # each turn's history sits on the previous turn's replica
    assert aware > 0.95 * most and sticky > 0.95 * most
    assert aware_spread < piled_up / 4  # the load cap spreads the conversations


def test_prefix_aware_parameters_are_validated_naming_the_field():
    with pytest.raises(ValueError, match="load_cap must be >= 1.0, got 0.5"):
        PrefixAware(load_cap=0.5)
    with pytest.raises(TypeError, match="load_cap"):
        PrefixAware(load_cap="1.5")
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1, got 0"):
        PrefixAware(chunk_tokens=0)
    with pytest.raises(ValueError, match="min_prefix_tokens"):
        PrefixAware(min_prefix_tokens=-1)
    with pytest.raises(ValueError, match="max_prefixes"):
        PrefixAware(max_prefixes=0)
    with pytest.raises(ValueError, match="max_sessions"):
        SessionAffinity(max_sessions=0)


def test_prefix_aware_ignores_matches_shorter_than_min_prefix_tokens():
    prompt = list(range(64))
    views = replicas(0, 0, 0, 0)
    views[3].cache(prompt[:8])
    assert route(PrefixAware(min_prefix_tokens=16, match_ratio=0), request(prompt), views) == 0
    assert route(PrefixAware(match_ratio=0), request(prompt), views) == 3


def test_prefix_aware_sends_work_to_an_idle_replica_once_the_others_carry_more():
    """Every busy replica holds the shared system prompt; the idle one holds nothing. The
    cap is measured from the least loaded replica, so the idle one gets the request (a
    cap measured from the mean alone would keep it idle for good)."""
    prompt = list(range(64))
    views = replicas(600, 600, 600, 0)
    for view in views[:3]:
        view.cache(prompt[:48])
    assert route(PrefixAware(), request(prompt), views) == 3
    views = replicas(60, 60, 60, 0)  # lightly loaded: the cached prefix still wins
    for view in views[:3]:
        view.cache(prompt[:48])
    assert route(PrefixAware(), request(prompt), views) in (0, 1, 2)


def test_prefix_aware_ignores_a_match_covering_too_little_of_the_prompt():
    """A prefix every prompt shares (a system prompt) does not pull new conversations to
    the replicas that already served one: the idle replica gets them."""
    prompt = list(range(64))
    views = replicas(40, 40, 0)
    views[0].cache(prompt[:24])  # 24 of 64 tokens: under the default match_ratio of 0.5
    views[1].cache(prompt[:24])
    assert route(PrefixAware(), request(prompt), views) == 2
    assert route(PrefixAware(match_ratio=0.25), request(prompt), views) == 0
    views[0].cache(prompt[:40])  # 40 of 64: enough
    assert route(PrefixAware(), request(prompt), views) == 0
    with pytest.raises(ValueError, match="match_ratio"):
        PrefixAware(match_ratio=1.5)


# -- session_affinity -------------------------------------------------------------------


def test_session_affinity_sticks_to_the_first_choice_whatever_the_load():
    policy, views = SessionAffinity(), replicas(50, 10, 30)
    assert route(policy, request(range(4), session="a", user="x"), views) == 1
    views[1].outstanding_tokens = 10_000
    assert route(policy, request(range(4), session="a", user="y"), views) == 1
    # no session: the user is the key; neither: least loaded every time
    assert route(policy, request(range(4), user="x"), views) == 2
    views[2].outstanding_tokens = 20_000
    assert route(policy, request(range(4), user="x"), views) == 2
    assert route(policy, request(range(4)), views) == 0
    assert route(policy, request(range(4)), views) == 0


def test_session_affinity_forgets_the_least_recently_seen_session_first():
    policy, views = SessionAffinity(max_sessions=2), replicas(0, 0, 0, 0)
    assert [route(policy, request(range(4), session=s), views) for s in "aba"] == [0, 1, 0]
    assert route(policy, request(range(4), session="c"), views) == 2  # forgets b
    assert len(policy._replica_of) == 2
    for view in views[:3]:  # replica 3 is now the least loaded
        view.outstanding_tokens = 100
    assert route(policy, request(range(4), session="b"), views) == 3  # placed afresh
    assert route(policy, request(range(4), session="c"), views) == 2  # still remembered
