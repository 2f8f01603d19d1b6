"""Hold Ctrl-C back while the engine's bookkeeping is half done.

A ``KeyboardInterrupt`` can land between any two bytecodes. Inside the model's forward pass
that is harmless (nothing is committed until the step's update), but inside the scheduler
or the KV cache manager it could leave a request half moved between queues or a block
counted twice. :func:`deferred_interrupts` keeps SIGINT pending for the few microseconds of
such a section and delivers it right after, so an interrupt always sees a consistent engine.
"""

from __future__ import annotations

import _signal
import contextlib
import signal
import threading
from collections.abc import Iterator

# ``signal.signal`` converts every handler it returns to an enum, which costs more than the
# rest of this section; the C function underneath takes and returns the same handlers.
_set_handler = _signal.signal


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Delay SIGINT until the block exits (a no-op off the main thread, where no signal
    handler runs anyway). Nested sections deliver the interrupt when the outermost exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = _set_handler(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:  # signals unavailable here (e.g. an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        _set_handler(signal.SIGINT, previous)
        if received:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
