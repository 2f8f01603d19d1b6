"""llmlab.threads: usable cores, the thread count's precedence, following contention, the
OpenMP wait policy, and the share each child process gets."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from llmlab import LLM, threads


@pytest.fixture(autouse=True)
def _restore_torch_threads(monkeypatch):
    for name in (threads.ENV_THREADS, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cgroup_quota_v2_v1_and_none(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpus(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpus(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpus(str(tmp_path)) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpus(str(tmp_path)) is None


def test_available_cpus_is_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: None)
    assert threads.available_cpus() == 4
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: 1.5)  # 1.5 cores: 2 threads
    assert threads.available_cpus() == 2
    monkeypatch.setattr(threads, "cgroup_cpus", lambda: 0.2)
    assert threads.available_cpus() == 1


def test_precedence_argument_then_llmlab_variable_then_omp_then_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 6)
    env = {}
    assert threads.resolve_threads(None, env) == 6
    env["OMP_NUM_THREADS"] = "3"
    assert threads.resolve_threads(None, env) is None  # the user's OMP setting stands
    env[threads.ENV_THREADS] = "2"
    assert threads.resolve_threads(None, env) == 2
    assert threads.resolve_threads(5, env) == 5


@pytest.mark.parametrize("value", ["zero", "0", "-2", "1.5"])
def test_a_bad_thread_count_names_the_variable_and_value(value):
    with pytest.raises((TypeError, ValueError), match=f"LLMLAB_CPU_THREADS.*{value}"):
        threads.resolve_threads(None, {threads.ENV_THREADS: value})


def test_llm_cpu_threads_sets_torch_and_is_checked(tiny_llama):
    LLM(tiny_llama, device="cpu", dtype="float32", cpu_threads=1)
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError, match="cpu_threads.*0"):
        LLM(tiny_llama, device="cpu", cpu_threads=0)


def test_automatic_count_follows_contention_within_its_ceiling(monkeypatch):
    others = iter([0, 1, 3, 0])
    governor = threads.ThreadGovernor(ceiling=2, period=1.0, count=lambda: next(others))
    assert governor.tick(now=0.0) == 2  # idle: every usable core
    assert governor.tick(now=0.5) == 2  # within the period: not re-checked
    assert governor.tick(now=1.0) == 1  # one other task: one thread fewer
    assert governor.tick(now=2.0) == 1  # never below one
    assert governor.tick(now=3.0) == 2  # contention gone: back up


def test_configure_never_raises_the_count_and_explicit_counts_have_no_governor(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    monkeypatch.setattr(threads, "runnable_elsewhere", lambda: 0)
    torch.set_num_threads(1)  # set by the user before building an engine: it stands
    governor = threads.configure_threads()
    assert governor is not None and governor.ceiling == 1
    assert threads.configure_threads(2) is None and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.configure_threads() is None and torch.get_num_threads() == 2


def test_the_engine_ticks_the_governor_before_each_step(tiny_llama, monkeypatch):
    from llmlab import SamplingParams

    llm = LLM(tiny_llama, device="cpu", dtype="float32")
    runner = llm.llm_engine.executor
    assert isinstance(runner.threads, threads.ThreadGovernor)
    checks = []
    runner.threads.period = 0.0  # re-check every step
    runner.threads.count = lambda: checks.append(1) or 1  # one other task running
    llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(checks) >= 3
    assert torch.get_num_threads() == max(1, runner.threads.ceiling - 1)


def test_wait_policy_is_set_unless_the_user_chose_one():
    env = {}
    threads.set_wait_policy(env)
    assert env == {"GOMP_SPINCOUNT": threads.SPIN_COUNT}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "5"}):
        env = dict(chosen)
        threads.set_wait_policy(env)
        assert env == chosen


def test_importing_llmlab_sets_the_policy_before_torch_loads():
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, llmlab, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.strip() == threads.SPIN_COUNT, done.stderr


def test_children_split_the_cores(monkeypatch):
    monkeypatch.setattr(threads, "available_cpus", lambda: 8)
    env = threads.child_env(3, environ={})
    assert env[threads.ENV_THREADS] == env["OMP_NUM_THREADS"] == "2"
    assert env["GOMP_SPINCOUNT"] == threads.SPIN_COUNT
    assert threads.child_env(16, environ={})[threads.ENV_THREADS] == "1"
    assert threads.child_env(2, environ={}, threads=3)["OMP_NUM_THREADS"] == "3"
