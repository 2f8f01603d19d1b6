"""``compare`` with routers: data-parallel configurations on real replica processes and,
the same configurations, in simulation (``simulate(replicas=N)``), with the table of one
engine; bad router settings refused before anything runs."""

from __future__ import annotations

import importlib
import json
import pathlib

import attrs
import pytest

from llmlab.experiments import Workload, WorkloadRequest, compare, shared_prefix_chat
from llmlab.routing.policies import PrefixAware

compare_module = importlib.import_module("llmlab.experiments.comparison")

# Two sequences per replica, small blocks (prefix hits), one CPU thread per replica process;
# an exact KV pool (num_gpu_blocks_override), so replicas on a GPU take no share of it.
ENGINE = {
    "dtype": "float32",
    "seed": 0,
    "block_size": 4,
    "max_num_seqs": 2,
    "max_model_len": 64,
    "num_gpu_blocks_override": 32,
    "async_scheduling": False,  # the simulator replays a synchronous engine's decisions
}
REAL = {**ENGINE, "cpu_threads": 1}
# Every configuration routes with its own router; prefix_aware as an instance (copied for
# each run) with chunks small enough for these short prompts.
CONFIGS = {
    "round_robin": {"data_parallel_size": 2, "router": "round_robin"},
    "prefix_aware": {"data_parallel_size": 2, "router": PrefixAware(chunk_tokens=4)},
}


@attrs.define
class Fixed:
    """A simulated step costs ``per_step + per_token * tokens``."""

    per_step: float = 0.002
    per_token: float = 1e-4
    name: str = "fixed"

    def step_time(self, shape) -> float:
        return self.per_step + self.per_token * shape.num_tokens


