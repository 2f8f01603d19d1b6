"""Request intake: adding, preparing and aborting requests (a mixin of
:class:`~llmlab.engine.engine.Engine`, kept in its own file so the step reads on its own).

Input processing (:mod:`llmlab.engine.inputs`) checks and tokenizes a request without
touching engine state, so a front end may run it off the engine's loop; queueing it, and
aborting, take the engine's lock with Ctrl-C deferred, so a request is either fully added
(its sample group, output state, the scheduler's queue) or not at all.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

from llmlab.engine.inputs import PreparedRequest, PromptType
from llmlab.engine.interrupts import deferred_interrupts
from llmlab.errors import raise_first
from llmlab.observe.events import Arrival
from llmlab.pooling_params import PoolingParams
from llmlab.request import Request
from llmlab.sampling.params import SamplingParams
from llmlab.validation import as_request_ids


class Intake:
    """Adding and aborting requests (see the module docstring)."""

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
    ) -> None:
        """Queue a request (:meth:`add_prepared_request` of :meth:`prepare_request`).
        Raises ``TypeError``/``ValueError`` (and queues nothing) on bad input.

        ``prompt`` is a string, ``{"prompt": str}``, ``{"prompt_token_ids": [...]}`` or a
        sequence of token ids (list, tuple, numpy array or 1-D torch tensor).
        ``priority``: lower is served first by policies that read it (vLLM's semantics).
        ``user``: who sent it; per-user policies such as ``fair`` share service by user.
        ``params``: ``SamplingParams`` on a generating engine; ``PoolingParams`` on a
        pooling one (``runner="pooling"``; None: the model's default task), whose output
        is a :class:`~llmlab.engine.outputs.PoolingRequestOutput` (vLLM's).
        ``lora_request``: a :class:`~llmlab.lora.request.LoRARequest` to run the request
        with that adapter (the engine needs ``enable_lora=True``), or None.
        """
        prepared = self.prepare_request(
            request_id, prompt, params, arrival_time, priority, user, lora_request=lora_request
        )
        self.add_prepared_request(prepared)

    def prepare_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        user: str | None = None,
        lora_request: Any = None,
        client: Hashable = None,
    ) -> PreparedRequest:
        """Check and tokenize a request without queueing it (same arguments and errors as
        :meth:`add_request`).

        It reads no state that steps change, so it may run in another thread while the
        engine steps: front ends (the :class:`~llmlab.entrypoints.async_engine.AsyncEngine`)
        tokenize and compile grammars here, off the engine's loop. ``client``: who sent
        it, as the front end knows (the server: the peer's address); grammar compiles
        queue fairly per client (default: ``user``).
        """
        return self.inputs.prepare(
            request_id, prompt, params, arrival_time, priority, user, self.clock(),
            lora_request=lora_request, client=client,
        )

    def add_prepared_request(self, prepared: PreparedRequest) -> None:
        """Queue a request checked by :meth:`prepare_request`. Raises ``ValueError`` (and
        queues nothing) when its id is already in use."""
        if not isinstance(prepared, PreparedRequest):
            raise TypeError(
                f"expected a PreparedRequest (from prepare_request), got {type(prepared).__name__}"
            )
        with self._lock, deferred_interrupts():
            members = self.inputs.requests(prepared)
            ids = {prepared.request_id, *(m.request_id for m in members)}
            taken = [i for i in ids if i in self._requests or i in self._groups]
            if taken:
                raise ValueError(f"request_id {taken[0]!r} is already in use")
            for member in members:
                self._requests[member.request_id] = member
                self.outputs.add(member)
            if members[0].group is not None:
                self._groups[prepared.request_id] = members[0].group
            self.scheduler.add(members[0])
            self._arrived_since_step.append(Arrival.of(prepared))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are and free their KV blocks. Unknown ids are ignored."""
        ids = as_request_ids(request_id)
        with self._lock:
            with deferred_interrupts():
                for group_id in ids & self._groups.keys():
                    group = self._groups.pop(group_id)
                    ids.update(m.request_id for m in group.members)
                for request in self.scheduler.abort(ids):
                    self._aborted_since_step.append(request.request_id)
                    for member in self._drop_forks(request):
                        self._aborted_since_step.append(member.request_id)
                    self._forget(request)
                errors = self.scheduler.take_errors()
            raise_first(errors)

    def _drop_forks(self, request: Request):
        """A request ended before its parallel samples forked: they end with it."""
        for member in self.scheduler.drop_forks(request):
            self._forget(member)
            yield member

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is queued or running (so it cannot be reused yet)."""
        return request_id in self._requests or request_id in self._groups
