"""What the scheduler records for observers alongside a batch (the step events read it;
executors need not)."""

from __future__ import annotations

import attrs


@attrs.frozen
class Admission:
    """A request admitted to running in a step (first time, or resumed after preemption).

    Attributes:
        request_id: the request.
        arrival_time: when it was added (the engine clock), for queueing-time metrics.
        num_prompt_tokens: its prompt length.
        num_queried_tokens: tokens looked up in the prefix cache at admission (0 when no
            lookup ran: prefix caching off, or prompt logprobs asked for).
        num_cached_tokens: how many of them were found there (not computed again).
        resumed: whether it was preempted before (its KV is being recomputed, or swapped
            back in).
        num_offloaded_tokens: of ``num_cached_tokens``, those found in the prefix cache's
            second tier (loaded back this step); the rest were on the device.
        num_swapped_tokens: tokens whose KV was swapped back in (a request preempted by
            swapping resumes where it stopped; 0 otherwise).
    """

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_queried_tokens: int
    num_cached_tokens: int
    resumed: bool = False
    num_offloaded_tokens: int = 0
    num_swapped_tokens: int = 0
