"""Data parallelism: N engine replicas in N processes behind one routing front end.

The replicas are spawned processes (each imports torch and builds the tiny model: a few
seconds), so the tests share one two-replica ``LLM`` where they can, and swap its router
rather than start new replicas. Tests that kill replicas start engines of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from llmlab import LLM, SamplingParams, registry
from llmlab.distributed.data_parallel import (
    DataParallelEngine,
    ReplicaFailedError,
    ReplicasDeadError,
    resolve_router,
)
from llmlab.distributed.replica_handle import plan_devices
from llmlab.routing.policies import PrefixAware
from tests.helpers import builtin_names, subprocess_env

SETTINGS = {"dtype": "float32", "seed": 0, "cpu_threads": 1, "max_model_len": 256}
if torch.cuda.is_available():
    # Replicas are processes of their own: tests/conftest.py's cap on each engine's share of
    # the GPU does not reach them, and at gpu_memory_utilization's default each pair would
    # take 90% of the card from the other pytest workers (seen on an H100).
    SETTINGS["kv_cache_memory_bytes"] = 64 << 20
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [f"the {i} quick brown fox " * (1 + i % 3) for i in range(8)]


def replica_children() -> list[psutil.Process]:
    """This process's live descendants, without multiprocessing's resource tracker (one
    per process, started by the first spawn, living until exit)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if "resource_tracker" in " ".join(child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(child)
    return found


def _alive(pid: int) -> bool:
    # A killed process shows as a zombie while its threads still exit: it is gone for
    # these tests' purposes, though not yet reapable.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"processes {pids} are still alive"
        time.sleep(0.1)


class Pick:
    """A router that always picks one replica."""

    def __init__(self, replica: int) -> None:
        self.replica = replica

    def route(self, request, replicas):
        return self.replica


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(tiny_llama, **SETTINGS)


@pytest.fixture(scope="module")
def dp_llm(tiny_llama):
    llm = LLM(tiny_llama, data_parallel_size=2, **SETTINGS)
    yield llm
    pids = [s.pid for s in llm.llm_engine.health()]
    llm.llm_engine.shutdown()
    wait_gone(pids)


@pytest.fixture
def arrivals(dp_llm):
    """``{replica: [(request id, n), ...]}`` of the requests each replica received."""
    engine = dp_llm.llm_engine
    seen: dict[int, list] = {0: [], 1: []}

    def observe(index, event):
        seen[index].extend((a.request_id, a.n) for a in event.arrived)

    engine.subscribe(observe, replica=True)
    yield seen
    engine.unsubscribe(observe)
    engine.router = resolve_router("round_robin")


def test_greedy_outputs_equal_one_engines_in_prompt_order(dp_llm, reference):
    got = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in got] == PROMPTS
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert isinstance(dp_llm.llm_engine, DataParallelEngine)
    assert dp_llm.llm_engine.config.data_parallel_size == 2
    assert not dp_llm.llm_engine.has_unfinished_requests()
    # Each replica's process serves its engine for life: its startup heap is frozen out of
    # the garbage collector's full passes (llmlab.utils.gc_heap).
    assert all(r.info.gc_frozen > 1000 for r in dp_llm.llm_engine.replicas)


def test_engine_core_process_runs_the_one_engine_in_its_own_process(tiny_llama, reference):
    """``engine_core_process=True``: one engine, in a process of its own (a one-replica
    front end), the same tokens as in-process; its process ends with the engine."""
    llm = LLM(tiny_llama, engine_core_process=True, **SETTINGS)
    engine = llm.llm_engine
    assert isinstance(engine, DataParallelEngine) and len(engine.health()) == 1
    pids = [s.pid for s in engine.health()]
    assert os.getpid() not in pids
    try:
        got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    finally:
        engine.shutdown()
    wait_gone(pids)


