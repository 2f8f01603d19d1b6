"""Shared grammar-compile workers cannot be held (issue 39, item 3).

One request whose grammar compiles for minutes (a ``guided_choice`` of 300,000 options)
made every other client's structured request fail, and kept the server from stopping.
These tests hold a compile like that running and show, by what is still running when
something else returns (not by timing), that cache hits do not wait for it, that another
client's compile is served before one client's backlog, that a compile that runs out of
time is killed and its worker reused, and that ``close()`` does not wait for it.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("xgrammar")

from llmlab.sampling.compile_pool import CompilePoolClosed, CompileTimeout
from llmlab.sampling.metadata import GrammarFactory
from llmlab.sampling.params import StructuredOutputsParams

# The request: minutes of xgrammar (tens of seconds already at 30,000 options).
SLOW_CHOICES = [f"option number {i}" for i in range(300_000)]
PATIENT_S = 60.0  # generous: how long anything that should happen soon may take


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture
def factory_of(tokenizer):
    """``factory_of(**settings)``: a GrammarFactory without the up-front limits (the
    mechanism must hold without them), closed after the test."""
    made = []

    def make(**settings) -> GrammarFactory:
        settings = {"compile_timeout_s": PATIENT_S, "max_choices": None,
                    "max_constraint_chars": None, **settings}
        factory = GrammarFactory(tokenizer, len(tokenizer) + 70, [tokenizer.eos_token_id],
                                 **settings)
        made.append(factory)
        return factory

    yield make
    for factory in made:
        factory.close()


def slow(tag: str) -> StructuredOutputsParams:
    """A choice that compiles for minutes (``tag`` makes it a grammar of its own)."""
    return StructuredOutputsParams(choice=[tag, *SLOW_CHOICES])


def regex(text: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=text)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + PATIENT_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Caller(threading.Thread):
    """``fn()`` on a thread of its own; ``.outcome`` is its result or exception."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.outcome: object = None

    def run(self) -> None:
        try:
            self.outcome = self.fn()
        except BaseException as err:  # noqa: BLE001 - the test reads it
            self.outcome = err


def start(fn) -> Caller:
    caller = Caller(fn)
    caller.start()
    return caller


def test_cache_hits_and_another_clients_compile_do_not_wait_for_a_slow_compile(factory_of):
    grammars = factory_of(compile_workers=2)
    cached = grammars.compile(regex("(ab)+"), client="b")  # also starts the compile process
    pool = grammars.compile_pool

    first = start(lambda: grammars.compile(slow("a1"), client="a"))
    wait_until(lambda: len(pool.running_pids()) == 1, "the slow compile runs")
    slow_pid = pool.running_pids()[0]

    # Another client's new grammar compiles on the other worker, beside the slow one.
    fresh = grammars.compile(regex("(cd)+"), client="b")
    assert fresh.key == ("regex", "(cd)+")
    assert first.is_alive() and pool.running_pids() == [slow_pid]

    # Both workers busy with one client's slow compiles: a cache hit still returns.
    second = start(lambda: grammars.compile(slow("a2"), client="a"))
    wait_until(lambda: len(pool.running_pids()) == 2, "both slow compiles run")
    running = sorted(pool.running_pids())
    assert grammars.compile(regex("(ab)+"), client="c") is cached
    assert grammars.compile({"regex": "(cd)+"}) is fresh
    assert first.is_alive() and second.is_alive()
    assert sorted(pool.running_pids()) == running  # still compiling when the hits returned


def test_a_compile_that_times_out_is_killed_and_its_worker_reused(factory_of):
    grammars = factory_of(compile_workers=1, compile_timeout_s=3.0)
    grammars.compile(regex("(ab)+"))  # the compile process is up: only the compile is timed
    pool = grammars.compile_pool

    caller = start(lambda: grammars.compile(slow("a"), client="a"))
    wait_until(pool.running_pids, "the slow compile runs")
    (slow_pid,) = pool.running_pids()
    caller.join(PATIENT_S)
    assert isinstance(caller.outcome, ValueError)
    assert "took longer than 3 s to compile" in str(caller.outcome)

    wait_until(lambda: not alive(slow_pid), "the timed-out compile's process is gone")
    # The only worker takes the next compile (on the old thread pool it was still busy).
    assert grammars.compile(regex("(cd)+"), client="b").key == ("regex", "(cd)+")
    assert pool.running_pids() == []


def test_one_clients_backlog_does_not_starve_another_client(factory_of):
    grammars = factory_of(compile_workers=1)
    grammars.compile(regex("(ab)+"))
    pool = grammars.compile_pool
    key = grammars.backend.cache_key

    # Client a: one compile that gives up soon, and a backlog of slow ones queued behind it.
    head = start(lambda: pool.compile(key(slow("a0")), "a", timeout_s=6.0))
    wait_until(pool.running_pids, "a's first compile runs")
    backlog = [start(lambda tag=tag: pool.compile(key(slow(tag)), "a", timeout_s=PATIENT_S))
               for tag in ("a1", "a2", "a3")]
    wait_until(lambda: pool.num_queued("a") == 3, "a's backlog is queued")

    # Client b's compile, queued after all of a's, runs as soon as a's first one ends.
    serialized = pool.compile(key(regex("(cd)+")), "b", timeout_s=PATIENT_S)
    assert isinstance(serialized, str)
    head.join(PATIENT_S)
    assert isinstance(head.outcome, CompileTimeout)
    assert pool.num_queued("a") >= 2  # a's backlog had to wait for b
    assert all(caller.is_alive() for caller in backlog)


