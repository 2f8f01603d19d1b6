"""``compare`` on the real engine: one row per configuration with sane metrics, the same
greedy tokens everywhere, prefix hits only with prefix caching, per-user service that adds
up, clean failure on bad input, and nothing left in the engine after an interrupt."""

from __future__ import annotations

import importlib
import json
import math
import pathlib

import pytest

from llmlab import LLM
from llmlab.runner.executor import VirtualClock
from llmlab.experiments import (
    KEY_METRICS,
    Comparison,
    Workload,
    WorkloadRequest,
    compare,
    multi_tenant,
    run_workload,
    shared_prefix_chat,
)

# The package's ``compare`` attribute is the function, which hides the module of that name.
compare_module = importlib.import_module("llmlab.experiments.comparison")

# Small enough to run in well under a second per configuration on a 2-core CPU; a small KV
# cache (24 blocks of 4 tokens) and two sequences at a time, so later requests are admitted
# after earlier ones registered their blocks (prefix hits) and eviction has work to do.
ENGINE = {
    "dtype": "float32",
    "block_size": 4,
    "max_num_seqs": 2,
    "max_model_len": 64,
    "num_gpu_blocks_override": 24,
}

CHAT_CONFIGS = {
    "fcfs+lru": {"scheduling_policy": "fcfs", "eviction_policy": "lru"},
    "fcfs+fifo": {"scheduling_policy": "fcfs", "eviction_policy": "fifo"},
    "fcfs+random": {"scheduling_policy": "fcfs", "eviction_policy": "random"},
    "no prefix cache": {"scheduling_policy": "fcfs", "enable_prefix_caching": False},
}

METRICS = [
    "scheduling_policy", "eviction_policy", "kv_press", "proposer", "router", "num_requests", "num_output_tokens", "makespan_s",
    "output_tokens_per_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s",
    "e2e_mean_s", "prefix_hit_rate", "num_preemptions", "fairness_gap_tokens",
    "ttft_mean_steps", "e2e_mean_steps", "prefill_tokens", "recomputed_tokens",
    "kv_blocks_peak", "kv_blocks_mean",
]


def vocab_size(model: str) -> int:
    return json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def chat(tiny_llama):
    # rate=None: everything arrives at t=0, so the run's step structure is deterministic.
    workload = shared_prefix_chat(
        3, 3, vocab_size=vocab_size(tiny_llama), system_prompt_len=12, user_turn_len=3,
        output_len=3, seed=0,
    )
    result = compare(workload, CHAT_CONFIGS, model=tiny_llama, engine_kwargs=ENGINE,
                     progress=False)
    return workload, result


@pytest.fixture(scope="module")
def tenants(tiny_llama):
    workload = multi_tenant(
        10, vocab_size=vocab_size(tiny_llama), prompt_len=(4, 10), output_len=(2, 4), seed=0
    )
    configs = [  # the list form, through a factory (as a simulator would plug in)
        {"label": "lru", "scheduling_policy": "fcfs", "eviction_policy": "lru"},
        {"label": "fifo", "scheduling_policy": "fcfs", "eviction_policy": "fifo"},
    ]
    result = compare(
        workload, configs, model=lambda **kw: LLM(tiny_llama, **kw), engine_kwargs=ENGINE,
        progress=True,
    )
    return workload, result


def test_compare_gives_one_row_per_configuration_with_every_metric(chat):
    _, result = chat
    assert isinstance(result, Comparison)
    assert list(result.table.index) == list(CHAT_CONFIGS)
    assert list(result.table.columns) == METRICS + ["served[None]"]
    assert list(result.table["scheduling_policy"]) == ["fcfs"] * 4
    assert list(result.table["eviction_policy"]) == ["lru", "fifo", "random", "lru"]
    assert set(result.events) == set(CHAT_CONFIGS)


