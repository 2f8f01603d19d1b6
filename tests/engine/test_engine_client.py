"""One ``EngineClient`` surface: ``Engine`` and ``DataParallelEngine`` implement it,
``AsyncEngine`` implements ``AsyncEngineClient``, and their public surfaces cannot drift.

The signature tests read the classes only; the behavioural ones start one two-replica
``DataParallelEngine`` over tiny Llama (two spawned processes: a few seconds) and share it.
"""

from __future__ import annotations

import inspect
import os
import signal
import time

import attrs
import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.cache.kv_cache_manager import CacheSnapshot
from llmlab.distributed.data_parallel import DataParallelEngine
from llmlab.distributed.replica_queries import ReplicaKVCache, ReplicaRecordings
from llmlab.engine.client import AsyncEngineClient, EngineClient
from llmlab.engine.engine import Engine
from llmlab.entrypoints.async_engine import AsyncEngine
from llmlab.lora.request import LoRARequest
from llmlab.observe.events import EngineSnapshot
from llmlab.observe.recording import load
from llmlab.viz.state import KVCacheState

SETTINGS = {"dtype": "float32", "seed": 0, "cpu_threads": 1, "max_model_len": 256}
if torch.cuda.is_available():  # replicas do not see tests/conftest.py's cap on the cache
    SETTINGS["kv_cache_memory_bytes"] = 64 << 20
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [f"the {i} quick brown fox " * (1 + i % 3) for i in range(6)]

# Every public member of Engine that is not in EngineClient, with why. A new public member
# of Engine fails test_every_public_member_of_engine_is_in_the_protocol_or_listed until it
# is added to the protocol (and to DataParallelEngine) or here.
NOT_IN_PROTOCOL = {
    "from_engine_args": "construction: each kind builds its own way (Engine from EngineArgs, "
                        "DataParallelEngine.from_settings); a client is used once built",
    "scheduler": "the in-process scheduler; an engine of replicas has one in each replica",
    "executor": "the in-process executor (model runner, tensor-parallel ranks); replicas "
                "hold their own",
    "clock": "where the step's time comes from (a VirtualClock in simulation): the engine's "
             "own business; events carry their times",
    "observers": "the list subscribe() appends to: attach and detach through "
                 "subscribe/unsubscribe/observe",
    "grammars": "the grammar compile cache the engine shares with its executor: part of "
                "input processing",
    "inputs": "input processing (checks, tokenization), reached through prepare_request",
    "outputs": "output processing (text, stop strings), inside step()",
    "pooling": "a pooling engine's tasks (runner='pooling'); data parallelism refuses pooling "
               "models, and LLM's pooling methods read it from an Engine",
    "lora": "the LoRA adapter store shared with the model runner; lora_request is the "
            "surface (data parallelism refuses enable_lora)",
    "overlap": "overlapped scheduling's driver inside step() (None when synchronous); "
               "each replica has its own",
}

IMPLEMENTERS = [(EngineClient, Engine), (EngineClient, DataParallelEngine),
                (AsyncEngineClient, AsyncEngine)]


def protocol_members(protocol: type) -> dict[str, object]:
    """``name -> declaration``: methods and properties as declared, data attributes as
    the string ``"attribute"``."""
    members: dict[str, object] = {}
    for name, value in vars(protocol).items():
        if not name.startswith("_") and (inspect.isfunction(value)
                                          or isinstance(value, property)):
            members[name] = value
    for name in vars(protocol).get("__annotations__", {}):
        if not name.startswith("_"):
            members.setdefault(name, "attribute")
    return members


def call_kind(member: object) -> str:
    """How a member is used: a property, a coroutine, an async iterator (an async
    generator, or declared as returning one) or a plain method."""
    if isinstance(member, property):
        return "property"
    if inspect.iscoroutinefunction(member):
        return "coroutine"
    if inspect.isasyncgenfunction(member) or str(
        inspect.signature(member).return_annotation
    ).startswith("AsyncIterator"):
        return "async iterator"
    return "method"


def signature_problems(name: str, declared, implemented) -> list[str]:
    """Where ``implemented``'s parameters differ from ``declared``'s: the same names,
    kinds and defaults, in order; parameters beyond them must be optional (an
    implementation may take more, never require more)."""
    want = list(inspect.signature(declared).parameters.values())
    got = list(inspect.signature(implemented).parameters.values())
    problems = []
    for i, param in enumerate(want):
        if i >= len(got):
            problems.append(f"{name}: missing parameter {param.name!r}")
            continue
        have = got[i]
        if (have.name, have.kind, have.default) != (param.name, param.kind, param.default):
            problems.append(
                f"{name}: parameter {i} is {have.name!r} ({have.kind.description}, default "
                f"{have.default!r}); the protocol has {param.name!r} "
                f"({param.kind.description}, default {param.default!r})"
            )
    for have in got[len(want):]:
        if have.default is inspect.Parameter.empty and have.kind not in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD
        ):
            problems.append(f"{name}: extra required parameter {have.name!r}")
    return problems


