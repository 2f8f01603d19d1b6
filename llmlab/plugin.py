"""Feature plugins: what a feature adds to a step, on the scheduler's side and the runner's.

A feature (LoRA, pooling, a KV press, speculation's lookahead, a stop rule of your own)
plugs into the engine instead of being threaded through it, with up to two sides linked by
its ``name``:

* a :class:`SchedulerPlugin`, next to the scheduler: it sees live requests, keeps its own
  per-request state (by request id), may hold a waiting request back, plans its part of
  each step as a *side map* (request id -> plain, picklable data, in
  ``ScheduledBatch.sides[name]``) and commits what the step returned
  (``BatchOutput.sides[name]``, one item per entry);
* a :class:`RunnerPlugin`, beside the model runner on every tensor-parallel rank: per-row
  state (started on a row's first entry, dropped when the row is freed or a failed step
  resets the runner), work before and after the forward.

Every hook has a do-nothing default; both sides bind through one hook, ``bind``. The core
never names a feature. The failure rule (docs/components.md): a scheduler-side hook that
raises is recorded and answers its neutral default (the step goes on, the engine raises a
``ComponentError`` naming the plugin and hook after it: ``scheduler/guard.py``); a
runner-side one fails the step like any executor error (rows reset, the step scheduled
again). Trouble with one request should end that request instead (a stop reason from
``commit``, a per-entry failure from ``after_forward``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

if TYPE_CHECKING:  # annotations only: this module sits below the scheduler and runner
    from llmlab.request import Request


class SchedulerPlugin:
    """A feature's scheduler side (see the module docstring). Subclass it and override
    the hooks the feature needs; ``name`` keys its side maps and must be unique."""

    name: ClassVar[str] = "plugin"

    def bind(self, scheduler: Any) -> None:
        """Once, when the engine is assembled: the scheduler (read its ``kv``,
        ``max_num_seqs``, ``max_model_len``; do not call its methods)."""

    def added(self, request: Request) -> None:
        """A new request was queued (start its per-request state here)."""

    def admissible(self, request: Request, running: Sequence[Request]) -> bool:
        """Whether the waiting ``request`` may be admitted next to ``running`` now. False
        hands it back and stops admission for this step (it keeps its place)."""
        return True

    def lookahead(self, decodes: Sequence[Request], num_running: int) -> Sequence[int] | None:
        """For the running decodes (one new token each this step, in order), the most extra
        tokens the executor may compute after each one's token (speculative drafts: ints
        >= 0), or None. The scheduler trims them to each request's length limits and
        reserves what the step leaves (budget and KV blocks, never preempting): the
        entry's ``num_lookahead``. Raise ``ComponentError`` for a bad answer of user code
        (the step then runs without lookahead, and the error is raised after it)."""
        return None

    def prefix_limit(self, request: Request) -> int | None:
        """The most prompt tokens a prefix-cache hit may cover for ``request`` (None: no
        limit; 0: no hit at all)."""
        return None

    def plan(self, step: StepPlan) -> Mapping[str, Any] | None:
        """This feature's data for the entries of ``step``: request id -> plain data, or
        None. Called twice per step: for the running requests' entries (before
        admission) and for the admitted ones' (after it)."""
        return None

    def check(self, batch: Any, output: Any) -> None:
        """Raise ``ValueError`` unless ``output`` (a
        :class:`~llmlab.scheduler.batch.BatchOutput`) answers this feature's part of
        ``batch`` (its ``sides[name]``); called before anything is committed."""

    def settle(self, request: Request, sent: Any, returned: Any) -> None:
        """After a step, before the entry's tokens are appended and before its parallel
        samples fork, for an entry this feature sent data for (``sent``: its side map's
        item) or got data back for (``returned``: the output side's item): apply what the
        step did to the request's KV (e.g. a compaction)."""

    def commit(self, request: Request, sent: Any, returned: Any) -> str | bool | None:
        """After an entry's tokens were appended, the request still running (called for
        every such entry, only on plugins that override it): a reason to stop the request
        now (a string: it finishes as stopped with that ``stop_reason``; True: stopped
        without one), or None to go on."""
        return None

    def forked(self, leader: Request, member: Request) -> None:
        """A parallel sample started from ``leader`` (copy per-request state)."""

    def recompute_only(self, request: Request) -> bool:
        """Whether a preempted ``request`` must recompute its KV (never swap)."""
        return False

    def preempted(self, request: Request, recomputed: bool) -> None:
        """``request`` was preempted (``recomputed``: its KV is gone, recomputed later)."""

    def finished(self, request: Request) -> None:
        """``request`` left for good (finished, aborted or failed): drop its state."""

    def begin_step(self) -> None:
        """A step is being scheduled (the previous one's outputs may never have come back:
        undo reservations it planned)."""

    def report(self) -> Any:
        """What this feature did since the last call, for the step event (e.g. a KV
        press's compactions), or None."""
        return None

    def plans_ahead(self, batch: Any) -> bool:
        """Whether the next batch may be planned while ``batch`` runs, before its outputs
        are committed (overlapped scheduling: :mod:`llmlab.engine.overlap`). Default no:
        a feature deciding from committed state keeps those steps synchronous."""
        return False


