"""``synthetic``: drafts accepted at rates you give, with no drafter at all.

For studying what speculation does to scheduling (batch shapes, KV blocks reserved and
returned, step times) without a drafter, and what the simulator runs: each step a request
drafts ``k`` tokens and the first ``j`` of them are accepted with the probability you set
(``rates[j - 1]``: the *unconditional* rate of position ``j``, non-increasing), whatever
the target says. The accepted tokens are placeholders (copies of the request's last
token) and the token after them is the target's own at that position, so **outputs are
not the model's**: this is a tool for studying speculation's cost, not for generating.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs

from llmlab import registry
from llmlab.speculative.proposer import DraftRequest


def _rates(value: object) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(
            f"synthetic_acceptance_rates must be a list of numbers in [0, 1], got {value!r}"
        ) from None
    if not rates:
        raise ValueError("synthetic_acceptance_rates needs at least one rate (position 1's)")
    if any(not 0.0 <= r <= 1.0 for r in rates):
        raise ValueError(f"synthetic_acceptance_rates must lie in [0, 1], got {list(rates)}")
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(
            "synthetic_acceptance_rates are unconditional per-position rates, so they cannot "
            f"increase with the position; got {list(rates)}"
        )
    return rates


@registry.register("proposer", "synthetic")
@attrs.define
class SyntheticProposer:
    """Accepts drafts at given per-position rates (outputs are placeholders; see module).

    Attributes:
        rates: unconditional acceptance rate of positions 1, 2, ...; the last one holds
            for positions past the list.
        num_speculative_tokens: drafts are this long (the engine's k).
        seed: the acceptance draws' seed.
    """

    rates: tuple[float, ...] = attrs.field(converter=_rates)
    num_speculative_tokens: int = 4
    seed: int = 0
    name: str = "synthetic"
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def rate(self, position: int) -> float:
        """Unconditional acceptance rate of 1-based ``position``."""
        return self.rates[min(position, len(self.rates)) - 1]

    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        return [[int(r.token_ids[-1])] * k for r in requests]

    def num_accepted(self, draft_lengths: Sequence[int]) -> list[int]:
        """How many of each draft to accept: position ``j`` given ``j - 1`` accepted has the
        conditional rate ``rate(j) / rate(j - 1)``."""
        out = []
        for m in draft_lengths:
            a, before = 0, 1.0
            while a < m:
                now = self.rate(a + 1)
                if before <= 0.0 or self._rng.random() >= now / before:
                    break
                a, before = a + 1, now
            out.append(a)
        return out
