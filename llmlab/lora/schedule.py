"""LoRA's scheduler plugin (:mod:`llmlab.plugin`, named ``lora``): the adapter limit, and
each new row's adapter.

At most ``max_loras`` distinct adapters run at once (so in any step): a waiting request
whose adapter would exceed it is handed back like one that does not fit, and admission
stops there until a running adapter's requests finish (FCFS order keeps it from
starving); nothing is preempted for it. A row's first entry carries its request's
:class:`~llmlab.lora.request.LoRARequest` (plain data: name, id, path) in the side map;
the runner side (:class:`~llmlab.lora.slots.LoRASlots`) keeps it per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from llmlab.plugin import SchedulerPlugin, StepPlan


@attrs.define
class LoRASchedule(SchedulerPlugin):
    """See the module docstring."""

    name = "lora"

    max_loras: int

    def admissible(self, request: Any, running: Sequence[Any]) -> bool:
        lora = request.lora_request
        if lora is None:
            return True
        ids = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        return lora.lora_int_id in ids or len(ids) < self.max_loras

    def plan(self, step: StepPlan) -> dict[str, Any]:
        side = {}
        for entry in step.entries:
            if entry.setup is not None:
                lora = step.requests[entry.request_id].lora_request
                if lora is not None:
                    side[entry.request_id] = lora
        return side

    def plans_ahead(self, batch: Any) -> bool:
        return True  # a row's adapter is fixed at its setup: nothing waits on outputs