def vocab_size(model: str) -> int:
    return json.loads((pathlib.Path(model) / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def chats(tiny_llama) -> Workload:
    # Everything arrives at t=0 (rate=None): each router places every request before any
    # replica reports, so its choices depend on the requests alone, real or simulated.
    return shared_prefix_chat(3, 3, vocab_size=vocab_size(tiny_llama), system_prompt_len=12,
                              user_turn_len=4, output_len=3, seed=0, low=2)


@pytest.fixture(scope="module")
def real(tiny_llama, chats):
    return compare(chats, CONFIGS, model=tiny_llama, engine_kwargs=REAL, progress=False)


@pytest.fixture(scope="module")
def simulated(tiny_llama, chats):
    return compare(chats, CONFIGS, model=tiny_llama, engine_kwargs={**ENGINE,
                   "cost_model": Fixed()}, progress=False, executor="sim")


def test_a_router_comparison_runs_on_data_parallel_replicas(real, chats):
    table, requests = real.table, real.requests
    assert list(table.index) == list(CONFIGS)
    assert table["router"].to_dict() == {label: label for label in CONFIGS}
    assert (table["scheduling_policy"] == "fcfs").all()  # the replicas' own, by name
    assert (table["num_requests"] == chats.num_requests).all()
    assert (table["num_output_tokens"] == chats.num_output_tokens).all()
    for column in ("ttft_mean_s", "tpot_mean_s", "e2e_mean_s", "output_tokens_per_s",
                   "ttft_mean_steps", "kv_blocks_mean"):
        assert (table[column] > 0).all(), column
    want = [r.max_tokens for r in chats]
    for label in CONFIGS:
        rows = requests[requests["label"] == label]
        assert list(rows["request_id"]) == [str(i) for i in range(chats.num_requests)]
        assert list(rows["num_output_tokens"]) == want
        assert (rows["finish_reason"] == "length").all()
        # Each request's steps are its own replica's: their mean is the row's.
        assert rows["ttft_steps"].mean() == pytest.approx(table.loc[label, "ttft_mean_steps"])
    spread = requests[requests["label"] == "round_robin"]["replica"]
    assert list(spread) == [i % 2 for i in range(chats.num_requests)]
    # Greedy decoding gives each request the same tokens whichever replica served it.
    tokens = {label: list(requests[requests["label"] == label]["output_token_ids"])
              for label in CONFIGS}
    assert tokens["round_robin"] == tokens["prefix_aware"]
    # Both replicas' events, in order of their end (each counts its own steps from 0).
    events = real.events["round_robin"]
    assert [e.end_time_s for e in events] == sorted(e.end_time_s for e in events)
    assert len({e.step_index for e in events}) < len(events)


def test_the_same_router_configurations_run_in_simulation(real, simulated, chats):
    assert list(simulated.table.columns) == list(real.table.columns)
    assert list(simulated.requests.columns) == list(real.requests.columns)
    assert simulated.table["router"].to_dict() == {label: label for label in CONFIGS}
    assert (simulated.table["num_output_tokens"] == chats.num_output_tokens).all()
    # The routers saw the same requests in the same state: the same replica for each.
    assert list(simulated.requests["replica"]) == list(real.requests["replica"])
    assert set(simulated.requests["replica"]) == {0, 1}
    # Keeping a conversation on one replica pays off in prefix hits.
    hit = simulated.table["prefix_hit_rate"]
    assert hit["prefix_aware"] > hit["round_robin"]


def test_router_comparisons_repeat_with_a_spread_and_fresh_routers(tiny_llama, chats):
    """repeats=2 on the simulator: every run's row kept, the spread columns beside the
    means (0: a simulation is deterministic), and the router instance copied for each run
    (the one given never routes anything)."""
    router = CONFIGS["prefix_aware"]["router"]
    result = compare(chats, CONFIGS, model=tiny_llama, engine_kwargs={
        **ENGINE, "cost_model": Fixed()}, progress=False, executor="sim", repeats=2)
    assert list(result.runs["label"]) == ["round_robin", "prefix_aware"] * 2
    assert (result.table["ttft_mean_s_std"] == 0).all()
    assert (result.table["num_requests"] == chats.num_requests).all()
    assert result.table["router"].to_dict() == {label: label for label in CONFIGS}
    assert router is CONFIGS["prefix_aware"]["router"] and not router._sent


def test_a_simulated_router_rows_merge_the_replicas_traces(tiny_llama, chats):
    import pandas as pd

    from llmlab.sim import simulate

    result = simulate(chats, model=tiny_llama, replicas=2, router="round_robin",
                      cost_model=Fixed(), progress=False, **ENGINE)
    replicas = result.table.drop(index="overall")
    overall = result.overall
    assert overall["router"] == "round_robin"
    for column in ("prefill_tokens", "served[None]", "num_output_tokens"):
        assert overall[column] == replicas[column].sum() > 0, column
    assert overall["kv_blocks_peak"] == replicas["kv_blocks_peak"].max() > 0
    assert 1 <= overall["ttft_mean_steps"] <= replicas["ttft_mean_steps"].max()
    row = compare(chats, {"rr": {"data_parallel_size": 2}}, model=tiny_llama,
                  engine_kwargs={**ENGINE, "cost_model": Fixed()}, progress=False,
                  executor="sim").table.loc["rr"]
    assert row["router"] == "round_robin"  # the default router
    pd.testing.assert_series_equal(row[result.table.columns], overall, check_names=False,
                                   check_dtype=False)


# -- bad input: refused before any engine is built ------------------------------------------


@pytest.fixture
def no_engines(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("an engine was built although the input was invalid")

    monkeypatch.setattr(compare_module, "_build", fail)
    monkeypatch.setattr("llmlab.sim.run.simulate", fail)


TINY = Workload("tiny", [WorkloadRequest(0.0, (5, 6, 7), 2)])


@pytest.mark.parametrize("executor", ["engine", "sim"])
@pytest.mark.parametrize(
    "configs, engine_kwargs, message",
    [
        ({"ok": {}, "rr": {"router": "round_robin"}}, None,
         r"configs\['rr'\] sets router='round_robin' with data_parallel_size=1.*"
         r"needs data_parallel_size > 1"),
        ({"x": {"router": "prefix_aware"}}, {"data_parallel_size": 1},
         "needs data_parallel_size > 1"),
        ({"x": {"data_parallel_size": 2, "router": "nearest"}}, None,
         "unknown router 'nearest'; available: .*round_robin"),
        ({"x": {"data_parallel_size": 2}}, {"router": "nearest"}, "unknown router 'nearest'"),
    ],
)
def test_bad_router_settings_raise_before_running(tiny_llama, no_engines, executor, configs,
                                                  engine_kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare(TINY, configs, model=tiny_llama, engine_kwargs=engine_kwargs,
                progress=False, executor=executor)


def test_a_factory_returning_something_else_names_what_it_may_return():
    with pytest.raises(TypeError, match="an Engine, a DataParallelEngine, or an LLM around "
                                        "either; got str"):
        compare(TINY, {"x": {}}, model=lambda **kwargs: "an engine", progress=False)

