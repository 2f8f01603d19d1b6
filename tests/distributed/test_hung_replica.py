"""A hung replica is a dead replica, while it hangs: heartbeats against a deadline.

One two-replica engine (each replica a spawned process: seconds to start) serves every
test here, with short deadlines. A replica is hung with SIGSTOP (all its threads stop,
its heartbeat thread too), or wedged by a logits processor that sleeps inside its step
(its heartbeats go on). Every test lets the replicas run again (SIGCONT) in a ``finally``,
whatever happens. The server test runs last: the app's shutdown stops the engine.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal
import struct
import time

import pytest

from llmlab import SamplingParams
from llmlab.distributed.data_parallel import (
    DataParallelEngine,
    ReplicaFailedError,
    ReplicasUnavailableError,
    resolve_router,
)
from llmlab.distributed.liveness import Liveness, heartbeat_interval
from llmlab.distributed.replica_handle import MessageReader
from llmlab.distributed.replica_process import PipeWriter
from llmlab.distributed.replica_process import Heartbeat
from tests.distributed.hang_helpers import Slow, WedgeIn
from tests.distributed.test_data_parallel import SETTINGS, wait_gone

HEARTBEAT_TIMEOUT_S = 2.0
WEDGED_AFTER_S = 2.0
BEAT_S = heartbeat_interval(HEARTBEAT_TIMEOUT_S)
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)


def resume(pids) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def stopped(*pids: int):
    """SIGSTOP the processes; SIGCONT them on the way out, whatever happened."""
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        resume(pids)


class Steer:
    """Sends every request to replica ``target`` while routers are shown it, else to the
    first replica shown."""

    def __init__(self, target: int) -> None:
        self.target = target

    def route(self, request, replicas):
        for position, replica in enumerate(replicas):
            if replica.replica_index == self.target:
                return position
        return 0


class Driver:
    """Steps the engine, keeping every output and failure by request id."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.engine = engine
        self.outputs: dict[str, list] = {}
        self.failures: dict[str, ReplicaFailedError] = {}

    def until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            try:
                for out in self.engine.step():
                    self.outputs.setdefault(out.request_id, []).append(out)
            except ReplicaFailedError as err:
                self.failures[err.request_id] = err

    def finished(self, *ids: str) -> bool:
        return all(self.outputs.get(rid) and self.outputs[rid][-1].finished for rid in ids)

    def final(self, rid: str):
        out = self.outputs[rid][-1]
        assert out.finished
        return out.outputs[0]

    def drain(self, timeout: float = 20.0) -> None:
        self.until(lambda: not self.engine.has_unfinished_requests(), timeout, "the engine")

    def status(self, index: int) -> str:
        return self.engine.health()[index].status


def test_the_front_end_never_waits_on_a_replica_that_stopped_reading_or_writing():
    """No process needed: a pipe whose other end nobody reads, and a message cut short."""
    ours, theirs = multiprocessing.Pipe()
    writer = PipeWriter(ours, "test-commands")
    started = time.monotonic()
    for _ in range(32):  # 8 MiB: far more than the pipe holds, and nobody reads it
        writer.send(b"x" * (1 << 18))
    assert time.monotonic() - started < 1.0
    theirs.close()  # the writer's next write fails: it stops, and says so
    writer.close(5.0)
    with pytest.raises(OSError, match="gone"):
        writer.send(b"more")
    ours.close()

    ours, theirs = multiprocessing.Pipe()
    reader = MessageReader(ours)
    body = pickle.dumps(Heartbeat(0.5, True))
    frame = struct.pack("!i", len(body)) + body
    fd = theirs.fileno()
    os.write(fd, frame[:3])  # a replica stopped halfway through the length
    assert reader.read() == ([], False)
    os.write(fd, frame[3:-1])  # ... and through the body
    assert reader.read() == ([], False)
    os.write(fd, frame[-1:] + frame)
    assert reader.read() == ([Heartbeat(0.5, True)] * 2, False)
    theirs.close()
    assert reader.read() == ([], True)
    ours.close()


