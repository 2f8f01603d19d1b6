"""How many CPU threads llmlab's torch and OpenMP work may use, and how waiting threads wait.

Torch sizes its intra-op pool from the machine's cores, not from the cores this process may
actually run on (CPU affinity, a container's CPU quota), and its OpenMP threads spin while
they wait for work. When cores are shared, by a second process or by llmlab's own server
and worker processes, a spinning thread holds a core that the thread everyone is waiting
for needs: one 8 x 64-token generation on a busy 2-core machine ran 20-40x slower than on an
idle one. So llmlab

* counts the cores it may use (:func:`available_cpus`: affinity and cgroup quota),
* gives torch at most that many threads (never more than torch had: a lower
  ``torch.set_num_threads`` stands), one fewer for each other task the machine is running
  (:class:`ThreadGovernor`, re-checked every couple of seconds), or exactly the user's
  choice (``LLM(..., cpu_threads=N)`` or the ``LLMLAB_CPU_THREADS`` environment variable;
  ``OMP_NUM_THREADS`` is respected as set), split between the processes llmlab starts
  itself (:func:`child_env`), and
* makes idle OpenMP threads sleep after a short spin instead of spinning for long
  (:data:`SPIN_COUNT`), unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is already set.

The wait policy is read by the OpenMP runtime when torch is first imported, so it takes
effect only when ``llmlab`` is imported before ``torch`` (the ``llmlab`` command always
is); set ``GOMP_SPINCOUNT`` yourself when your program imports torch first.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import attrs

ENV_THREADS = "LLMLAB_CPU_THREADS"
# libgomp's spin before a waiting thread sleeps: its default is 300,000 iterations
# (milliseconds of a held core per wait); this is tens of microseconds, enough to catch the
# next parallel region of a decode step without holding a core that another process needs.
SPIN_COUNT = "10000"


def set_wait_policy(environ: dict | None = None) -> None:
    """Make OpenMP threads sleep soon when idle, unless the user chose a policy already.

    Must run before torch loads the OpenMP runtime (``llmlab/__init__`` calls it first).
    """
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" not in env and "GOMP_SPINCOUNT" not in env:
        env["GOMP_SPINCOUNT"] = SPIN_COUNT


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def cgroup_cpus(root: str = "/sys/fs/cgroup") -> float | None:
    """The CPU quota of this process's cgroup in cores (cgroup v2 ``cpu.max``, else the v1
    CFS files), or None when there is none."""
    try:
        quota, period = _read(f"{root}/cpu.max").split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(_read(f"{root}/cpu/cpu.cfs_quota_us"))
        period = int(_read(f"{root}/cpu/cpu.cfs_period_us"))
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpus()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive int, got {value!r}") from None
    if number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return number


def resolve_threads(cpu_threads: int | None = None, environ: dict | None = None) -> int | None:
    """The torch thread count to use: ``cpu_threads`` if given, else ``LLMLAB_CPU_THREADS``,
    else None when ``OMP_NUM_THREADS`` is set (the user chose; torch already follows it),
    else :func:`available_cpus`. Raises for a value that is not a positive int."""
    env = os.environ if environ is None else environ
    if cpu_threads is not None:
        return _positive_int("cpu_threads", cpu_threads)
    if env.get(ENV_THREADS):
        return _positive_int(ENV_THREADS, env[ENV_THREADS])
    if env.get("OMP_NUM_THREADS"):
        return None
    return available_cpus()


def runnable_elsewhere(samples: int = 5, interval: float = 0.002) -> int:
    """Tasks the machine is running or has queued besides the caller: the fewest over a
    few samples of ``/proc/loadavg``'s instantaneous count (a blip is not contention).
    0 where that file does not exist."""
    fewest = None
    for i in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        fewest = running if fewest is None else min(fewest, running)
        if fewest <= 1 or i == samples - 1:
            break
        time.sleep(interval)
    return max(0, (fewest or 1) - 1)  # minus the reader itself


@attrs.define(eq=False)
class ThreadGovernor:
    """Keeps torch's thread count at ``ceiling`` minus the other tasks competing for the
    cores (at least one thread), re-checked at most every ``period`` seconds.

    A parallel region waits for its slowest thread; a thread that shares its core with
    another process runs in slices, so on a busy machine fewer threads finish sooner
    (measured: BENCHMARKS.md, "CPU threads under contention").
    """

    ceiling: int
    period: float = 2.0
    count: Callable[[], int] = runnable_elsewhere
    _last: float = attrs.field(init=False, default=float("-inf"))

    def tick(self, now: float | None = None) -> int:
        """Adjust if the period has passed; returns the thread count in effect."""
        import torch

        now = time.monotonic() if now is None else now
        if now - self._last >= self.period:
            self._last = now
            threads = max(1, self.ceiling - self.count())
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return torch.get_num_threads()


def configure_threads(cpu_threads: int | None = None) -> ThreadGovernor | None:
    """Set torch's intra-op thread count for an engine; process-wide, like torch's own
    setting. Explicit counts (``cpu_threads``, ``LLMLAB_CPU_THREADS``) are set as given and
    ``OMP_NUM_THREADS`` is left alone: both return None. Otherwise the count is capped at the
    usable cores and follows contention: the returned :class:`ThreadGovernor`, which the
    model runner ticks before each step."""
    import torch

    threads = resolve_threads(cpu_threads)
    if threads is None:  # OMP_NUM_THREADS set: torch already follows the user's choice
        return None
    if cpu_threads is None and not os.environ.get(ENV_THREADS):  # automatic: the usable cores
        governor = ThreadGovernor(ceiling=min(torch.get_num_threads(), threads))
        governor.tick()
        return governor
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return None


def child_env(num_children: int, environ: dict | None = None, threads: int | None = None) -> dict:
    """Environment for one of ``num_children`` processes llmlab starts that share this
    machine's cores: each gets an equal share (at least one thread) through both
    ``LLMLAB_CPU_THREADS`` and ``OMP_NUM_THREADS``, and the wait policy. ``threads``
    overrides the share."""
    env = dict(os.environ if environ is None else environ)
    if threads is None:
        threads = max(1, available_cpus() // max(1, num_children))
    threads = _positive_int("threads", threads)
    env[ENV_THREADS] = env["OMP_NUM_THREADS"] = str(threads)
    set_wait_policy(env)
    return env
