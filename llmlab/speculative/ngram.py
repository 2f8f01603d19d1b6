"""N-gram (prompt lookup) drafting: copy what followed the last time the context's tail occurred.

Source: vLLM's ``ngram`` speculative method (prompt lookup decoding, Saxena 2023). Drafts are
certain (no probabilities), so verification keeps the longest prefix the target agrees with.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from llmlab import registry
from llmlab.speculative.proposer import DraftRequest


def _at_least_one(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _not_below_min(instance: NgramProposer, attribute: attrs.Attribute, value: int) -> None:
    _at_least_one(instance, attribute, value)
    if value < instance.prompt_lookup_min:
        raise ValueError(
            f"{attribute.name} must be >= prompt_lookup_min ({instance.prompt_lookup_min}), "
            f"got {value!r}"
        )


@registry.register("proposer", "ngram")
@attrs.define
class NgramProposer:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the
    longest suffix (``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) of each
    request's prompt and output.

    Attributes:
        prompt_lookup_min, prompt_lookup_max: the n-gram lengths tried, longest first.
        max_search: only the last ``max_search`` tokens are searched (the n-gram, its match
            and the draft all lie in them), so a step costs the same however long the
            history grows.
        name: a label for reports.
    """

    prompt_lookup_min: int = attrs.field(default=1, validator=_at_least_one)
    prompt_lookup_max: int = attrs.field(default=4, validator=_not_below_min)
    max_search: int = attrs.field(default=2048, validator=_at_least_one)
    name: str = "ngram"

    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        """Up to ``k`` tokens per request; an empty draft where the tail never occurred."""
        return [self._draft(request.token_ids[-self.max_search:], k) for request in requests]

    def _draft(self, window: np.ndarray, k: int) -> list[int]:
        # Grow the match one token leftwards at a time, keeping only the end positions of
        # earlier occurrences that still match: after the first full comparison each step
        # touches the surviving candidates only, usually a handful.
        last = len(window) - 1
        if k < 1 or last < self.prompt_lookup_min:
            return []
        ends = np.flatnonzero(window[:last] == window[last])
        length = 1
        while ends.size and length < self.prompt_lookup_max:
            longer = ends[ends >= length]
            longer = longer[window[longer - length] == window[last - length]]
            if not longer.size:
                break
            ends, length = longer, length + 1
        if not ends.size or length < self.prompt_lookup_min:
            return []
        start = int(ends[-1]) + 1  # the most recent occurrence
        return window[start:start + k].tolist()