class RunnerPlugin:
    """A feature's runner side (see the module docstring). Subclass it and override the
    hooks the feature needs; ``name`` must match its scheduler side's."""

    name: ClassVar[str] = "plugin"

    def bind(self, runner: Any) -> None:
        """Once, when the runner is built: the model runner (its model, device,
        attention backend, KV tensors)."""

    def start_row(self, row: int, entry: Any, side: Any) -> None:
        """A row's first entry (``entry.setup`` is set): start its state. ``side``: this
        feature's data for the entry, or None."""

    def fork_row(self, leader_row: int, row: int) -> None:
        """A parallel sample's row starts from its leader's."""

    def release(self, rows: Sequence[int]) -> None:
        """The batch freed these rows: drop their state."""

    def reset(self) -> None:
        """A step failed: drop every row's state (the scheduler sends every setup again)."""

    def before_forward(self, batch: Any, sides: Mapping[str, Any]) -> Any:
        """Before the forward pass (rows started, block tables applied). Returns the
        feature's per-step context for the other hooks (or None)."""
        return None

    def kv_offsets(self, batch: Any) -> tuple[Any, Any]:
        """``(dropped, layer_shift)`` for ``batch`` when this feature rewrote rows' KV (a KV
        press): per entry the positions its row no longer caches (an int64 array; KV is
        written and read at ``position - dropped``), and per layer and entry how many fewer
        tokens that layer holds (``[layers, entries]``); None for either when it has none."""
        return None, None

    def observe_queries(self, context: Any) -> Any:
        """A callable ``(layer, queries, scale)`` the attention layers hand their queries
        to during this step's forward (a KV press keeping them), or None."""
        return None

    def eager_only(self, context: Any) -> bool:
        """Whether this step must run eagerly (no CUDA graph replay)."""
        return False

    def forward_begin(self, batch: Any, query_lens: Any, context: Any) -> None:
        """Right before the model runs (after the batch's tensors are built)."""

    def forward_end(self, context: Any) -> None:
        """Right after the model ran (or raised)."""

    def after_forward(self, batch: Any, hidden: Any, output: Any, context: Any) -> Any:
        """After sampling: the step's :class:`~llmlab.scheduler.batch.BatchOutput`, changed
        or not (e.g. ``attrs.evolve(output, sides=...)``)."""
        return output

    def shutdown(self) -> None:
        """The engine shuts down: release what the feature holds."""


class StepPlan(NamedTuple):
    """What a :meth:`SchedulerPlugin.plan` call sees: the step's entries to plan, their live
    requests by id, the scheduler's KV cache manager (to reserve blocks), and the phase
    (``"running"``: before admission, or ``"admitted"``)."""

    entries: Sequence[Any]
    requests: Mapping[str, Request]
    kv: Any
    phase: str