def test_liveness_tells_silent_from_wedged_from_answering():
    live = Liveness(heartbeat_timeout_s=2.0, wedged_after_s=5.0, last_heard=100.0)
    assert live.verdict(101.9) is None
    assert live.verdict(102.1) == "silent"
    assert "no heartbeat for 2.1 s" in live.describe("silent", 102.1)
    live.heard(102.2, Heartbeat(stuck_s=5.5, in_step=True))
    assert live.verdict(102.3) == "wedged"
    assert "its current step has run for 5.5 s" in live.describe("wedged", 102.3)
    live.heard(102.4, object())  # any other message (a step's report): the loop went round
    assert live.verdict(102.5) is None


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = DataParallelEngine.from_settings(
        tiny_llama, data_parallel_size=2, replica_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        replica_wedged_after_s=WEDGED_AFTER_S, **SETTINGS,
    )
    pids = [s.pid for s in engine.health()]
    try:
        driver = Driver(engine)  # one request on each replica: first steps behind us
        for i in range(2):
            engine.add_request(f"warm{i}", "warm up", GREEDY)
        driver.until(lambda: driver.finished("warm0", "warm1"), 60, "the warm-up")
        yield engine
    finally:
        resume(pids)
        engine.shutdown()
        wait_gone(pids)


@pytest.fixture
def arrivals(engine):
    """``{replica: [request id, ...]}`` of the requests each replica's engine received;
    ``aborted`` likewise, of those it aborted."""
    seen: dict = {0: [], 1: [], "aborted": {0: [], 1: []}}

    def observe(index, event):
        seen[index].extend(a.request_id for a in event.arrived)
        seen["aborted"][index].extend(event.aborted)

    engine.subscribe(observe, replica=True)
    yield seen
    engine.unsubscribe(observe)
    engine.router = resolve_router("round_robin")


def test_a_stopped_replica_loses_its_requests_gets_no_new_ones_and_rejoins(engine, arrivals):
    pids = [s.pid for s in engine.health()]
    run = Driver(engine)
    engine.router = Steer(1)
    slow = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0,
                          logits_processors=[Slow(0.02)])
    engine.add_request("started", "a long answer", slow)
    run.until(lambda: "started" in run.outputs, 30, "the first output of 'started'")
    with stopped(pids[1]):
        hung_at = time.monotonic()
        # the router still sees replica 1 (nothing has told it yet): this one goes there
        engine.add_request("unstarted", "sent to a stopped replica", GREEDY)
        assert {"started", "unstarted"} <= engine.replicas[1].requests
        run.until(lambda: run.status(1) == "unresponsive", HEARTBEAT_TIMEOUT_S + 10,
                  "replica 1 to be found unresponsive")
        # not before its deadline (its last heartbeat may have come a beat or so earlier)
        assert time.monotonic() - hung_at > HEARTBEAT_TIMEOUT_S - 2 * BEAT_S
        health = engine.health()
        assert [s.status for s in health] == ["ok", "unresponsive"]
        assert health[1].pid == pids[1] and health[1].num_requests == 0
        assert "replica 1" in health[1].reason and "no heartbeat for" in health[1].reason
        assert health[1].to_json()["status"] == "unresponsive"
        assert engine.is_alive

        # the request that had produced output fails, naming the replica; the other one
        # moves to replica 0 and completes there
        run.until(lambda: "started" in run.failures and run.finished("unstarted"), 30,
                  "'started' to fail and 'unstarted' to finish")
        err = run.failures["started"]
        assert err.replica == 1 and "replica 1" in str(err) and "unresponsive" in str(err)
        assert run.final("started").finish_reason == "abort"
        assert "unstarted" not in run.failures and "unstarted" in arrivals[0]
        assert run.final("unstarted").finish_reason == "length"
        assert len(run.final("unstarted").token_ids) == GREEDY.max_tokens

        # new requests go to the replica that answers only
        engine.router = resolve_router("round_robin")
        during = [f"during{i}" for i in range(4)]
        for rid in during:
            engine.add_request(rid, f"{rid} while replica 1 is stopped", GREEDY)
        assert set(during) <= engine.replicas[0].requests and not engine.replicas[1].requests
        run.until(lambda: run.finished(*during), 30, "the requests sent meanwhile")
        assert all(len(run.final(rid).token_ids) == GREEDY.max_tokens for rid in during)
        seen_of_started = len(run.outputs["started"])

    # SIGCONT: its heartbeats resume, it answers its aborts and takes work again
    run.until(lambda: run.status(1) == "ok", 10 * BEAT_S + 5, "replica 1 to rejoin")
    assert engine.health()[1].reason is None
    run.drain()
    assert len(run.outputs["started"]) == seen_of_started  # nothing stale came back
    assert "started" in arrivals["aborted"][1]  # it was told to stop, and did
    after = [f"after{i}" for i in range(4)]
    for rid in after:
        engine.add_request(rid, f"{rid} replica 1 rejoined", GREEDY)
    assert len(engine.replicas[1].requests) == 2
    run.until(lambda: run.finished(*after), 30, "the requests after the rejoin")
    assert sum(rid in arrivals[1] for rid in after) == 2
    assert all(len(run.final(rid).token_ids) == GREEDY.max_tokens for rid in after)
    # nothing leaked, here or in either replica
    run.drain()
    assert engine.get_num_unfinished_requests() == 0
    for replica in engine.replicas:
        assert not replica.requests and not replica.unreported
        assert replica.outstanding_tokens == 0
        assert replica.num_running == replica.num_waiting == 0
    assert [s.status for s in engine.health()] == ["ok", "ok"]


