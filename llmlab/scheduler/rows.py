"""Scheduler rows: the stable slot each admitted request holds in ``[0, max_num_seqs)``,
taken at admission (lowest free first), released when it finishes, is preempted or
aborted, and reported in the next batch's ``freed_rows`` before reuse. Rows for parallel
samples are reserved at admission; those never forked go back unreported."""

from __future__ import annotations

import heapq


class Rows:
    """Free, reserved and released rows of one scheduler."""

    def __init__(self, num_rows: int) -> None:
        self._free = list(range(num_rows))  # a heap: lowest row first
        self._released: list[int] = []
        self._reserved: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return heapq.heappop(self._free)

    def reserve(self, request_id: str, count: int) -> None:
        """Hold ``count`` rows for the parallel samples ``request_id`` will fork into."""
        self._reserved[request_id] = [heapq.heappop(self._free) for _ in range(count)]

    def reserved(self, request_id: str) -> list[int]:
        return self._reserved[request_id]

    def take_reserved(self, request_id: str) -> list[int]:
        return self._reserved.pop(request_id)

    def release(self, row: int | None, request_id: str) -> None:
        """Free a request's row (reported to executors) and any rows reserved for it."""
        if row is not None:
            heapq.heappush(self._free, row)
            self._released.append(row)
        for spare in self._reserved.pop(request_id, ()):
            heapq.heappush(self._free, spare)

    def drain_released(self) -> tuple[int, ...]:
        """Rows released since the last call (the next batch's ``freed_rows``)."""
        released, self._released = tuple(self._released), []
        return released
