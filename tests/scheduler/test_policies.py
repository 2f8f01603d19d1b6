"""Each built-in scheduling policy's defining property, on the scheduler with no model."""

import pytest

from llmlab import registry
from llmlab.cache import KVCacheManager
from llmlab.errors import ComponentError
from llmlab.scheduler import (
    FCFS,
    BatchOutput,
    CacheAware,
    Policy,
    PriorityPolicy,
    Scheduler,
    ShortestJobFirst,
    ShortestPromptFirst,
    SkipJoinMLFQ,
    VirtualTokenCounter,
    as_policy,
)
from tests.helpers import builtin_names, make_request


def make_scheduler(policy, num_blocks=64, block_size=4, max_num_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(kv=kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=1024, policy=policy)


def step(sched, now=0.0):
    batch = sched.schedule(now=now)
    output = BatchOutput.from_lists(
        [[1] * e.num_scored for e in batch.entries], [[-0.5] * e.num_scored for e in batch.entries]
    )
    sched.update(batch, output)
    assert sched.take_errors() == []
    return batch


def admission_order(policy, requests, **kw):
    """Ids in the order a one-row scheduler admits ``requests`` (each 1 output token)."""
    sched = make_scheduler(policy, max_num_seqs=1, **kw)
    for r in requests:
        sched.add(r)
    order, now = [], 0.0
    while sched.num_unfinished:
        order += [e.request_id for e in step(sched, now).entries if e.new_row]
        now += 1.0
    return order


def test_builtin_names_are_exactly_the_zoo():
    builtin = builtin_names("scheduling_policy")
    assert builtin == [
        "fcfs", "priority", "spf", "sjf", "fair", "cache_aware", "mlfq"
    ]
    for name in builtin:
        policy = registry.create("scheduling_policy", name)
        assert policy.name == name and as_policy(policy) is policy
        assert policy.__doc__ and "," in policy.__doc__  # cites its source


def test_fcfs_admits_by_arrival_and_preempts_the_latest():
    reqs = [make_request(range(4), max_tokens=1, arrival=t, request_id=f"t{t}") for t in (3, 1, 2)]
    assert admission_order(FCFS(), reqs) == ["t1", "t2", "t3"]
    assert FCFS().victim([r.view for r in reqs]).request_id == "t3"


def test_sjf_admits_the_shortest_job_first():
    reqs = [make_request(range(4), max_tokens=m, arrival=0, request_id=f"m{m}") for m in (50, 5, 20)]
    assert admission_order(ShortestJobFirst(), reqs) == ["m5", "m20", "m50"]
    fcfs_reqs = [
        make_request(range(4), max_tokens=m, arrival=0, request_id=f"f{m}") for m in (50, 5, 20)
    ]
    assert admission_order(FCFS(), fcfs_reqs) == ["f50", "f5", "f20"]


def test_sjf_uses_a_length_predictor_once_per_request():
    calls = []

    def predictor(view):
        calls.append(view.request_id)
        return 100 - view.num_prompt_tokens  # longer prompt -> shorter answer, say

    reqs = [make_request(range(n), max_tokens=2, arrival=0, request_id=f"p{n}") for n in (4, 12, 8)]
    assert admission_order(ShortestJobFirst(predictor=predictor), reqs) == ["p12", "p8", "p4"]
    assert sorted(calls) == ["p12", "p4", "p8"]  # each predicted once, however often queued


def test_spf_admits_the_shortest_prompt_and_aging_bounds_starvation():
    reqs = [make_request(range(n), max_tokens=1, arrival=0, request_id=f"n{n}") for n in (12, 4, 8)]
    assert admission_order(ShortestPromptFirst(), reqs) == ["n4", "n8", "n12"]
    # With aging 1 token/s, a 40-token prompt that waited 100 s beats a fresh 4-token one.
    old = make_request(range(40), max_tokens=1, arrival=0, request_id="old")
    new = make_request(range(4), max_tokens=1, arrival=100, request_id="new")
    assert admission_order(ShortestPromptFirst(aging=1.0), [new, old]) == ["old", "new"]
    assert admission_order(ShortestPromptFirst(), [new, old]) == ["new", "old"]


def test_priority_admits_lowest_value_first_with_ties_by_arrival():
    reqs = [
        make_request(range(4), max_tokens=1, arrival=t, request_id=f"p{p}t{t}")
        for p, t in ((1, 0), (0, 2), (1, -1), (0, 1))
    ]
    for r, p in zip(reqs, (1, 0, 1, 0)):
        r.priority = p
    assert admission_order(PriorityPolicy(), reqs) == ["p0t1", "p0t2", "p1t-1", "p1t0"]


def test_priority_preempts_the_lowest_priority_when_blocks_run_out():
    # 12 blocks of 4 tokens; three running requests hold 3 blocks each after prefill.
    sched = make_scheduler(PriorityPolicy(preempt=False), num_blocks=12, budget=64)
    reqs = [make_request(range(10 * i, 10 * i + 12), max_tokens=40, arrival=i) for i in range(3)]
    for r, p in zip(reqs, (2, 7, 0)):
        r.priority = p
        sched.add(r)
    while not any(r.num_preemptions for r in reqs):
        step(sched)
    assert [r.num_preemptions for r in reqs] == [0, 1, 0]  # priority 7 went first


def test_priority_preempts_a_lower_priority_request_to_admit_an_urgent_one():
    sched = make_scheduler(PriorityPolicy(), max_num_seqs=2)
    low, mid = make_request(range(4), max_tokens=50, arrival=0), make_request(range(8), max_tokens=50, arrival=1)
    low.priority, mid.priority = 5, 3
    sched.add(low)
    sched.add(mid)
    step(sched)
    urgent = make_request(range(4), max_tokens=5, arrival=2)
    urgent.priority = 0
    sched.add(urgent)
    batch = step(sched)  # no free row: the lowest priority running request makes room
    assert batch.preempted == (low.request_id,)
    assert {e.request_id for e in batch.entries} == {mid.request_id, urgent.request_id}
    assert low in sched.waiting and list(sched.kv.block_table(low.request_id)) == []
    # An equal priority never preempts (no thrashing): mid (3) is now the lowest running.
    peer = make_request(range(4), max_tokens=5, arrival=3)
    peer.priority = 3
    sched.add(peer)
    assert step(sched).preempted == ()
    sched.kv.check()


def test_cache_aware_admits_the_longest_cached_prefix_first():
    shared = list(range(100, 112))  # three full blocks of 4
    def scenario(policy):
        sched = make_scheduler(policy, max_num_seqs=1)
        warm = make_request(shared, max_tokens=1, arrival=0, request_id="warm")
        sched.add(warm)
        while sched.num_unfinished:
            step(sched)
        reqs = [
            make_request(range(500, 513), max_tokens=1, arrival=1, request_id="none"),
            make_request(shared[:4] + list(range(600, 609)), max_tokens=1, arrival=2, request_id="4"),
            make_request(shared + [7], max_tokens=1, arrival=3, request_id="12"),
            make_request(shared[:8] + list(range(700, 705)), max_tokens=1, arrival=4, request_id="8"),
        ]
        for r in reqs:
            sched.add(r)
        order = []
        while sched.num_unfinished:
            order += [e.request_id for e in step(sched, now=len(order)).entries if e.new_row]
        return order

    assert scenario(CacheAware()) == ["12", "8", "4", "none"]
    assert scenario(FCFS()) == ["none", "4", "12", "8"]
    assert scenario(CacheAware(max_queue=2)) == ["none", "4", "12", "8"]  # long queue: FCFS


def _service_gap(policy, n_each=40):
    """max - min over time of (heavy service - light service) while both are backlogged, and
    the VTC bound 2 * max(w_p * L_input, w_q * M) for this setup."""
    sched = make_scheduler(policy, num_blocks=16, block_size=4, max_num_seqs=4, budget=64)
    reqs = []
    # The heavy user's whole backlog arrives first, with longer prompts and answers.
    for user, prompt, max_tokens in (("heavy", 8, 12), ("light", 3, 5)):
        for _ in range(n_each):
            r = make_request(range(prompt), max_tokens=max_tokens, arrival=0)
            r.user = user
            reqs.append(r)
            sched.add(r)
    service = {"heavy": 0, "light": 0}
    diffs = [0]
    while all(any(not r.is_finished for r in reqs if r.user == u) for u in service):
        batch = sched.schedule(now=0.0)
        by_id = {r.request_id: r for r in reqs}
        for e in batch.entries:  # VTC's service: prompt tokens computed once, outputs x2
            r = by_id[e.request_id]
            end = min(e.start + e.num_new_tokens, r.num_prompt_tokens)
            prompt = max(0, end - max(e.start, r.num_prompt_computed))
            service[r.user] += 1 * prompt + 2 * e.num_scored
        sched.update(batch, BatchOutput.from_lists(
            [[1] * e.num_scored for e in batch.entries], [[0.0] * e.num_scored for e in batch.entries]
        ))
        diffs.append(service["heavy"] - service["light"])
    bound = 2 * max(1 * 8, 2 * 16 * 4)  # L_input = 8; M = 64 tokens fit the KV cache
    return max(diffs) - min(diffs), bound


def test_fair_keeps_the_service_gap_within_the_vtc_bound_where_fcfs_does_not():
    gap, bound = _service_gap(VirtualTokenCounter())
    assert 0 < gap <= bound
    fcfs_gap, _ = _service_gap(FCFS())
    assert fcfs_gap > bound  # FCFS serves the heavy user's backlog first


def test_fair_lifts_a_returning_users_counter_and_preempts_the_most_served():
    vtc = VirtualTokenCounter()
    a = make_request(range(10), arrival=0)
    a.user = "a"
    vtc.push(a.view, 0.0)
    assert vtc.pop(0.0) is a.view and vtc.counters["a"] == 10
    b = make_request(range(4), arrival=1)
    b.user = "b"
    vtc.push(b.view, 1.0)
    # b was idle: it starts from the last counter seen (a's 10), not from 0.
    assert vtc.counters["b"] == 10
    vtc.counters["a"] = 50
    assert vtc.victim([a.view, b.view]) is a.view


def test_mlfq_skip_joins_demotes_after_its_quantum_and_promotes_the_starved():
    mlfq = SkipJoinMLFQ(num_levels=4, base_quantum=16, starvation_s=10.0)
    short, mid, long = (make_request(range(n), arrival=0) for n in (10, 40, 1000))
    assert [mlfq.level_of(r.view) for r in (short, mid, long)] == [0, 2, 3]
    for r in (long, mid, short):
        mlfq.push(r.view, 0.0)
    assert mlfq.pop(1.0) is short.view  # highest level first, whatever the arrival order
    from llmlab.scheduler import Served
    mlfq.on_step((Served(short.view, 16, 10, 1),), 1.0)
    assert mlfq.level_of(short.view) == 1  # used its 16-token quantum at level 0
    assert mlfq.pop(2.0) is mid.view
    # long has waited 11 s at level 3: promoted to the top, ahead of a fresh short request.
    fresh = make_request(range(4), arrival=11)
    mlfq.push(fresh.view, 11.0)
    assert mlfq.pop(11.5) is long.view
    assert mlfq.pop(11.5) is fresh.view


@pytest.mark.parametrize("policy, first", [(SkipJoinMLFQ(base_quantum=4), "short"), (FCFS(), "long")])
def test_mlfq_serves_running_requests_highest_level_first(policy, first):
    sched = make_scheduler(policy, budget=12)
    long = make_request(range(20), max_tokens=4, arrival=0, request_id="long")  # level 3
    sched.add(long)
    step(sched)  # long prefills its first 12 tokens
    short = make_request(range(100, 103), max_tokens=4, arrival=1, request_id="short")  # level 0
    sched.add(short)
    batch = step(sched)  # long finishes its prefill (8), short is admitted (3)
    assert [e.request_id for e in batch.entries] == ["long", "short"]
    batch = step(sched)  # both decode: in level order under mlfq, admission order under fcfs
    assert batch.entries[0].request_id == first


# -- the interface itself -------------------------------------------------------------


def test_a_key_is_all_a_simple_policy_needs_and_it_is_read_once_per_queueing():
    calls = []

    class LongestFirst(Policy):
        name = "longest"

        def key(self, request):
            calls.append(request.request_id)
            return -request.num_prompt_tokens

    reqs = [make_request(range(n), max_tokens=1, arrival=0, request_id=f"n{n}") for n in (4, 12, 8)]
    assert admission_order(LongestFirst(), reqs) == ["n12", "n8", "n4"]
    assert sorted(calls) == ["n12", "n4", "n8"]  # no re-sorting per step


def test_the_two_method_form_still_works_and_order_runs_once_per_step():
    calls = []

    class ShortestPromptFirstV1:
        name = "spf_v1"

        def order(self, waiting, now):
            calls.append(len(waiting))
            return sorted(waiting, key=lambda r: r.num_prompt_tokens)

        def victim(self, candidates):
            return max(candidates, key=lambda r: r.arrival_time)

    reqs = [make_request(range(n), max_tokens=1, arrival=0, request_id=f"n{n}") for n in (12, 4, 8)]
    assert admission_order(ShortestPromptFirstV1(), reqs) == ["n4", "n8", "n12"]
    assert calls == [3, 2, 1]


def test_a_policy_missing_a_method_is_rejected_naming_it():
    class NoVictim:
        name = "x"

        def order(self, waiting, now):
            return waiting

    with pytest.raises(TypeError, match="missing method 'victim'"):
        as_policy(NoVictim())

    class HalfV2:
        def push(self, request, now): ...
        def pop(self, now): ...

    with pytest.raises(TypeError, match="missing method 'remove'"):
        make_scheduler(HalfV2())
    with pytest.raises(TypeError, match="instance"):
        as_policy(FCFS)


def test_policies_see_read_only_views():
    seen = []

    class Peek(FCFS):
        def push(self, request, now):
            seen.append(request)
            with pytest.raises(AttributeError):
                request.priority = 3
            super().push(request, now)

    sched = make_scheduler(Peek())
    sched.add(make_request(range(4)))
    step(sched)
    # A view: no mutable token lists, no KV state, nothing to assign.
    assert type(seen[0]).__name__ == "RequestView"
    assert not hasattr(seen[0], "all_token_ids") and not hasattr(seen[0], "block_hashes")


def test_a_failing_push_loses_no_request():
    class FlakyPush(FCFS):
        fail = True

        def push(self, request, now):
            if self.fail:
                self.fail = False
                raise RuntimeError("boom")
            super().push(request, now)

    sched = make_scheduler(FlakyPush())
    r = make_request(range(4), max_tokens=2)
    sched.add(r)
    assert sched.num_waiting == 1
    errors = sched.take_errors()
    assert len(errors) == 1 and isinstance(errors[0], ComponentError) and "push" in str(errors[0])
    while sched.num_unfinished:  # queued again at the next step, and served
        step(sched)
    assert r.num_output_tokens == 2
    sched.kv.check()


@pytest.mark.parametrize(
    "method, answer",
    [("pop", "not a request"), ("running_order", []), ("victim", None)],
)
def test_a_policy_answering_nonsense_is_reported_and_state_stays_consistent(method, answer):
    class Liar(FCFS):
        pass

    policy = Liar()
    sched = make_scheduler(policy, num_blocks=6, max_num_seqs=2)
    a, b = make_request(range(8), max_tokens=30, arrival=0), make_request(range(50, 58), max_tokens=30, arrival=1)
    sched.add(a)
    sched.add(b)
    step(sched)
    setattr(policy, method, lambda *args: answer)
    for _ in range(10):
        sched.update(batch := sched.schedule(0.0), BatchOutput.from_lists(
            [[1] * e.num_scored for e in batch.entries], [[0.0] * e.num_scored for e in batch.entries]
        ))
        errors = sched.take_errors()
        if errors:
            break
    assert errors and isinstance(errors[0], ComponentError) and method in str(errors[0])
    sched.kv.check()
    assert sched.num_unfinished == 2


def test_a_policy_that_loses_waiting_requests_is_reported_not_spun_on():
    class Forgetful(FCFS):
        def push(self, request, now):
            pass  # never queues anything

    sched = make_scheduler(Forgetful())
    sched.add(make_request(range(4)))
    batch = sched.schedule(0.0)
    errors = sched.take_errors()
    assert batch.is_empty and len(errors) == 1 and "pop" in str(errors[0])
    assert sched.num_waiting == 1  # still accounted for; abort works
    assert [r.request_id for r in sched.abort([sched.waiting[0].request_id])]


def _doc_block(starts_with):
    import pathlib
    text = (pathlib.Path(__file__).parents[2] / "docs" / "components.md").read_text()
    blocks = [b.split("```")[0] for b in text.split("```python\n")[1:]]
    return next(b for b in blocks if b.startswith(starts_with))


def test_the_worked_examples_in_docs_components_run():
    namespace = {}
    from llmlab import registry

    exec(_doc_block("import bisect"), namespace)
    # The example registers its policy process-wide; other tests expect only the built-ins.
    registry.table("scheduling_policy").pop("round_robin_users", None)
    policy = namespace["RoundRobinUsers"]()
    sched = make_scheduler(policy, max_num_seqs=1)
    reqs = []
    for i, user in enumerate(["a", "a", "a", "b", "b"]):
        r = make_request(range(4), max_tokens=1, arrival=i, request_id=f"{user}{i}")
        r.user = user
        reqs.append(r)
        sched.add(r)
    order = []
    while sched.num_unfinished:
        order += [e.request_id for e in step(sched, float(len(order))).entries if e.new_row]
    assert order == ["a0", "b3", "a1", "b4", "a2"]

    exec(_doc_block("from llmlab import register\n\n@register(\"eviction_policy\""), namespace)
    # The example registers "mru" process-wide; other tests expect only the built-ins.
    registry.table("eviction_policy").pop("mru", None)
    mru = namespace["MostRecentlyFreed"]()
    mru.on_free([1, 2, 3])
    mru.on_hit([3])
    mru.on_free([4])
    assert mru.evict(2) == [4, 2]


def test_the_logits_processor_example_in_docs_components_runs():
    import torch

    from tests.helpers import make_request as req

    namespace = {}
    exec(_doc_block("import torch\nfrom llmlab.sampling import Sampler"), namespace)
    sampler = namespace["sampler"]
    fresh, going = req(range(4), temperature=0), req(range(4), temperature=0)
    going.append_output(5, 0.0)
    logits = torch.zeros(2, 20)
    logits[:, 11] = 5.0  # a digit is the favourite
    out = sampler(logits, [fresh, going])
    assert out.token_ids[0] == 11 and out.token_ids[1] not in (10, 11, 12)


def test_the_worked_examples_in_the_protocol_docstrings_run():
    import textwrap

    from llmlab.cache.eviction import EvictionPolicy
    from llmlab.scheduler import SchedulingPolicy

    def example(doc):
        return textwrap.dedent(doc.split("::\n")[1])

    namespace = {"register": lambda kind, name: (lambda cls: cls)}
    exec(example(SchedulingPolicy.__doc__), namespace)
    reqs = [make_request(range(4), max_tokens=1, arrival=t, request_id=f"t{t}") for t in (0, 1, 2)]
    assert admission_order(namespace["LastComeFirstServed"](), reqs) == ["t2", "t1", "t0"]

    exec(example(EvictionPolicy.__doc__), namespace)
    kv = KVCacheManager(num_blocks=8, block_size=4, eviction=namespace["MostRecentlyFreed"]())
    for start in (0, 100, 200):  # three 2-block prompts cached in turn
        r = make_request(range(start, start + 8))
        assert kv.allocate(r, 8)
        r.num_computed_tokens = 8
        kv.cache_computed_blocks(r)
        kv.free(r)
    big = make_request(range(300, 316))
    assert kv.allocate(big, 16)  # 4 blocks: the 2 empty ones, then 2 evicted
    kv.check()
    cached = [len(kv.lookup_prefix(make_request([*range(s, s + 8), 1]))) for s in (0, 100, 200)]
    assert cached == [2, 2, 0]  # the most recently freed prompt went first