def test_a_wedged_step_makes_its_replica_unresponsive_until_the_step_ends(engine, arrivals):
    pids = [s.pid for s in engine.health()]
    run = Driver(engine)
    engine.router = Steer(0)
    wedge = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0,
                           logits_processors=[WedgeIn(pids[0], WEDGED_AFTER_S + 2.5)])
    engine.add_request("wedged", "stuck in a step", wedge)
    run.until(lambda: run.status(0) == "unresponsive", WEDGED_AFTER_S + 10,
              "replica 0 to be found wedged")
    health = engine.health()
    assert health[1].status == "ok"
    assert "replica 0" in health[0].reason and "wedged" in health[0].reason
    assert "step" in health[0].reason
    # it had produced nothing: it moves to replica 1 (where nothing wedges it)
    run.until(lambda: run.finished("wedged"), 30, "'wedged' to finish elsewhere")
    assert "wedged" in arrivals[1] and not run.failures
    assert len(run.final("wedged").token_ids) == 6
    # the step ends: replica 0 answers again
    run.until(lambda: run.status(0) == "ok", WEDGED_AFTER_S + 15, "replica 0 to rejoin")
    run.drain()
    assert engine.get_num_unfinished_requests() == 0
    assert all(not r.requests and r.outstanding_tokens == 0 for r in engine.replicas)


def test_the_server_says_degraded_while_a_replica_is_stopped_and_503_while_none_answers(
        engine):
    """Last here: the app's shutdown stops the engine."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from llmlab.entrypoints.async_engine import AsyncEngine
    from llmlab.entrypoints.server.app import build_app
    from tests.server.conftest import running

    pids = [s.pid for s in engine.health()]
    app = build_app(AsyncEngine(engine), served_model_names=["tiny"])

    def wait_health(condition, what: str, timeout: float = HEARTBEAT_TIMEOUT_S + 10):
        deadline = time.monotonic() + timeout
        while not condition(answer := httpx.get(f"{url}/health")):
            assert time.monotonic() < deadline, f"{what}: {answer.status_code} {answer.text}"
            time.sleep(0.05)
        return answer

    def complete(prompt: str) -> httpx.Response:
        return httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 4})

    def healthy(answer) -> bool:
        return answer.status_code == 200 and answer.content == b""

    with running(app) as url:
        assert healthy(httpx.get(f"{url}/health"))
        with stopped(pids[1]):
            answer = wait_health(lambda a: a.status_code == 200 and a.content != b"",
                                 "/health to say degraded")
            body = answer.json()
            assert body["status"] == "degraded"
            assert [(r["index"], r["status"]) for r in body["replicas"]] == [
                (0, "ok"), (1, "unresponsive")]
            assert "replica 1" in body["replicas"][1]["reason"]
            for i in range(2):  # both served by replica 0
                done = complete(f"request {i}")
                assert done.status_code == 200, done.text
        wait_health(healthy, "/health to be plain 200 again")
        with stopped(*pids):
            dead = wait_health(lambda a: a.status_code == 503, "/health to say 503")
            assert "no replica answers" in dead.text
            assert [s.status for s in engine.health()] == ["unresponsive", "unresponsive"]
            # refused at once, not left to hang
            started = time.monotonic()
            refused = complete("anyone?")
            assert refused.status_code == 503 and "no replica answers" in refused.text
            with pytest.raises(ReplicasUnavailableError, match="no replica answers"):
                engine.add_request("nobody", "is anyone there?", GREEDY)
            assert time.monotonic() - started < 2.0
        wait_health(healthy, "/health to be plain 200 again")
        done = complete("all back")
        assert done.status_code == 200, done.text