def test_compare_metrics_are_sane(chat):
    workload, result = chat
    table = result.table
    assert (table["num_requests"] == workload.num_requests).all()
    assert (table["num_output_tokens"] == workload.num_output_tokens).all()
    assert table["prefix_hit_rate"].between(0, 1).all()
    assert (table["output_tokens_per_s"] > 0).all()
    assert (table["ttft_mean_s"] > 0).all() and (table["tpot_mean_s"] > 0).all()
    assert (table["ttft_p50_s"] <= table["ttft_p99_s"]).all()
    assert (table["e2e_mean_s"] >= table["ttft_mean_s"]).all()
    assert (table["num_preemptions"] >= 0).all()
    assert table["fairness_gap_tokens"].isna().all()  # one user (None): no pair to compare
    # The machine-independent columns.
    assert (table["ttft_mean_steps"] >= 1).all()
    assert (table["e2e_mean_steps"] >= table["ttft_mean_steps"] + 2).all()  # 3 tokens each
    uncached = workload.num_prompt_tokens * (1 - table["prefix_hit_rate"])
    extra = (table["prefill_tokens"] - table["recomputed_tokens"] - uncached).round()
    assert extra.between(0, table["num_preemptions"]).all()  # see the preemption test
    assert (table["recomputed_tokens"] > 0).eq(table["num_preemptions"] > 0).all()
    assert (table["kv_blocks_peak"] <= ENGINE["num_gpu_blocks_override"]).all()
    assert (table["kv_blocks_mean"] <= table["kv_blocks_peak"]).all()

    requests = result.requests
    assert len(requests) == workload.num_requests * len(CHAT_CONFIGS)
    assert (requests["finish_reason"] == "length").all()
    assert (requests["num_output_tokens"] == requests["max_tokens"]).all()
    assert (requests["first_token_s"] >= requests["arrival_s"]).all()
    # Per request, the same step counts whose means the table gives.
    means = requests.groupby("label")[["ttft_steps", "e2e_steps"]].mean()
    assert means["ttft_steps"].to_dict() == pytest.approx(table["ttft_mean_steps"].to_dict())
    assert means["e2e_steps"].to_dict() == pytest.approx(table["e2e_mean_steps"].to_dict())
    assert (requests["e2e_steps"] >= requests["ttft_steps"] + 2).all()
    assert (requests["finish_s"] >= requests["first_token_s"]).all()


def test_every_configuration_produces_the_same_greedy_tokens(chat):
    _, result = chat
    tokens = result.requests.groupby("label", sort=False)["output_token_ids"].apply(list)
    assert all(t == tokens.iloc[0] for t in tokens)


def test_shared_prefixes_hit_only_with_prefix_caching(chat):
    _, result = chat
    hit_rate = result.table["prefix_hit_rate"]
    assert (hit_rate.drop("no prefix cache") > 0).all()
    assert hit_rate["no prefix cache"] == 0


def test_served_tokens_add_up_to_the_scheduled_tokens(chat, tenants):
    for _, result in (chat, tenants):
        for label, events in result.events.items():
            scheduled = sum(n for e in events for _, n in e.scheduled)
            served = result.table.loc[label].filter(like="served[").sum()
            assert served == scheduled


def test_multi_tenant_rows_have_per_user_service_and_a_fairness_gap(tenants):
    _, result = tenants
    table = result.table
    assert list(table.index) == ["lru", "fifo"]
    assert (table["served[heavy]"] > table["served[light]"]).all()
    assert (table["fairness_gap_tokens"] >= 0).all()
    assert (table["fairness_gap_tokens"] <= table["served[heavy]"]).all()
    per_user = result.requests.groupby(["label", "user"]).size()
    assert per_user["lru", "heavy"] == 8 and per_user["lru", "light"] == 2


def test_figure_and_html_show_every_configuration(chat, tenants):
    from matplotlib.figure import Figure

    for _, result in (chat, tenants):
        figure = result.figure()
        assert isinstance(figure, Figure)
        titles = [ax.get_title() for ax in figure.axes if ax.get_visible()]
        # Every key metric with a value in some run, in order (an all-NaN one is left out).
        shown = [t for m, t in KEY_METRICS if result.table[m].astype(float).notna().any()]
        assert [t for t in titles if t != "tokens served per user"] == shown
        html = result._repr_html_()
        assert all(label in html for label in result.table.index)
    assert "tokens served per user" in [ax.get_title() for ax in tenants[1].figure().axes]
    single_user = chat[1].table
    assert single_user["fairness_gap_tokens"].isna().all()
    assert "fairness gap (tokens)" not in [ax.get_title() for ax in chat[1].figure().axes]


