"""Tensor parallelism with Ray actors as ranks 1..N-1 (``distributed_executor_backend="ray"``).

One local Ray instance (two CPUs, no dashboard) serves the module; each Ray engine here
holds both CPUs (rank 0's share, reserved on this node, and rank 1's actor), so the tests
build their engines one at a time and end each before the next.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")

from llmlab import LLM, SamplingParams  # noqa: E402
from llmlab.distributed import ray_workers  # noqa: E402

# The tests that start the Ray instance are marked slow (about a minute together on 2 cores;
# CI runs them); the others run by default.

PROMPTS = [
    {"prompt_token_ids": [1, 15, 27, 99, 4]},
    {"prompt_token_ids": [7, 3, 250, 41, 8, 60, 2, 11]},
    {"prompt_token_ids": [200]},
]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)


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


def _ray_llm(model: str) -> LLM:
    return LLM(
        model, device="cpu", tensor_parallel_size=2, distributed_executor_backend="ray",
        cpu_threads=1, distributed_timeout_s=120,
    )


def _assert_gone(workers) -> None:
    """Every actor is dead and the engine's placement group removed."""
    for worker in workers:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(worker.actor.placement.remote(), timeout=10)
    group = workers[0].placement_group
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


@pytest.mark.slow
def test_ray_ranks_match_one_process(tiny_llama, ray_cluster):
    reference = LLM(tiny_llama, device="cpu", cpu_threads=1)
    expected = reference.generate(PROMPTS, GREEDY, use_tqdm=False)
    del reference

    llm = _ray_llm(tiny_llama)
    workers = list(llm.llm_engine.executor.workers.workers)
    assert [w.rank for w in workers] == [1]
    assert all(isinstance(w, ray_workers.RayWorker) and w.is_alive() for w in workers)
    # Rank 0 is reached at its node's address: loopback would fail across nodes.
    assert workers[0].host == ray.util.get_node_ip_address() != "127.0.0.1"

    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for want, got in zip(expected, outputs, strict=True):
        want, got = want.outputs[0], got.outputs[0]
        assert got.token_ids == want.token_ids
        for want_pos, got_pos in zip(want.logprobs, got.logprobs, strict=True):
            assert got_pos.keys() == want_pos.keys()
            for token, logprob in want_pos.items():
                assert got_pos[token].logprob == pytest.approx(logprob.logprob, abs=1e-5)

    # Deleting the LLM stops its workers: no actor (nor its reservation) outlives it.
    del llm, outputs
    gc.collect()
    _assert_gone(workers)
    assert all(w.describe_exit() == "left the group" for w in workers)


@pytest.mark.slow
def test_killed_actor_fails_generate_naming_the_rank(tiny_llama, ray_cluster):
    llm = _ray_llm(tiny_llama)
    engine = llm.llm_engine
    worker = engine.executor.workers.workers[0]

    # The first step's observer holds rank 0 between two steps until the actor is killed.
    stepped, killed = threading.Event(), threading.Event()

    def hold_after_first_step(event) -> None:
        if not stepped.is_set():
            stepped.set()
            killed.wait(60)

    engine.subscribe(hold_after_first_step)
    raised: list[BaseException] = []

    def generate() -> None:
        try:
            llm.generate(
                PROMPTS, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )
        except BaseException as err:  # noqa: BLE001 - examined below
            raised.append(err)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    assert stepped.wait(60), "no step ran"
    ray.kill(worker.actor, no_restart=True)
    ray.wait([worker.ref], timeout=10)
    start = time.monotonic()
    killed.set()
    thread.join(30)
    assert not thread.is_alive(), "generate hung after its worker's actor was killed"
    assert time.monotonic() - start < 15
    assert raised, "generate finished although rank 1 was killed"
    message = str(raised[0])
    assert "rank 1" in message and "Ray actor died" in message, message
    assert "ray.kill" in message

    # The executor shut the group down on the failure; shutting down again is a no-op.
    engine.executor.shutdown()
    _assert_gone([worker])


@pytest.mark.slow
def test_unreservable_ranks_time_out_leaving_nothing(tiny_llama, ray_cluster):
    # Two ranks of 2 threads each need 4 CPUs; the cluster has 2.
    with pytest.raises(TimeoutError, match="Ray could not reserve"):
        LLM(
            tiny_llama, device="cpu", tensor_parallel_size=2,
            distributed_executor_backend="ray", cpu_threads=2, distributed_timeout_s=1,
        )
    groups = [
        g for g in ray.util.placement_group_table().values()
        if g["name"].startswith("llmlab-tp-")
    ]
    assert groups and all(g["state"] == "REMOVED" for g in groups)


def test_cuda_devices_keep_workers_off_rank0s_gpu():
    spare_calls = []

    def spare() -> str:
        spare_calls.append(1)
        return "1"

    # Ray gave rank 1 the GPU rank 0 computes on (node "a", GPU "0"): it takes the spare.
    assert ray_workers._cuda_devices(
        [("a", ["0"]), ("a", ["2"]), ("b", ["0"])], ("a", "0"), spare
    ) == ["1", "2", "0"]
    assert len(spare_calls) == 1
    # No collision (or rank 0's GPU not reserved): each worker keeps what Ray gave it.
    assert ray_workers._cuda_devices([("a", ["3"])], ("a", "0"), spare) == ["3"]
    assert ray_workers._cuda_devices([("a", ["0"])], None, spare) == ["0"]
    assert len(spare_calls) == 1
    with pytest.raises(RuntimeError, match="rank 1 no GPU"):
        ray_workers._cuda_devices([("a", [])], None, spare)


def test_death_reason_is_one_line():
    err = ray.exceptions.ActorDiedError.__new__(ray.exceptions.ActorDiedError)
    err.error_msg = (
        "The actor died unexpectedly before finishing this task.\n\tclass_name: _RankActor\n"
        "\tpid: 123\n\tip: 10.0.0.2\nThe actor is dead because it was killed by `ray.kill`."
    )
    assert ray_workers._death_reason(err) == (
        "The actor is dead because it was killed by `ray.kill`. (pid 123 on 10.0.0.2)"
    )


def test_missing_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    with pytest.raises(ImportError, match=r'pip install "llmlab\[ray\]"'):
        ray_workers.start_ray_workers(2, 1234, plan=None)
