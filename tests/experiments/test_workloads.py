"""Workload generators: seeded, shaped as promised, and strict about their arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llmlab.experiments import (
    Workload,
    WorkloadRequest,
    bursts,
    chain,
    fairness_gap,
    few_shot,
    mixed_long_short,
    multi_tenant,
    poisson_arrivals,
    shared_prefix_chat,
)

VOCAB = 100

GENERATORS = {
    "shared_prefix_chat": lambda seed, **kw: shared_prefix_chat(
        3, 3, vocab_size=VOCAB, system_prompt_len=8, user_turn_len=(2, 4), output_len=(1, 3),
        rate=5.0, seed=seed, **kw,
    ),
    "few_shot": lambda seed, **kw: few_shot(
        12, vocab_size=VOCAB, num_templates=3, template_len=20, question_len=(3, 5),
        rate=5.0, seed=seed, **kw,
    ),
    "mixed_long_short": lambda seed, **kw: mixed_long_short(
        12, vocab_size=VOCAB, long_prompt_len=30, short_prompt_len=(2, 4), long_output_len=9,
        short_output_len=2, rate=5.0, seed=seed, **kw,
    ),
    "multi_tenant": lambda seed, **kw: multi_tenant(
        12, vocab_size=VOCAB, prompt_len=(4, 8), output_len=(1, 4), rate=5.0, seed=seed, **kw,
    ),
    "bursts": lambda seed, **kw: bursts(
        3, 4, vocab_size=VOCAB, gap_s=1.0, spread_s=0.1, prompt_len=(4, 8), output_len=(5, 9),
        seed=seed, **kw,
    ),
}


@pytest.mark.parametrize("name", GENERATORS)
def test_generator_is_deterministic_under_a_seed_and_differs_under_another(name):
    make = GENERATORS[name]
    assert make(0) == make(0)
    assert make(0) != make(1)
    assert make(0).name == name


@pytest.mark.parametrize("name", GENERATORS)
def test_generated_tokens_lie_in_low_to_vocab_size_and_arrivals_are_sorted(name):
    workload = GENERATORS[name](3, low=40)
    tokens = [t for r in workload for t in r.prompt_token_ids]
    assert min(tokens) >= 40 and max(tokens) < VOCAB
    times = [r.arrival_time for r in workload]
    assert times == sorted(times) and times[0] == 0.0


def test_poisson_arrivals_have_the_asked_rate_and_start_at_zero():
    times = poisson_arrivals(20_000, 50.0, seed=1)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert (len(times) - 1) / times[-1] == pytest.approx(50.0, rel=0.05)
    np.testing.assert_array_equal(times, poisson_arrivals(20_000, 50.0, seed=1))


@pytest.mark.parametrize("rate", [None, math.inf])
def test_poisson_arrivals_without_a_rate_are_all_at_zero(rate):
    np.testing.assert_array_equal(poisson_arrivals(5, rate), np.zeros(5))


def test_chat_turns_extend_their_previous_turn_and_share_the_system_prompt():
    workload = shared_prefix_chat(
        4, 3, vocab_size=VOCAB, system_prompt_len=8, user_turn_len=3, output_len=2, rate=10.0,
        seed=0,
    )
    assert workload.num_requests == 12
    system = workload.requests[0].prompt_token_ids[:8]
    assert all(r.prompt_token_ids[:8] == system for r in workload)
    # Turn k has 8 + 3k + 2(k-1) tokens; each later turn extends exactly one earlier turn
    # of its conversation by that turn's reply (max_tokens) and a new user message.
    turn_of_length = {8 + 3 * k + 2 * (k - 1): k for k in (1, 2, 3)}
    turns = [turn_of_length[r.num_prompt_tokens] for r in workload]
    assert sorted(turns) == [1] * 4 + [2] * 4 + [3] * 4
    for i, request in enumerate(workload.requests):
        if turns[i] == 1:
            continue
        parents = [
            j for j in range(i)
            if turns[j] == turns[i] - 1
            and request.prompt_token_ids[: workload.requests[j].num_prompt_tokens]
            == workload.requests[j].prompt_token_ids
        ]
        assert len(parents) == 1, f"request {i} extends {parents}"
        assert workload.requests[parents[0]].max_tokens == 2


def test_few_shot_requests_are_a_template_plus_a_distinct_question():
    workload = few_shot(
        30, vocab_size=VOCAB, num_templates=3, template_len=20, question_len=5, seed=0
    )
    templates = {r.prompt_token_ids[:20] for r in workload}
    assert len(templates) == 3
    questions = [r.prompt_token_ids[20:] for r in workload]
    assert all(len(q) == 5 for q in questions)
    assert len(set(questions)) == len(questions)


def test_mixed_long_short_has_the_asked_proportion_and_lengths():
    workload = mixed_long_short(
        20, vocab_size=VOCAB, long_fraction=0.25, long_prompt_len=30, long_output_len=9,
        short_prompt_len=(2, 4), short_output_len=2, seed=0,
    )
    long = [r for r in workload if r.num_prompt_tokens == 30]
    short = [r for r in workload if r.num_prompt_tokens != 30]
    assert len(long) == 5 and all(r.max_tokens == 9 for r in long)
    assert all(2 <= r.num_prompt_tokens <= 4 and r.max_tokens == 2 for r in short)


def test_multi_tenant_heavy_user_sends_more_at_a_higher_rate():
    workload = multi_tenant(2000, vocab_size=VOCAB, heavy_share=0.8, rate=100.0, seed=0)
    frame = workload.to_pandas()
    counts = frame["user"].value_counts()
    assert set(workload.users) == {"heavy", "light"}
    assert counts["heavy"] == 1600 and counts["light"] == 400
    duration = workload.duration_s
    assert counts["heavy"] / duration == pytest.approx(80.0, rel=0.1)
    assert counts["light"] / duration == pytest.approx(20.0, rel=0.1)
    # Same length distributions for both users.
    means = frame.groupby("user")["num_prompt_tokens"].mean()
    assert means["heavy"] == pytest.approx(means["light"], rel=0.1)


def test_multi_tenant_leaves_the_light_user_at_least_one_request():
    workload = multi_tenant(2, vocab_size=VOCAB, heavy_share=0.9, heavy_user="a", light_user="b")
    assert sorted(r.user for r in workload) == ["a", "b"]


def test_bursts_arrive_in_groups_gap_apart_within_their_spread():
    workload = bursts(4, 5, vocab_size=VOCAB, gap_s=2.0, spread_s=0.25, prompt_len=(3, 6),
                      output_len=(7, 9), seed=1)
    times = np.array([r.arrival_time for r in workload])
    assert len(times) == 20
    groups = np.floor(times / 2.0).astype(int)
    assert np.bincount(groups).tolist() == [5, 5, 5, 5]
    assert (times - 2.0 * groups <= 0.25).all()
    assert all(3 <= r.num_prompt_tokens <= 6 and 7 <= r.max_tokens <= 9 for r in workload)
    at_once = bursts(2, 3, vocab_size=VOCAB, gap_s=1.0)
    assert [r.arrival_time for r in at_once] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]


def test_chain_plays_workloads_one_after_the_other_gap_apart():
    first = bursts(2, 2, vocab_size=VOCAB, gap_s=1.0, seed=0)
    second = GENERATORS["few_shot"](1)
    chained = chain(first, second, gap_s=0.5)
    assert len(chained) == len(first) + len(second)
    assert chained.name == "bursts+few_shot"
    times = [r.arrival_time for r in chained]
    assert times[:4] == [0.0, 0.0, 1.0, 1.0]
    assert times[4:] == pytest.approx([1.5 + r.arrival_time for r in second])
    assert [r.prompt_token_ids for r in chained] == [
        r.prompt_token_ids for r in (*first, *second)]
    with pytest.raises(ValueError, match="at least one"):
        chain()
    with pytest.raises(ValueError, match="gap_s"):
        chain(first, gap_s=-1.0)
    with pytest.raises(TypeError, match=r"workloads\[1\]"):
        chain(first, [1, 2])


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: few_shot(0, vocab_size=VOCAB), "num_requests"),
        (lambda: few_shot(3, vocab_size=VOCAB, rate=0), "rate"),
        (lambda: few_shot(3, vocab_size=VOCAB, rate=-2.0), "rate"),
        (lambda: few_shot(3, vocab_size=VOCAB, low=VOCAB), "low"),
        (lambda: few_shot(3, vocab_size=VOCAB, num_templates=0), "num_templates"),
        (lambda: few_shot(3, vocab_size=VOCAB, template_len=(5, 2)), "template_len"),
        (lambda: few_shot(3, vocab_size=VOCAB, question_len=(1, 2, 3)), "question_len"),
        (lambda: few_shot(3, vocab_size=VOCAB, seed=-1), "seed"),
        (lambda: few_shot(3, vocab_size=0), "vocab_size"),
        (lambda: shared_prefix_chat(2, 0, vocab_size=VOCAB), "num_turns"),
        (lambda: shared_prefix_chat(2, 2, vocab_size=VOCAB, output_len=0), "output_len"),
        (lambda: mixed_long_short(4, vocab_size=VOCAB, long_fraction=1.5), "long_fraction"),
        (lambda: multi_tenant(4, vocab_size=VOCAB, heavy_share=1.0), "heavy_share"),
        (lambda: multi_tenant(1, vocab_size=VOCAB), "num_requests"),
        (lambda: multi_tenant(4, vocab_size=VOCAB, light_user="heavy"), "heavy_user"),
        (lambda: poisson_arrivals(-1, 1.0), "n"),
        (lambda: bursts(0, 2, vocab_size=VOCAB), "num_bursts"),
        (lambda: bursts(2, 0, vocab_size=VOCAB), "burst_size"),
        (lambda: bursts(2, 2, vocab_size=VOCAB, gap_s=-1.0), "gap_s"),
        (lambda: bursts(2, 2, vocab_size=VOCAB, spread_s=-0.5), "spread_s"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(call, field):
    with pytest.raises(ValueError, match=field):
        call()


def test_wrong_argument_types_raise_type_error():
    with pytest.raises(TypeError, match="rate"):
        few_shot(3, vocab_size=VOCAB, rate="fast")
    with pytest.raises(TypeError, match="num_requests"):
        few_shot(2.5, vocab_size=VOCAB)


def test_workload_sorts_requests_by_arrival_keeping_ties_in_order():
    a = WorkloadRequest(1.0, (1, 2), 3, user="x")
    b = WorkloadRequest(0.0, (3,), 1)
    c = WorkloadRequest(1.0, (4,), 2, user="y")
    workload = Workload("w", [a, b, c])
    assert workload.requests == (b, a, c)
    assert workload.users == (None, "x", "y")
    assert workload.duration_s == 1.0
    assert workload.num_prompt_tokens == 4 and workload.num_output_tokens == 6
    assert list(workload.to_pandas().columns) == [
        "arrival_time", "num_prompt_tokens", "max_tokens", "user", "priority",
        "prompt_token_ids",
    ]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"arrival_time": -1.0, "prompt_token_ids": (1,), "max_tokens": 1}, ValueError),
        ({"arrival_time": 0.0, "prompt_token_ids": (), "max_tokens": 1}, ValueError),
        ({"arrival_time": 0.0, "prompt_token_ids": (1,), "max_tokens": 0}, ValueError),
        ({"arrival_time": 0.0, "prompt_token_ids": (-1,), "max_tokens": 1}, ValueError),
        ({"arrival_time": 0.0, "prompt_token_ids": (1,), "max_tokens": 1, "user": 3}, TypeError),
    ],
)
def test_workload_request_rejects_bad_fields(kwargs, error):
    with pytest.raises(error):
        WorkloadRequest(**kwargs)


def test_workload_rejects_items_that_are_not_requests():
    with pytest.raises(TypeError, match=r"requests\[0\]"):
        Workload("w", [(0.0, (1,), 1)])


# -- fairness_gap (pure; the compare tests run it on real events) --------------------------


def test_fairness_gap_is_the_largest_service_difference_over_co_backlogged_runs():
    service = [{"a": 4}, {"a": 4, "b": 1}, {"b": 4}, {"a": 9}, {"a": 1}, {"b": 3}]
    both = {"a", "b"}
    backlogged = [both, both, both, {"a"}, both, both]
    # Run 1 (steps 0-2): running difference a-b = 4, 7, 3 -> largest |interval| = 7 - 0.
    # Step 3 breaks the run (b idle), so a's 9 tokens there do not count.
    # Run 2 (steps 4-5): 1, -2 -> 1 - (-2) = 3.
    assert fairness_gap(service, backlogged) == 7.0


def test_fairness_gap_is_zero_when_users_never_overlap_and_nan_for_one_user():
    assert fairness_gap([{"a": 5}, {"b": 5}], [{"a"}, {"b"}]) == 0.0
    assert math.isnan(fairness_gap([{"a": 5}], [{"a"}]))
    with pytest.raises(ValueError, match="aligned"):
        fairness_gap([{"a": 1}], [])


def test_the_streaming_fairness_meter_equals_fairness_gap_on_random_histories():
    """A long simulation keeps no per-step history: the meter must give the same gap."""
    from llmlab.experiments.metrics import FairnessMeter

    rng = np.random.default_rng(0)
    for _ in range(300):
        users = [f"u{i}" for i in range(int(rng.integers(1, 5)))] + [None]
        service, backlogged = [], []
        for _ in range(int(rng.integers(0, 40))):
            backlogged.append(frozenset(u for u in users if rng.random() < 0.6))
            service.append({u: int(rng.integers(0, 20)) for u in users if rng.random() < 0.7})
        meter = FairnessMeter()
        for served, backlog in zip(service, backlogged, strict=True):
            meter.step(served, backlog)
        expected = fairness_gap(service, backlogged)
        assert meter.value() == expected or (math.isnan(expected) and math.isnan(meter.value()))
