"""``SpecDecodeStats`` against counts and rates worked out by hand from synthetic events."""

from __future__ import annotations

import math

import pytest

from llmlab.observe.events import StepEvent
from llmlab.speculative.stats import SpecDecodeStats, SpecTotals


def event(step_index: int, speculated, end_time_s: float = 0.0) -> StepEvent:
    """A StepEvent with only what the stats read."""
    return StepEvent(
        step_index=step_index, scheduled=(), scheduled_users=(), scheduled_priorities=(),
        num_batched_tokens=0, preempted=(), finished=(), aborted=(), blocks_allocated=(),
        blocks_freed=(), blocks_prefix_hit=(), blocks_evicted=(), blocks_forked=(),
        num_free_blocks=0, num_total_blocks=0, kv_usage=0.0, num_waiting=0, num_running=0,
        wall_time_s=0.0, model_time_s=0.0, end_time_s=end_time_s,
        speculated=tuple(speculated),
    )


# (request, drafted, accepted) per step. Drafts: a 4/2, b 2/2, a 3/0, c 1/1, a 4/4; b's
# (0, 0) in step 1 is no draft; step 2 speculated nothing.
STEPS = [
    event(0, [("a", 4, 2), ("b", 2, 2)], end_time_s=1.0),
    event(1, [("a", 3, 0), ("b", 0, 0), ("c", 1, 1)], end_time_s=2.0),
    event(2, [], end_time_s=3.0),
    event(3, [("a", 4, 4)], end_time_s=4.0),
]


@pytest.fixture
def stats() -> SpecDecodeStats:
    stats = SpecDecodeStats()
    for e in STEPS:
        stats(e)
    return stats


def test_totals_and_the_two_headline_numbers(stats):
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 14, 9)
    assert stats.acceptance_rate == 9 / 14
    assert stats.mean_acceptance_length == 1 + 9 / 5


def test_per_position_counts_and_rates(stats):
    # position j:             1  2  3  4
    assert stats.drafted_per_pos == [5, 4, 3, 2]  # drafts with >= j drafted
    assert stats.accepted_per_pos == [4, 3, 1, 1]  # drafts with >= j accepted
    assert stats.reached_per_pos == [5, 3, 2, 1]  # >= j drafted and >= j-1 accepted
    assert stats.per_position_acceptance_rate == [4 / 5, 3 / 4, 1 / 3, 1 / 2]
    assert stats.per_position_conditional_rate == [4 / 5, 3 / 3, 1 / 2, 1 / 1]


def test_per_request_totals(stats):
    assert stats.per_request("a") == SpecTotals(3, 11, 6)
    assert stats.per_request("b") == SpecTotals(1, 2, 2)
    assert stats.per_request("c") == SpecTotals(1, 1, 1)
    assert stats.per_request("never-seen") == SpecTotals(0, 0, 0)
    assert stats.per_request("a").acceptance_rate == 6 / 11
    assert stats.per_request("a").mean_acceptance_length == 1 + 6 / 3


def test_series_has_one_point_per_step_that_drafted(stats):
    assert [(s.step_index, s.end_time_s, s.totals) for s in stats.series] == [
        (0, 1.0, SpecTotals(2, 6, 4)),
        (1, 2.0, SpecTotals(2, 4, 1)),
        (3, 4.0, SpecTotals(1, 4, 4)),
    ]


def test_summary_holds_every_number(stats):
    summary = stats.summary()
    assert summary == {
        "num_drafts": 5, "num_draft_tokens": 14, "num_accepted_tokens": 9,
        "acceptance_rate": 9 / 14, "mean_acceptance_length": 1 + 9 / 5,
        "drafted_per_pos": [5, 4, 3, 2], "accepted_per_pos": [4, 3, 1, 1],
        "reached_per_pos": [5, 3, 2, 1],
        "per_position_acceptance_rate": [4 / 5, 3 / 4, 1 / 3, 1 / 2],
        "per_position_conditional_rate": [4 / 5, 1.0, 1 / 2, 1.0],
        "num_requests": 3, "num_decode_steps": 0, "num_steps_without_drafts": 0,
    }
    summary["accepted_per_pos"].append(99)
    assert stats.accepted_per_pos == [4, 3, 1, 1], "summary() hands out copies"


def test_rates_without_drafts_are_undefined_not_zero():
    stats = SpecDecodeStats()
    stats(event(0, []))
    assert math.isnan(stats.acceptance_rate)
    assert math.isnan(stats.mean_acceptance_length)
    assert stats.per_position_acceptance_rate == []
    assert stats.series == []


def test_a_position_no_draft_was_verified_at_has_an_undefined_conditional_rate():
    stats = SpecDecodeStats()
    stats(event(0, [("a", 3, 0)]))  # rejected at 1: positions 2 and 3 never verified
    assert stats.per_position_acceptance_rate == [0.0, 0.0, 0.0]
    assert stats.per_position_conditional_rate[0] == 0.0
    assert all(math.isnan(r) for r in stats.per_position_conditional_rate[1:])


def test_reset_forgets_everything(stats):
    stats.reset()
    assert stats.summary()["num_drafts"] == 0 and stats.summary()["num_requests"] == 0
    assert stats.drafted_per_pos == stats.series == []
    stats(event(7, [("a", 1, 1)]))
    assert stats.summary()["accepted_per_pos"] == [1]


@pytest.mark.parametrize("entry", [("a", 2, 3), ("a", 2, -1)])
def test_an_impossible_entry_is_refused_and_changes_nothing(stats, entry):
    before = stats.summary()
    with pytest.raises(ValueError, match=r"num_accepted must be in \[0, num_drafted=2\]"):
        stats(event(9, [("z", 1, 1), entry]))
    assert stats.summary() == before


def test_decode_steps_without_drafts_are_counted():
    """A step that decoded and drafted nothing (the adaptive length kept speculation off)
    counts toward num_steps_without_drafts; a prefill-only step is no decode step."""
    import attrs

    stats = SpecDecodeStats()
    decode = (("a", 1), ("b", 3))
    stats(attrs.evolve(event(0, [("b", 2, 1)]), scheduled=decode))
    stats(attrs.evolve(event(1, []), scheduled=(("a", 1), ("b", 1))))
    stats(attrs.evolve(event(2, []), scheduled=(("c", 16),), num_prefill_tokens=16))
    stats(attrs.evolve(event(3, []), scheduled=(("c", 17), ("a", 1)), num_prefill_tokens=17))
    assert (stats.num_decode_steps, stats.num_steps_without_drafts) == (3, 2)
    stats.reset()
    assert (stats.num_decode_steps, stats.num_steps_without_drafts) == (0, 0)