def test_figure_rejects_a_metric_the_table_lacks(chat):
    with pytest.raises(ValueError, match="nonsense"):
        chat[1].figure(["nonsense"])


# -- bad input: rejected before any engine is built ----------------------------------------


@pytest.fixture
def no_engines(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("an engine was built although the input was invalid")

    monkeypatch.setattr(compare_module, "_build", fail)


TINY = Workload("tiny", [WorkloadRequest(0.0, (5, 6, 7), 2)])


@pytest.mark.parametrize(
    "configs, engine_kwargs, message",
    [
        ({"ok": {}, "bad": {"eviction": "lru"}}, None, r"configs\['bad'\].*'eviction'"),
        ({"ok": {}}, {"dtpye": "float32"}, r"engine_kwargs.*'dtpye'"),
        ({}, None, "configs is empty"),
        ([], None, "configs is empty"),
        ([{"label": "a"}, {"label": "a"}], None, "used twice"),
        ([{"scheduling_policy": "fcfs"}], None, "'label'"),
        ({"x": {"scheduling_policy": "no-such-policy"}}, None, "available: .*fcfs"),
        ({"x": {"eviction_policy": "no-such-eviction"}}, None, "available: .*lru"),
        ({"x": {"block_size": 0}}, None, "block_size"),
    ],
)
def test_bad_configurations_raise_value_error_before_running(
    tiny_llama, no_engines, configs, engine_kwargs, message
):
    with pytest.raises(ValueError, match=message):
        compare(TINY, configs, model=tiny_llama, engine_kwargs=engine_kwargs, progress=False)


def test_an_empty_workload_is_rejected(tiny_llama, no_engines):
    with pytest.raises(ValueError, match="no requests"):
        compare(Workload("empty", []), {"x": {}}, model=tiny_llama, progress=False)


# -- the run loop ---------------------------------------------------------------------------


def test_an_interrupted_run_leaves_nothing_in_the_engine(tiny_llama):
    engine = LLM(tiny_llama, **ENGINE).llm_engine
    workload = shared_prefix_chat(2, 2, vocab_size=vocab_size(tiny_llama),
                                  system_prompt_len=8, user_turn_len=2, output_len=4)
    events = []

    def interrupt_on_third_step(event):  # Ctrl-C lands inside a step
        events.append(event)
        if len(events) == 3:
            raise KeyboardInterrupt

    engine.subscribe(interrupt_on_third_step)
    with pytest.raises(KeyboardInterrupt):
        run_workload(engine, workload)
    assert engine.observers == [interrupt_on_third_step]  # run_workload's own one is gone
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.usage == 0


def test_waiting_for_an_arrival_advances_a_virtual_clock_instead_of_sleeping(tiny_llama):
    engine = LLM(tiny_llama, **ENGINE).llm_engine
    engine.clock = VirtualClock()
    workload = Workload("far apart", [
        WorkloadRequest(0.0, (5, 6, 7), 2),
        WorkloadRequest(3600.0, (8, 9), 2),  # an hour later: a real sleep would hang here
    ])
    records, trace = run_workload(engine, workload)
    assert [r.arrival_s for r in records] == [0.0, 3600.0]
    assert records[1].first_token_s == records[1].finish_s == 3600.0
    assert all(r.num_output_tokens == 2 for r in records)
    assert not math.isnan(records[0].finish_s) and trace.events


def test_run_workload_refuses_an_engine_that_is_already_busy(tiny_llama):
    engine = LLM(tiny_llama, **ENGINE).llm_engine
    engine.add_request("mine", {"prompt_token_ids": [5, 6, 7]})
    with pytest.raises(ValueError, match="1 unfinished request"):
        run_workload(engine, TINY)
    assert engine.has_request("mine")


def test_a_stateful_instance_reused_across_comparisons_runs_fresh_each_time(chat, tiny_llama):
    """The same eviction-policy instance in a configuration, in two ``compare`` calls (the
    second used to get the first engine's block ids back from it): each run gets a copy,
    the instance given stays unused, and the tables agree."""
    from llmlab.cache.eviction import LRUEviction as LRU

    workload, _ = chat
    lru = LRU()
    configs = {"lru instance": {"scheduling_policy": "fcfs", "eviction_policy": lru}}
    first = compare(workload, configs, model=tiny_llama, engine_kwargs=ENGINE, progress=False)
    second = compare(workload, configs, model=tiny_llama, engine_kwargs=ENGINE, progress=False)
    columns = ["num_output_tokens", "prefix_hit_rate", "num_preemptions"]
    assert first.table[columns].equals(second.table[columns])
    LLM(tiny_llama, eviction_policy=lru, **ENGINE)  # never claimed by an engine


def test_recomputed_tokens_are_the_prefill_a_preemption_repeats(chat, tiny_llama):
    """In a pool too small for the batch, a preempted request computes part of its context
    again: prefill tokens = the prompts' uncached tokens + those recomputed + at most one
    per preemption (a resumed request's last sampled token, computed for the first time in
    its re-prefill)."""
    workload, _ = chat
    tight = {"tight": {"num_gpu_blocks_override": 16, "max_num_seqs": 4}}
    table = compare(workload, tight, model=tiny_llama, engine_kwargs=ENGINE,
                    progress=False).table.loc["tight"]
    assert table["num_preemptions"] > 0 and table["recomputed_tokens"] > 0
    uncached = workload.num_prompt_tokens * (1 - table["prefix_hit_rate"])
    extra = round(table["prefill_tokens"] - table["recomputed_tokens"] - uncached)
    assert 0 <= extra <= table["num_preemptions"]


def test_rows_name_their_press_and_proposer(chat, tiny_llama):
    workload, _ = chat
    configs = {
        "press": {"kv_press": "streaming_llm", "kv_press_config": {"compression_ratio": 0.5}},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    }
    table = compare(workload, configs, model=tiny_llama, engine_kwargs=ENGINE,
                    progress=False).table
    assert table.loc["press", "kv_press"] and table.loc["press", "proposer"] == ""
    assert table.loc["ngram", "proposer"] and table.loc["ngram", "kv_press"] == ""
    assert (table["router"] == "").all()  # one engine, no router


def test_repeats_run_interleaved_and_give_means_spreads_and_overlaps(chat, tiny_llama,
                                                                    monkeypatch):
    workload, _ = chat
    configs = {"lru": {"eviction_policy": "lru"}, "fifo": {"eviction_policy": "fifo"}}
    order = []
    build = compare_module._build
    monkeypatch.setattr(compare_module, "_build",
                        lambda model, merged, sim: order.append(merged["eviction_policy"])
                        or build(model, merged, sim))
    result = compare(workload, configs, model=tiny_llama, engine_kwargs=ENGINE,
                     progress=False, repeats=3)
    assert order == ["lru", "fifo"] * 3  # A B A B A B
    runs = result.runs
    assert list(runs["repeat"]) == [0, 0, 1, 1, 2, 2] and len(runs) == 6
    table = result.table
    assert list(table.index) == ["lru", "fifo"] and (table["num_runs"] == 3).all()
    for m in ("ttft_mean_s", "ttft_mean_steps", "output_tokens_per_s"):
        by_label = runs.groupby("label")[m]
        assert table[m].to_dict() == pytest.approx(by_label.mean().to_dict())
        assert table[f"{m}_std"].to_dict() == pytest.approx(by_label.std().to_dict())
        # 3 runs: t(0.975, 2) = 4.303
        assert table[f"{m}_ci95"].to_dict() == pytest.approx(
            (by_label.std() * 4.303 / 3 ** 0.5).to_dict())
    # The same scheduling decisions every run: step-based metrics do not spread at all.
    assert (table["ttft_mean_steps_std"] == 0).all()
    # Overlap markers are symmetric.
    for a, b in (("lru", "fifo"), ("fifo", "lru")):
        assert (b in table.loc[a, "ttft_mean_s_overlaps"]) == (
            a in table.loc[b, "ttft_mean_s_overlaps"])
    assert set(result.requests["repeat"]) == {0, 1, 2}
    result.figure(["ttft_mean_s"])  # error bars drawn from the _ci95 column
    with pytest.raises(ValueError, match="repeats must be an integer >= 1, got 0"):
        compare(workload, configs, model=tiny_llama, repeats=0)
