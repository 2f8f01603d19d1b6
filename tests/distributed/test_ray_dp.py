"""Data parallelism with each replica in a Ray actor (``data_parallel_size=2`` with
``distributed_executor_backend="ray"``).

One local Ray instance (two CPUs, no dashboard) serves the module, or the one this process
already runs; each engine here holds both CPUs (two one-thread replicas), so every test
builds its own engine and the fixture ends it (checking that no actor outlives it) before
the next one starts.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from llmlab import LLM, SamplingParams  # noqa: E402
from llmlab.distributed import ray_replicas  # noqa: E402
from llmlab.distributed.data_parallel import (  # noqa: E402
    DataParallelEngine,
    ReplicaFailedError,
)
from llmlab.distributed.ray_replicas import RayReplicaHandle, replica_resources  # noqa: E402
from llmlab.distributed.replica_process import ReplicaSpec  # noqa: E402

# The tests that start the Ray instance are marked slow (about a minute together on 2 cores;
# CI runs them); the others run by default.

PROMPTS = [
    {"prompt_token_ids": [1, 15, 27, 99, 4]},
    {"prompt_token_ids": [7, 3, 250, 41, 8, 60, 2, 11]},
    {"prompt_token_ids": [200]},
    {"prompt_token_ids": [5, 6, 7, 8]},
    {"prompt_token_ids": [42] * 20},
    {"prompt_token_ids": [9, 300, 17]},
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
RAY_DP = {"device": "cpu", "data_parallel_size": 2, "distributed_executor_backend": "ray",
          "cpu_threads": 1, "distributed_timeout_s": 120}


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh local Ray instance for this module (``address="local"``: never another
    test process's), shut down at the end; or the one this process already runs."""
    if ray.is_initialized():
        yield ray
        return
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, log_to_driver=True,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()


def _assert_gone(actors) -> None:
    """Every actor is dead and the CPUs they held are free again."""
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=10)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, "the replicas' CPUs were not released"
        time.sleep(0.05)


@pytest.fixture
def dp_llm(tiny_llama, ray_cluster):
    llm = LLM(tiny_llama, **RAY_DP)
    actors = [r.handle.actor for r in llm.llm_engine.replicas]
    yield llm
    llm.llm_engine.shutdown()
    _assert_gone(actors)


@pytest.mark.slow
def test_ray_replicas_match_one_engine_and_share_the_requests(dp_llm, tiny_llama):
    engine = dp_llm.llm_engine
    assert isinstance(engine, DataParallelEngine)
    handles = [r.handle for r in engine.replicas]
    assert all(isinstance(h, RayReplicaHandle) and h.is_alive() for h in handles)
    assert [h.resources for h in handles] == [{"CPU": 1.0, "GPU": 0.0}] * 2
    pids = [ray.get(h.actor.ping.remote(), timeout=10) for h in handles]
    assert pids == [h.pid for h in handles] and len(set(pids)) == 2
    # The actors connect back to this node's address: loopback would fail across nodes.
    assert handles[0].node_ip == ray.util.get_node_ip_address() != "127.0.0.1"

    arrivals: dict[int, list[str]] = {0: [], 1: []}
    engine.subscribe(lambda i, event: arrivals[i].extend(a.request_id for a in event.arrived),
                     replica=True)
    got = dp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    reference = LLM(tiny_llama, device="cpu")
    want = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids
        for want_pos, got_pos in zip(w.logprobs, g.logprobs, strict=True):
            assert got_pos.keys() == want_pos.keys()
            for token, logprob in want_pos.items():
                assert got_pos[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)
    assert len(arrivals[0]) == len(arrivals[1]) == 3  # round robin over both actors
    assert not engine.has_unfinished_requests()