@pytest.mark.parametrize("protocol, implementer", IMPLEMENTERS,
                         ids=lambda c: c.__name__)
def test_every_protocol_member_has_a_compatible_signature(protocol, implementer):
    problems = []
    for name, declared in protocol_members(protocol).items():
        if declared == "attribute":
            continue  # data attributes: checked on instances below
        implemented = inspect.getattr_static(implementer, name, None)
        if implemented is None:
            problems.append(f"{name}: missing")
            continue
        if isinstance(implemented, (staticmethod, classmethod)):
            problems.append(f"{name}: a {type(implemented).__name__}, not a method")
            continue
        if call_kind(declared) != call_kind(implemented):
            problems.append(f"{name}: a {call_kind(implemented)}, the protocol declares a "
                            f"{call_kind(declared)}")
            continue
        if not isinstance(declared, property):
            problems.extend(signature_problems(name, declared, implemented))
    assert not problems, (f"{implementer.__name__} has drifted from {protocol.__name__}:\n  "
                          + "\n  ".join(problems))


def test_engine_has_every_protocol_attribute():
    fields = {f.name for f in attrs.fields(Engine)}
    declared = [n for n, d in protocol_members(EngineClient).items() if d == "attribute"]
    assert declared and set(declared) <= fields


def test_async_engine_has_the_engine_it_serves():
    class StandIn:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    front = AsyncEngine(StandIn(), start=False)
    try:
        for name, declared in protocol_members(AsyncEngineClient).items():
            if declared == "attribute":
                assert hasattr(front, name), name
    finally:
        front.shutdown()


def test_every_public_member_of_engine_is_in_the_protocol_or_listed():
    public = {name for name in dir(Engine) if not name.startswith("_")}
    in_protocol = set(protocol_members(EngineClient))
    unlisted = sorted(public - in_protocol - set(NOT_IN_PROTOCOL))
    assert not unlisted, (
        f"Engine's public {unlisted} are neither in EngineClient (llmlab/engine/client.py, "
        "and then DataParallelEngine) nor in NOT_IN_PROTOCOL with a reason"
    )
    stale = sorted(set(NOT_IN_PROTOCOL) - public)
    assert not stale, f"remove from NOT_IN_PROTOCOL (Engine has no such member): {stale}"
    both = sorted(set(NOT_IN_PROTOCOL) & in_protocol)
    assert not both, f"in the protocol and in NOT_IN_PROTOCOL: {both}"


def test_the_signature_check_catches_a_drift():
    class Drifted:
        def add_request(self, request_id, prompt, params=None, arrival_time=None,
                        priority=1, user=None, lora_request=None):
            pass

        def step(self, budget):
            pass

    declared = protocol_members(EngineClient)
    assert signature_problems("add_request", declared["add_request"], Drifted.add_request)
    assert signature_problems("step", declared["step"], Drifted.step) == [
        "step: extra required parameter 'budget'"
    ]


# -- LLM and AsyncEngine build one Engine for one replica ---------------------------------


