"""Logits processors that slow or wedge a replica's steps, for the hung-replica tests.

They travel to replica processes inside requests (pickled by reference), so they live in
this small module: a replica imports it, not the test module and its fixtures.
"""

from __future__ import annotations

import os
import time


class Slow:
    """Sleeps ``seconds`` each time it is called: a request that takes a while to finish."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, output_token_ids, logits):
        time.sleep(self.seconds)
        return logits


class WedgeIn:
    """Sleeps ``seconds`` before the first token of its request, in process ``pid`` only:
    that replica's step runs that long (its heartbeat thread still beats); anywhere else
    the request runs as usual."""

    def __init__(self, pid: int, seconds: float) -> None:
        self.pid = pid
        self.seconds = seconds

    def __call__(self, output_token_ids, logits):
        if os.getpid() == self.pid and not output_token_ids:
            time.sleep(self.seconds)
        return logits