def test_round_robin_spreads_requests_over_both_replicas(dp_llm, arrivals):
    dp_llm.generate(PROMPTS[:6], GREEDY, use_tqdm=False)
    assert len(arrivals[0]) == len(arrivals[1]) == 3


@pytest.mark.parametrize("name", builtin_names("router"))
def test_every_router_routes_to_live_replicas_and_answers_correctly(
    dp_llm, reference, arrivals, name
):
    dp_llm.llm_engine.router = resolve_router(name)
    got = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False, user=["u"] * 4 + ["v"] * 4)
    want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(arrivals[0]) + len(arrivals[1]) == len(PROMPTS)
    if name in ("round_robin", "least_loaded"):
        assert arrivals[0] and arrivals[1]  # spread, not all on one


def test_prefix_aware_sends_a_follow_up_to_the_replica_holding_its_prefix(dp_llm, arrivals):
    engine = dp_llm.llm_engine
    tokenizer = dp_llm.get_tokenizer()
    for holder, topic in ((1, "cats and dogs"), (0, "ships at sea")):
        engine.router = Pick(holder)
        prompt = tokenizer.encode(f"a long conversation about {topic} " * 8)
        first = dp_llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
        assert [len(arrivals[i]) for i in (holder, 1 - holder)] == [1, 0]
        follow_up = prompt + first.outputs[0].token_ids + tokenizer.encode(" and then?")
        # the front end's shadow of each replica's prefix index, fed by its step events
        assert engine.replicas[holder].cached_prefix_tokens(follow_up) >= 3 * 16
        assert engine.replicas[1 - holder].cached_prefix_tokens(follow_up) == 0
        # A fresh router remembers nothing it sent (and on a tie would pick replica 0):
        # only the shadowed caches can say where the prefix is.
        engine.router = PrefixAware()
        dp_llm.generate([{"prompt_token_ids": follow_up}], GREEDY, use_tqdm=False)
        assert [len(arrivals[i]) for i in (holder, 1 - holder)] == [2, 0]
        arrivals[0].clear()
        arrivals[1].clear()


