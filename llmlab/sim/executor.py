"""``SimulatedExecutor``: runs the engine's batches on a cost model instead of a model.

The engine, its scheduler, KV cache manager and every policy component run unchanged; only
this executor differs from the real one. For each batch it

1. prices the step with its :class:`~llmlab.sim.cost_model.CostModel` (the whole step cycle,
   host time included) and advances the :class:`~llmlab.runner.executor.VirtualClock`;
2. returns one placeholder token per scored entry (and per parallel sample that starts),
   so requests run until their ``max_tokens``: a simulated request carries its output
   length, and the engine built for simulation has no EOS token to end it sooner;
3. verifies speculative lookahead at the synthetic proposer's per-position acceptance
   rates, so the scheduler sees the same accepted-token accounting, KV reservations and
   rollbacks as with a real drafter.

A batch's ``kv_transfers`` (swap preemption, the KV offload tier) are accepted and not
charged: the simulator builds engines without host pools, and its cost models do not price
block copies yet.

Placeholder tokens are a cheap deterministic function of the request's row, position and
last token, so parallel samples diverge after they fork (as sampled ones do) and a run
is reproducible bit for bit. They are not a model's outputs: prefix sharing in a
simulated workload comes from its prompts, as it does on the real engine, whose outputs
no workload request repeats either.
"""

from __future__ import annotations

from typing import Any

import attrs

from llmlab.runner.executor import VirtualClock
from llmlab.scheduler.batch import BatchOutput, ScheduledBatch
from llmlab.sim.cost_model import CostModel, step_time
from llmlab.sim.shape import BatchShape

# Placeholder token arithmetic: odd multipliers spread rows and positions over the vocabulary.
_ROW_MIX, _POSITION_MIX, _TOKEN_MIX = 7919, 104729, 31


@attrs.define(eq=False)
class SimulatedExecutor:
    """An :class:`~llmlab.runner.executor.Executor` that only advances a virtual clock.

    Attributes:
        cost_model: prices each step (:class:`~llmlab.sim.cost_model.CostModel`).
        clock: the engine's clock; each step advances it by the predicted time.
        vocab_size: placeholder tokens are drawn below it.
        acceptance: decides how many of a speculating entry's draft tokens are accepted
            (an object with ``num_accepted(draft_lengths) -> list[int]``: the synthetic
            proposer); None when the engine does not speculate.
    """

    cost_model: CostModel
    clock: VirtualClock
    vocab_size: int
    acceptance: Any = None
    # Per row: output tokens so far and the most it may get (to count finishing requests).
    _outputs: dict[int, int] = attrs.field(factory=dict, repr=False)
    _limits: dict[int, int] = attrs.field(factory=dict, repr=False)
    # The clock when the last step ended: a driver advances it only while the engine is
    # idle, so a later clock at the next step means the engine sat idle before it.
    _last_end: float | None = attrs.field(default=None, repr=False)

    def execute(self, batch: ScheduledBatch) -> BatchOutput:
        outputs, limits = self._outputs, self._limits
        for row in batch.freed_rows:
            outputs.pop(row, None)
            limits.pop(row, None)
        entries = batch.entries
        if not entries:
            return BatchOutput.empty()
        drafted = None
        if self.acceptance is not None and any(e.num_lookahead for e in entries):
            drafted = [e.num_lookahead if e.num_scored else 0 for e in entries]
            accepted = self.acceptance.num_accepted(drafted)
        vocab = self.vocab_size
        token_ids: list[tuple[int, ...]] = []
        logprobs: list[tuple[float, ...]] = []
        forks = None
        finishing = 0
        for i, e in enumerate(entries):
            row = e.row
            setup = e.setup
            if setup is not None:
                outputs[row] = len(setup.output_token_ids)
                limits[row] = _limit(setup.params.max_tokens)
            if not e.num_scored:
                token_ids.append(())
                logprobs.append(())
                continue
            position = e.start + len(e.token_ids)
            token = (
                e.token_ids[-1] * _TOKEN_MIX + row * _ROW_MIX + position * _POSITION_MIX
            ) % vocab
            count = 1 if drafted is None else 1 + accepted[i]
            done = outputs.get(row, 0) + count
            outputs[row] = done
            if done >= limits.get(row, done + 1):
                finishing += 1
            token_ids.append((token,) * count)
            logprobs.append((0.0,) * count)
            if e.forks:
                if forks is None:
                    forks = [()] * i
                forks.append(tuple(
                    ((token + k + 1) % vocab, 0.0, None) for k in range(len(e.forks))
                ))
                for f in e.forks:
                    outputs[f.row] = 1
                    limits[f.row] = _limit(f.params.max_tokens)
            elif forks is not None:
                forks.append(())
        if forks is not None:
            forks.extend([()] * (len(entries) - len(forks)))
        now = self.clock()
        idle = self._last_end is None or now > self._last_end
        shape = BatchShape.of_batch(batch, drafted, finishing, idle)
        seconds = step_time(self.cost_model, shape)
        self.clock.advance(seconds)
        self._last_end = self.clock()
        return BatchOutput(
            token_ids=tuple(token_ids),
            logprobs=tuple(logprobs),
            forks=None if forks is None else tuple(forks),
            num_drafted=None if drafted is None else tuple(drafted),
        )


def _limit(max_tokens: int | None) -> int:
    return max_tokens if max_tokens is not None else 1 << 62
