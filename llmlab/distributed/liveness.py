"""Is a data-parallel replica answering? Heartbeats against a deadline.

A hung replica is a dead replica, for as long as it hangs. Each replica process sends a
:class:`~llmlab.distributed.replica_process.Heartbeat` every ``interval`` seconds from a
thread of its own (:func:`heartbeat_interval`), idle or busy. The front end keeps a
:class:`Liveness` per replica, fed every message it reads from it, and asks it for a
:meth:`~Liveness.verdict`:

* ``"silent"``: nothing for more than ``heartbeat_timeout_s``. SIGSTOP stops every thread,
  so a stopped (or starved, or GIL-bound) replica goes silent.
* ``"wedged"``: it still beats, but its engine loop has been in one pass (a step, or
  applying commands) for more than ``wedged_after_s``: the process runs, the engine does
  not progress.

The front end judges from a thread of its own (:class:`Monitor`), so a replica is found
out whether or not anyone is stepping the engine, and always reads what the replica sent
before judging it: silence is measured from the last message read, and a front end that
was itself slow to read does not blame the replica.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import attrs

from llmlab.distributed.replica_process import Heartbeat

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 10.0
# As AsyncEngine.wedged_after_s: a first step may compile kernels or capture graphs.
DEFAULT_WEDGED_AFTER_S = 60.0


def heartbeat_interval(heartbeat_timeout_s: float) -> float:
    """How often a replica beats (and the front end looks): four beats per deadline, at
    most one a second."""
    return min(1.0, heartbeat_timeout_s / 4)


@attrs.define
class Liveness:
    """What the front end has heard from one replica (times on the front end's clock).

    Attributes:
        heartbeat_timeout_s / wedged_after_s: the deadlines.
        last_heard: when a message from it was last read.
        stuck_s: its latest heartbeat's stall (how long its loop had been in one pass).
        in_step: whether that pass was a step.
    """

    heartbeat_timeout_s: float
    wedged_after_s: float
    last_heard: float
    stuck_s: float = 0.0
    in_step: bool = False

    def heard(self, now: float, message: Any) -> None:
        """A message from the replica was read at ``now``: a heartbeat says how its loop
        is doing; any other message (a step's report) shows the loop went round."""
        self.last_heard = now
        if isinstance(message, Heartbeat):
            self.stuck_s, self.in_step = message.stuck_s, message.in_step
        else:
            self.stuck_s, self.in_step = 0.0, False

    def verdict(self, now: float) -> str | None:
        """``"silent"``, ``"wedged"``, or None while it answers."""
        if now - self.last_heard > self.heartbeat_timeout_s:
            return "silent"
        if self.stuck_s > self.wedged_after_s:
            return "wedged"
        return None

    def describe(self, verdict: str, now: float) -> str:
        """Why it is unresponsive now, in words (after the replica's name)."""
        if verdict == "silent":
            return (f"no heartbeat for {now - self.last_heard:.1f} s "
                    f"(replica_heartbeat_timeout_s={self.heartbeat_timeout_s:g})")
        where = "its current step" if self.in_step else "its engine loop's current pass"
        return (f"wedged: {where} has run for {self.stuck_s:.1f} s "
                f"(replica_wedged_after_s={self.wedged_after_s:g})")


class Monitor:
    """Calls ``check()`` on the engine every ``interval`` seconds from a daemon thread,
    holding only a weak reference to it (the engine can still be garbage collected);
    :meth:`stop` ends it."""

    def __init__(self, engine: Any, check: Callable[[Any], None], interval: float) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_watch, args=(weakref.ref(engine), check, interval, self._stop),
            name="llmlab-dp-liveness", daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def _watch(ref: weakref.ref, check: Callable[[Any], None], interval: float,
           stop: threading.Event) -> None:
    while not stop.wait(interval):
        engine = ref()
        if engine is None:
            return
        try:
            check(engine)
        except Exception:  # noqa: BLE001 - keep watching; the next look may go better
            logger.exception("checking the data-parallel replicas' heartbeats failed")
        del engine
