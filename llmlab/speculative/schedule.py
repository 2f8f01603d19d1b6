"""Speculative decoding's scheduler plugin (:mod:`llmlab.plugin`, named ``speculation``):
each step, the length policy gives every running decode a lookahead ``k`` (the most draft
tokens the executor may propose and verify after its token); the scheduler reserves them.

A request with a grammar decodes plainly (its drafts would need the grammar's mask per
draft position). The length policy is user code: an exception or an answer that is not
one int in ``[0, num_speculative_tokens]`` per decode is a
:class:`~llmlab.errors.ComponentError` (the step runs without drafts; the engine raises
it after the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from llmlab.errors import ComponentError
from llmlab.plugin import SchedulerPlugin
from llmlab.scheduler.policy import views


@attrs.define
class SpeculationSchedule(SchedulerPlugin):
    """Asks the length policy (:class:`~llmlab.speculative.length.SpeculationLength`) for
    each decode's lookahead."""

    name = "speculation"

    length: Any

    def lookahead(self, decodes: Sequence[Any], num_running: int) -> list[int] | None:
        chosen = [i for i, r in enumerate(decodes) if r.sampling_params.structured_outputs is None]
        if not chosen:
            return None
        policy = self.length
        try:
            answer = list(policy.lengths(views([decodes[i] for i in chosen]), num_running))
        except Exception as err:
            raise ComponentError.wrap("speculation length", policy, "lengths", err) from err
        k_max = policy.num_speculative_tokens
        if len(answer) != len(chosen) or not all(
            isinstance(k, int) and 0 <= k <= k_max for k in answer
        ):
            raise ComponentError(
                "speculation length", policy, "lengths",
                f"returned {answer!r}, which is not one int in [0, {k_max}] per candidate",
            )
        lengths = [0] * len(decodes)
        for i, k in zip(chosen, answer, strict=True):
            lengths[i] = k
        return lengths