def test_one_client_may_not_queue_more_than_its_limit(factory_of):
    grammars = factory_of(compile_workers=1, max_pending_compiles_per_client=2)
    grammars.compile(regex("(ab)+"))
    callers = [start(lambda tag=tag: grammars.compile(slow(tag), client="a"))
               for tag in ("a1", "a2")]
    pool = grammars.compile_pool
    wait_until(lambda: pool.running_pids() and pool.num_queued("a") == 1, "a has two pending")
    with pytest.raises(ValueError, match=r"client 'a' already has 2 grammars compiling or "
                                         r"queued, the most one client may have \(2\)"):
        grammars.compile(slow("a3"), client="a")
    # The same grammar again joins the pending compile instead of counting twice; and
    # when this caller gives up, the compile runs on for the caller still waiting.
    (running,) = pool.running_pids()
    grammars.compile_timeout_s = 0.5
    with pytest.raises(ValueError, match="took longer than 0.5 s"):
        grammars.compile(slow("a1"), client="a")
    assert pool.running_pids() == [running] and alive(running)
    grammars.close()
    for caller in callers:
        caller.join(PATIENT_S)
        assert isinstance(caller.outcome, ValueError), caller.outcome
        assert "shutting down" in str(caller.outcome)


def test_close_returns_while_a_compile_runs_and_ends_its_processes(factory_of):
    grammars = factory_of(compile_workers=1)
    grammars.compile(regex("(ab)+"))
    pool = grammars.compile_pool
    running = start(lambda: grammars.compile(slow("a"), client="a"))
    wait_until(pool.running_pids, "a's compile runs")
    queued = start(lambda: grammars.compile(slow("b"), client="b"))
    wait_until(lambda: pool.num_queued("b") == 1, "b's compile waits")
    (child,), server = pool.running_pids(), pool.server_pid

    grammars.close()  # returns at once: PATIENT_S is far below the compile's minutes
    for caller in (running, queued):
        caller.join(PATIENT_S)
        assert not caller.is_alive()
        assert isinstance(caller.outcome, ValueError) and "shutting down" in str(caller.outcome)
    wait_until(lambda: not alive(child) and not alive(server), "the compile processes end")
    with pytest.raises(ValueError, match="shutting down"):
        grammars.compile(regex("(never)+"))
    with pytest.raises(CompilePoolClosed):
        pool.compile(("regex", "(never)+"), timeout_s=1.0)


def test_a_huge_choice_is_refused_before_any_compile(tokenizer):
    grammars = GrammarFactory(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=r"structured_outputs.choice has 300000 options, "
                                         r"more than the 1000 allowed"):
        grammars.compile(StructuredOutputsParams(choice=SLOW_CHOICES))
    long_regex = "a" * (grammars.max_constraint_chars + 1)
    with pytest.raises(ValueError, match=r"structured_outputs.regex is 1000001 characters "
                                         r"long, more than the 1000000 allowed"):
        grammars.compile(regex(long_regex))
    assert grammars._pool is None  # nothing was compiled, no process started


def test_the_queue_serves_the_client_served_least_recently():
    from llmlab.sampling.compile_pool import CompileJob, FairQueue

    queue, ids = FairQueue(), iter(range(100))

    def job(client):
        queued = CompileJob(next(ids), ("regex", str(client)), client)
        queue.push(queued)
        return queued

    a1 = job("a")
    assert queue.pop() is a1  # a runs; its backlog and then b's one compile arrive
    a2, a3, b1 = job("a"), job("a"), job("b")
    assert [queue.pop() for _ in range(3)] == [b1, a2, a3]
    assert queue.pending("a") == 3 and queue.pending("b") == 1
    for done in (a1, a2, a3, b1):
        queue.release(done)
    assert queue.pending("a") == 0 and not queue


def test_lookup_answers_from_the_cache_and_never_compiles(tokenizer):
    from llmlab.sampling.structured import StructuredOutputBackend

    backend = StructuredOutputBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert backend.lookup(regex("(ab)+")) is None
    assert backend.cache_info().currsize == 0
    compiled = backend.compile(regex("(ab)+"))
    assert backend.lookup({"regex": "(ab)+"}) is compiled
    assert backend.lookup(backend.cache_key(regex("(ab)+"))) is compiled


def test_a_live_requests_grammar_survives_eviction_so_its_row_never_compiles(tiny_llama):
    """A client sending many other grammars evicts a queued request's grammar from the
    cache; when its row starts (on the engine's loop) the grammar is still there, pinned
    to the request's own parameters, so nothing compiles on the loop. Once those
    parameters are gone, so is the pin."""
    import gc

    from llmlab import LLM

    engine = LLM(tiny_llama, dtype="float32").llm_engine
    grammars = engine.inputs.grammars
    grammars.backend.max_cache_entries = 2
    victim = StructuredOutputsParams(regex="(ab)+c")
    grammars.compile(victim, client="victim")
    for i in range(4):  # the attacker's grammars push the victim's out of the cache
        grammars.compile(StructuredOutputsParams(regex=f"(x{i})+"), client="attacker")
    assert grammars.backend.lookup(grammars.backend.cache_key(victim)) is None
    grammars.close()  # from here any compile is refused: only the pin can answer
    state = grammars.new_state(victim)
    assert not state.is_terminated  # a matcher of the victim's grammar, made without compiling
    del victim, state
    gc.collect()
    with pytest.raises(ValueError, match="shutting down"):
        grammars.new_state(StructuredOutputsParams(regex="(ab)+c"))