def test_the_prefix_shadow_follows_the_real_index_through_evictions(tiny_llama):
    """What the front end mirrors of a replica's prefix index, fed the events and hashes a
    replica sends, answers exactly as a probe of the real index, after every step of a
    run whose small cache evicts all the time (in-process: no replica needed)."""
    from llmlab.distributed.remote_replica import PromptHashes, RemoteReplica
    from llmlab.distributed.replica_process import ReplicaInfo, cached_block_hashes
    from llmlab.routing.replica import EngineReplica

    class Alive:
        def is_alive(self):
            return True

    llm = LLM(tiny_llama, block_size=4, num_gpu_blocks_override=24, max_num_seqs=4,
              **{**SETTINGS, "max_model_len": 32})
    engine = llm.llm_engine
    kv = engine.kv_cache
    info = ReplicaInfo(0, engine.config, engine.vocab_size, engine.max_model_len,
                       engine.eos_token_ids, engine.default_sampling_params, 20, 4,
                       kv.block_size, kv.num_blocks, True)
    shadow = RemoteReplica(0, Alive(), info, PromptHashes())
    truth = EngineReplica(0, engine)
    engine.subscribe(lambda event: shadow.follow(event, cached_block_hashes(engine, event)))
    evicted = []
    engine.subscribe(lambda event: evicted.extend(event.blocks_evicted))
    heads = [[7 + k] * 9 for k in range(5)]  # five prefixes of two full blocks and a bit
    prompts = [heads[i % 5] + [50 + i] * (1 + i % 5) for i in range(20)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
        for probe in prompts + heads:
            assert shadow.cached_prefix_tokens(probe) == truth.cached_prefix_tokens(probe)
    assert evicted  # the cache was small enough to evict
    assert any(shadow.cached_prefix_tokens(p) for p in prompts)


def test_a_request_with_n_samples_goes_whole_to_one_replica(dp_llm, arrivals):
    out = dp_llm.generate(["Hello"], SamplingParams(n=3, max_tokens=5, seed=7),
                          use_tqdm=False)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    on = [i for i in (0, 1) if arrivals[i]]
    assert len(on) == 1 and arrivals[on[0]] == [(out.request_id, 3)]


def test_bad_input_is_refused_at_the_front_end_and_nothing_is_sent(dp_llm):
    engine = dp_llm.llm_engine
    sent = [r.commands_sent for r in engine.replicas]
    with pytest.raises(ValueError, match="max_model_len"):
        dp_llm.generate([{"prompt_token_ids": [5] * 300}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        dp_llm.generate(["Hi"], SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        dp_llm.generate(["Hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        dp_llm.generate(["Hi"], SamplingParams(temperature=-1.0), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot be sent to a replica"):
        dp_llm.generate(["Hi"], SamplingParams(logits_processors=[lambda ids, x: x]),
                        use_tqdm=False)
    assert [r.commands_sent for r in engine.replicas] == sent
    assert not engine.has_unfinished_requests()


def test_abort_stops_a_request_and_no_output_of_it_comes_back(dp_llm):
    engine = dp_llm.llm_engine
    engine.add_request("long", "Go on", SamplingParams(max_tokens=200, ignore_eos=True))
    assert engine.has_request("long")
    while not any(o.request_id == "long" for o in engine.step()):
        pass
    engine.abort_request("long")
    assert not engine.has_request("long")
    deadline = time.monotonic() + 20
    while engine.has_unfinished_requests():  # the replica answers the abort
        assert all(o.request_id != "long" for o in engine.step())
        assert time.monotonic() < deadline
    assert all(r.outstanding_tokens == 0 for r in engine.replicas)


def test_a_bad_router_name_is_a_value_error_listing_the_names(tiny_llama):
    before = replica_children()
    with pytest.raises(ValueError) as info:
        LLM(tiny_llama, data_parallel_size=2, router="nope", **SETTINGS)
    for name in registry.available("router"):
        assert name in str(info.value)
    with pytest.raises(TypeError, match="route"):
        LLM(tiny_llama, data_parallel_size=2, router=object(), **SETTINGS)
    assert len(replica_children()) == len(before)  # refused before starting anything


def test_an_unpicklable_component_instance_is_a_value_error_naming_it(tiny_llama):
    class Local:  # a local class cannot be pickled
        pass

    with pytest.raises(ValueError, match="scheduling_policy=.*picklable"):
        LLM(tiny_llama, data_parallel_size=2, scheduling_policy=Local(), **SETTINGS)


def test_devices_are_planned_per_replica_and_shared_when_too_few():
    plan = plan_devices("auto", 2, 1, 0.9, num_gpus=4)
    assert plan.visible_devices == ("0", "1") and plan.gpu_memory_utilization == (0.9, 0.9)
    plan = plan_devices("cuda", 2, 2, 0.9, num_gpus=4, visible=["4", "5", "6", "7"])
    assert plan.visible_devices == ("4,5", "6,7")
    plan = plan_devices("auto", 4, 1, 0.8, num_gpus=2)
    assert plan.visible_devices == ("0", "1", "0", "1")
    # sharers split the device and start in turn: the second's budget counts the first's
    assert plan.waves == (0, 0, 1, 1)
    assert plan.gpu_memory_utilization == pytest.approx((0.4, 0.4, 0.8, 0.8))
    plan = plan_devices("cuda:1", 2, 1, 0.8, num_gpus=2)
    assert plan.visible_devices == ("1", "1") and plan.waves == (0, 1)
    assert plan_devices("cpu", 2, 1, 0.9, num_gpus=4).visible_devices == (None, None)
    assert plan_devices("auto", 2, 1, 0.9, num_gpus=0).visible_devices == (None, None)


def test_a_killed_replica_fails_its_requests_and_the_rest_carry_on(tiny_llama):
    engine = DataParallelEngine.from_settings(tiny_llama, data_parallel_size=2, **SETTINGS)
    try:
        pids = [s.pid for s in engine.health()]
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
        for i in range(6):  # round robin: even ids on replica 0, odd on replica 1
            engine.add_request(f"r{i}", f"prompt number {i}", params)
        deadline = time.monotonic() + 60
        while not engine.replicas[1].num_running:
            engine.step()
            assert time.monotonic() < deadline
        os.kill(pids[1], signal.SIGKILL)
        finished, failed = {}, {}
        deadline = time.monotonic() + 60
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline
            try:
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
            except ReplicaFailedError as err:
                failed[err.request_id] = err
        assert sorted(failed) == ["r1", "r3", "r5"]
        assert all(err.replica == 1 and "replica 1" in str(err) and "SIGKILL" in str(err)
                   for err in failed.values())
        for rid in ("r0", "r2", "r4"):
            assert finished[rid].outputs[0].finish_reason == "length"
            assert len(finished[rid].outputs[0].token_ids) == 200
        assert all(finished[rid].outputs[0].finish_reason == "abort" for rid in failed)
        health = engine.health()
        assert [s.status for s in health] == ["ok", "dead"]
        assert "SIGKILL" in health[1].reason
        # new requests go to the live replica only
        for i in range(3):
            engine.add_request(f"after{i}", "more", SamplingParams(max_tokens=3))
        assert len(engine.replicas[0].requests) == 3
        while engine.has_unfinished_requests():
            engine.step()
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.is_alive:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(ReplicasDeadError, match="every replica is dead"):
            engine.add_request("late", "no one left", SamplingParams(max_tokens=3))
    finally:
        engine.shutdown()
        engine.shutdown()  # idempotent
    assert not {c.pid for c in replica_children()} & set(pids)  # stopped and reaped


@pytest.mark.slow  # a front-end process and its two replicas: about 20 s on 2 cores
def test_replicas_exit_when_the_front_end_process_is_killed(tiny_llama, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from llmlab.distributed.data_parallel import DataParallelEngine

        if __name__ == "__main__":
            engine = DataParallelEngine.from_settings(
                {tiny_llama!r}, data_parallel_size=2, cpu_threads=1, dtype="float32")
            print(" ".join(str(s.pid) for s in engine.health()), flush=True)
            time.sleep(600)
    """))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env=subprocess_env(HF_HUB_OFFLINE="1"))
    try:
        pids = [int(p) for p in front.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        front.kill()
        front.wait(10)
        wait_gone(pids, timeout=15)
    finally:
        if front.poll() is None:
            front.kill()


def test_pooling_models_are_refused_before_any_replica_starts(tiny_llama, tmp_path):
    """The front end routes and reports generation only: a pooling engine behind it (asked
    for, or "auto" on a classifier checkpoint) is a clear error, and nothing is spawned."""
    from llmlab.testing.tiny import build_tiny_model

    classifier = str(build_tiny_model(tmp_path, "Qwen3ForSequenceClassification", seed=1,
                                      num_labels=2))
    before = {c.pid for c in replica_children()}
    for model, extra in ((tiny_llama, {"runner": "pooling"}), (tiny_llama, {"task": "embed"}),
                         (classifier, {"runner": "auto"})):
        with pytest.raises(ValueError, match="not supported with data_parallel_size=2"):
            LLM(model, data_parallel_size=2, **extra, **SETTINGS)
    with pytest.raises(ValueError, match="not supported with engine_core_process=True"):
        LLM(tiny_llama, engine_core_process=True, runner="pooling", **SETTINGS)
    assert {c.pid for c in replica_children()} <= before
    # "auto" on a generating checkpoint still starts replicas as before
    LLM(tiny_llama, data_parallel_size=2, runner="auto", **SETTINGS).llm_engine.shutdown()