@pytest.mark.slow
def test_a_killed_replica_actor_fails_only_its_requests(dp_llm):
    engine = dp_llm.llm_engine
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0)
    for i in range(6):  # round robin: even ids on replica 0, odd on replica 1
        engine.add_request(f"r{i}", PROMPTS[i], params)
    deadline = time.monotonic() + 60
    while not engine.replicas[1].num_running:
        engine.step()
        assert time.monotonic() < deadline
    ray.kill(engine.replicas[1].handle.actor, no_restart=True)
    killed = time.monotonic()
    finished, failed, noticed = {}, {}, None
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        try:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        except ReplicaFailedError as err:
            failed[err.request_id] = err
            noticed = noticed or time.monotonic()
    assert noticed is not None and noticed - killed < 5.0, "the death went unnoticed"
    assert sorted(failed) == ["r1", "r3", "r5"]
    for err in failed.values():
        assert err.replica == 1
        assert "replica 1" in str(err) and "ray.kill" in str(err), str(err)
    for rid in ("r0", "r2", "r4"):
        assert finished[rid].outputs[0].finish_reason == "length"
        assert len(finished[rid].outputs[0].token_ids) == 200
    assert all(finished[rid].outputs[0].finish_reason == "abort" for rid in failed)
    health = engine.health()
    assert [s.status for s in health] == ["ok", "dead"]
    assert "Ray actor died" in health[1].reason

    # Later requests go to the survivor only.
    later = dp_llm.generate(PROMPTS[:3], SamplingParams(max_tokens=3), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in later)
    assert engine.replicas[1].commands_sent == 3  # nothing more was sent to the dead one


@pytest.mark.slow
def test_an_unschedulable_replica_times_out_leaving_nothing(tiny_llama, ray_cluster):
    # Two replicas of 2 threads each need 4 CPUs; the cluster has 2: replica 1 never starts.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"replica \d: its Ray actor did not start") as info:
        LLM(tiny_llama, **{**RAY_DP, "cpu_threads": 2, "distributed_timeout_s": 4})
    assert "2 CPU" in str(info.value)
    assert time.monotonic() - start < 30
    _assert_gone([])  # replica 0's actor was killed and its CPUs returned


def test_replica_resources_follow_the_device_and_sizes(tiny_llama):
    resources, own = replica_resources(
        {"device": "cpu", "cpu_threads": 3, "tensor_parallel_size": 2,
         "distributed_executor_backend": "ray"}, tiny_llama, None, cluster_gpus=8)
    assert resources == {"CPU": 6.0, "GPU": 0.0}
    # Tensor parallelism inside the actor: processes on its node, not more actors.
    assert own["distributed_executor_backend"] == "mp" and own["device"] == "cpu"
    resources, own = replica_resources({"device": "cuda:3", "tensor_parallel_size": 2},
                                       tiny_llama, None, cluster_gpus=0)
    assert resources == {"CPU": 1.0, "GPU": 2.0} and own["device"] == "cuda"
    resources, own = replica_resources({"device": "auto"}, tiny_llama, None, cluster_gpus=1)
    assert resources == {"CPU": 1.0, "GPU": 1.0} and own["device"] == "cuda"
    assert own["distributed_executor_backend"] is None
    resources, own = replica_resources({"device": "auto"}, tiny_llama, None, cluster_gpus=0)
    assert resources == {"CPU": 1.0, "GPU": 0.0} and own["device"] == "cpu"


@pytest.mark.slow
def test_only_the_actor_with_the_key_is_accepted(tiny_llama, ray_cluster, monkeypatch):
    monkeypatch.setattr(ray_replicas, "_HANDSHAKE_S", 0.5)
    spec = ReplicaSpec(0, tiny_llama, None, {"device": "cpu", "cpu_threads": 1}, None,
                       os.getpid())
    handle = RayReplicaHandle(spec)
    handle.start()
    try:
        address = handle._server.getsockname()[:2]
        silent = socket.create_connection(address)  # connects first, never answers
        refused: list[BaseException] = []

        def wrong_key() -> None:
            try:
                multiprocessing.connection.Client(address, authkey=b"not the key")
            except BaseException as err:  # noqa: BLE001 - examined below
                refused.append(err)

        intruder = threading.Thread(target=wrong_key, daemon=True)
        intruder.start()
        conn = handle.connection  # drops both, then takes the actor's connection
        intruder.join(10)
        assert refused and isinstance(refused[0], multiprocessing.AuthenticationError)
        assert handle.pid == ray.get(handle.actor.ping.remote(), timeout=10)
        assert conn.poll(60) and conn.recv().info.pid == handle.pid  # ReplicaReady
        silent.close()
    finally:
        handle.stop(5.0)
    assert not handle.is_alive() and handle.describe_exit() == "its loop returned"
    _assert_gone([handle.actor])