def test_llm_builds_a_plain_engine_for_one_replica(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32")
    assert type(llm.llm_engine) is Engine
    assert isinstance(llm.llm_engine, EngineClient)


def test_async_engine_builds_a_plain_engine_for_one_replica(tiny_llama):
    front = AsyncEngine.from_settings(tiny_llama, dtype="float32")
    try:
        assert type(front.engine) is Engine
        assert isinstance(front, AsyncEngineClient)
    finally:
        front.shutdown()


@pytest.mark.parametrize("setting, value, match", [
    ("router", "nope", "router"),
    ("replica_heartbeat_timeout_s", 0, "replica_heartbeat_timeout_s"),
    ("replica_wedged_after_s", -1.0, "replica_wedged_after_s"),
])
def test_data_parallel_settings_are_checked_with_one_replica(tiny_llama, setting, value, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, dtype="float32", **{setting: value})


# -- DataParallelEngine's members, working over its replicas -------------------------------


@pytest.fixture(scope="module")
def dp(tiny_llama):
    llm = LLM(tiny_llama, data_parallel_size=2, **SETTINGS)
    yield llm
    llm.llm_engine.shutdown()


def test_data_parallel_engine_is_an_engine_client(dp):
    engine = dp.llm_engine
    assert isinstance(engine, EngineClient)
    for name, declared in protocol_members(EngineClient).items():
        assert hasattr(engine, name), name


def test_snapshot_gives_one_per_replica(dp):
    engine = dp.llm_engine
    snapshots = engine.snapshot()
    assert len(snapshots) == 2 and all(isinstance(s, EngineSnapshot) for s in snapshots)
    for snapshot, kv in zip(snapshots, engine.kv_cache, strict=True):
        assert (snapshot.num_blocks, snapshot.block_size) == (kv.num_blocks, kv.block_size)
        assert snapshot.num_waiting == snapshot.num_running == 0
        assert not snapshot.kv.block_tables


def test_observe_follows_each_replica_exactly_from_its_snapshot(dp):
    engine = dp.llm_engine
    dp.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # some history before attaching
    replica_of = {}  # id(event) -> (replica, event): the event kept, so no id is reused

    def by_replica(index, event):
        replica_of[id(event)] = (index, event)

    engine.subscribe(by_replica, replica=True)
    heard = []
    snapshots = engine.observe(heard.append)
    try:
        assert len(snapshots) == 2 and all(s is not None for s in snapshots)
        dp.generate(PROMPTS, GREEDY, use_tqdm=False)
        finals = engine.snapshot()  # whatever was reported before these is heard first
    finally:
        engine.unsubscribe(heard.append)
        engine.unsubscribe(by_replica)
    events: dict[int, list] = {0: [], 1: []}
    for event in heard:
        events[replica_of[id(event)][0]].append(event)
    assert events[0] and events[1]
    for i in (0, 1):
        assert events[i][0].step_index >= snapshots[i].step_index
        state = KVCacheState(snapshots[i])
        for event in events[i]:
            state.apply(event)
        assert state.frame() == KVCacheState(finals[i]).frame()
    count = len(heard)
    dp.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert len(heard) == count  # unsubscribed


def test_record_writes_one_recording_per_replica(dp, tmp_path):
    engine = dp.llm_engine
    with engine.record(tmp_path / "run.jsonl.gz") as recordings:
        assert isinstance(recordings, ReplicaRecordings)
        dp.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert recordings.paths == (tmp_path / "run.replica0.jsonl.gz",
                                tmp_path / "run.replica1.jsonl.gz")
    total = 0
    for path, steps in zip(recordings.paths, recordings.num_steps, strict=True):
        recording = load(path)
        assert recording.complete and len(recording.events) == steps > 0
        assert recording.config["data_parallel_size"] == 1  # each replica's own engine
        total += sum(len(e.arrived) for e in recording.events)
    assert total == len(PROMPTS)
    recordings.close()  # idempotent


def test_a_recording_that_cannot_start_raises_and_leaves_none_running(dp, tmp_path):
    with pytest.raises(RuntimeError, match="record failed"):
        dp.llm_engine.record(tmp_path / "missing" / "run.jsonl")
    dp.generate(PROMPTS[:2], GREEDY, use_tqdm=False)  # the replicas still serve


def test_kv_cache_gives_a_read_only_view_per_replica(dp):
    engine = dp.llm_engine
    views = engine.kv_cache
    assert len(views) == 2 and all(isinstance(v, ReplicaKVCache) for v in views)
    for view in views:
        assert view.num_blocks > 0 and view.block_size == engine.config.block_size
        assert view.num_free_blocks == view.num_blocks  # idle: nothing held
        assert view.usage == 0.0
        assert isinstance(view.snapshot(), CacheSnapshot)
        view.check()
        assert view.block_table("nobody") == ()
    with pytest.raises(NotImplementedError,
                       match=r"kv_cache\[0\]\.eviction: .*lives in the replica's process"):
        views[0].eviction  # noqa: B018
    assert not hasattr(views[0], "allocate")


def test_add_request_takes_lora_request_and_forwards_it(dp):
    engine = dp.llm_engine
    engine.add_request("no-adapter", "hello", GREEDY, lora_request=None)
    prepared = engine.prepare_request("peek", "hello", GREEDY, lora_request=None)
    assert prepared.lora_request is None
    with pytest.raises(ValueError, match="enable_lora"):
        engine.add_request("adapter", "hello", GREEDY,
                           lora_request=LoRARequest("a", 1, "/nonexistent"))
    assert not engine.has_request("adapter")  # nothing sent
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["no-adapter"]


@pytest.mark.slow
def test_a_dead_replica_answers_none_and_names_itself(tiny_llama, tmp_path):
    llm = LLM(tiny_llama, data_parallel_size=2, **SETTINGS)
    engine: DataParallelEngine = llm.llm_engine
    try:
        os.kill(engine.health()[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.health()[1].status != "dead":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine.step()  # notices the death
        snapshots = engine.snapshot()
        assert snapshots[0] is not None and snapshots[1] is None
        with pytest.raises(RuntimeError, match=r"kv_cache\[1\]\.usage: replica 1 cannot answer"):
            engine.kv_cache[1].usage  # noqa: B018
        with engine.record(tmp_path / "run.jsonl") as recordings:
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        assert recordings.paths[1] is None and recordings.num_steps[0] > 0
    finally:
        engine.shutdown()
    assert engine.snapshot() == (None, None)  # shut down: nothing answers
