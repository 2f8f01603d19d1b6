"""The speculation-length components: fixed, by batch size, and the adaptive default,
which must find the faster mode from measured step throughput and keep probing."""

from __future__ import annotations

import types

import pytest

from llmlab.speculative.length import AdaptiveLength, BatchSizeLength, FixedLength


def _views(n):
    return [types.SimpleNamespace(request_id=str(i)) for i in range(n)]


def _event(batch, on_tokens, wall, speculated=()):
    return types.SimpleNamespace(
        speculated=speculated, finished=(), aborted=(), scheduled=(("x", 1),) * batch,
        num_prefill_tokens=0, sampled=(("x", on_tokens),), wall_time_s=wall,
    )


def _simulate(policy, batch, steps, on_cost, off_cost, accepted_per_draft, k=4):
    """Run ``steps`` steps: off, a step yields ``batch`` tokens in ``off_cost`` s; on, each
    request drafts what the policy asked and accepts ``accepted_per_draft`` of it, in
    ``on_cost`` s. Returns how many steps ran with speculation on."""
    on_steps = 0
    views = _views(batch)
    for _ in range(steps):
        ks = policy.lengths(views, batch)
        drafted = [k_ for k_ in ks if k_]
        if drafted:
            on_steps += 1
            spec = tuple((v.request_id, d, min(d, accepted_per_draft))
                         for v, d in zip(views, ks, strict=True) if d)
            tokens = batch + sum(a for _, _, a in spec)
            policy.observe(_event(batch, tokens, on_cost, spec))
        else:
            policy.observe(_event(batch, batch, off_cost))
    return on_steps


def test_fixed_and_by_batch_size():
    assert FixedLength(3).lengths(_views(5), 5) == [3] * 5
    table = BatchSizeLength(4, {1: 4, 8: 2, 32: 1})
    assert table.lengths(_views(1), 1) == [4]
    assert table.lengths(_views(2), 8) == [2, 2]
    assert table.lengths(_views(2), 32) == [1, 1]
    assert table.lengths(_views(2), 33) == [0, 0]
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        FixedLength(0)


def test_adaptive_speculates_where_it_pays():
    policy = AdaptiveLength(4)
    # Drafts nearly always accepted, verification cheap: on wins (4.6x tokens, 1.5x time).
    on = _simulate(policy, batch=1, steps=400, on_cost=1.5e-3, off_cost=1e-3,
                   accepted_per_draft=4)
    assert on > 0.9 * 400


def test_adaptive_turns_speculation_off_where_it_does_not_pay():
    policy = AdaptiveLength(4)
    # At batch 64 the wider pass costs 3x for 1.3x the tokens: off wins; after the first
    # measurements only rare probes run with speculation.
    on = _simulate(policy, batch=64, steps=2000, on_cost=30e-3, off_cost=10e-3,
                   accepted_per_draft=1)
    assert on < 0.03 * 2000
    assert policy.speculating(64) is False


def test_adaptive_notices_a_change():
    policy = AdaptiveLength(4)
    _simulate(policy, batch=8, steps=300, on_cost=30e-3, off_cost=10e-3, accepted_per_draft=1)
    assert policy.speculating(8) is False
    # Drafts become good (e.g. the workload turned to copying): a probe finds it. (Probes
    # of a mode that cost 3x wait until they are at most 1% of the time: ~800 steps here.)
    on = _simulate(policy, batch=8, steps=3000, on_cost=12e-3, off_cost=10e-3,
                   accepted_per_draft=4)
    assert policy.speculating(8) is True and on > 1500


def test_adaptive_drafts_per_request_by_its_acceptance():
    policy = AdaptiveLength(4, min_acceptance=0.3)
    bad, good = _views(2)
    for _ in range(20):
        policy.observe(_event(2, 2, 1e-3, (("0", 4, 0), ("1", 4, 4))))
    assert policy.acceptance("0") < 0.3 < 0.9 < policy.acceptance("1")
    # Measure "on" as the faster mode, then ask.
    for b in policy._buckets.values():
        b.rates[1].extend([(100, 1.0)] * 4)
    ks = policy.lengths([bad, good], 2)
    assert ks[0] == 0 and ks[1] == 4


def test_a_new_batch_size_starts_from_its_neighbour():
    policy = AdaptiveLength(4)
    _simulate(policy, batch=64, steps=300, on_cost=30e-3, off_cost=10e-3, accepted_per_draft=1)
    # Batch 32 (the tail of a run) starts off, as 64 chose, instead of measuring "on" first.
    assert policy.lengths(_views(32), 32) == [0] * 32


def test_costly_probes_are_spaced_to_a_small_share_of_the_time():
    policy = AdaptiveLength(4)
    _simulate(policy, batch=64, steps=300, on_cost=30e-3, off_cost=10e-3, accepted_per_draft=1)
    on = _simulate(policy, batch=64, steps=6000, on_cost=30e-3, off_cost=10e-3,
                   accepted_per_draft=1)
    extra = on * (30e-3 - 10e-3)
    assert extra / (6000 * 10e-3) < 0.015
