"""SuffixDecoding: draft from suffix trees over the request's own tokens and earlier outputs.

Source: Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications" (NeurIPS 2025); reference implementation in Snowflake's ArcticInference.

Structure. A trie of every substring of at most ``max_depth`` tokens; a node counts the
occurrences of its substring (``count``) and the continuations seen after it (``total``, the
sum of its children's counts). A substring seen once gets no node: its parent holds a *leaf*
``(tokens, end)``, a pointer to where it ends, and the path below is read from the tokens. A
second occurrence splits the leaf into a node, so memory follows the repeated substrings rather
than ``max_depth`` times the tokens. A sequence keeps its *active* nodes (those of its repeated
suffixes, the root first); appending a token updates only them: O(max_depth) at worst.

Trees. Each running row has one over its prompt and output, extended as ``token_ids`` grows.
A released row's output goes into a global tree shared by later requests. The global tree
holds at most ``max_global_tokens`` tokens and forgets whole outputs, oldest first (a FIFO,
like the paper's cache of recent responses): removing one walks each of its suffixes,
decrementing counts and dropping the nodes and leaves that reach zero (a node left with one
occurrence stays a node). Memory is about 150-250 bytes a token for ordinary outputs; outputs
that repeat one another cost up to ``max_depth`` nodes (~300 bytes each) a token.

Drafting. The longest suffix of the context that is a path in a tree (at least ``min_match``
and at most ``max_depth - k`` tokens, so a full draft fits below it) is extended along the most
frequent continuation while the path's probability (the product of ``count / total`` along it)
stays at least ``min_token_prob`` and for at most ``max_spec_factor`` times the match length:
the paper's adaptive speculation length. Of the two trees' drafts the one with the higher score
(the sum of the path probabilities: the expected number of accepted tokens) wins, then the
longer match, then the request's own tree.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Sequence

import attrs

from llmlab import registry
from llmlab.speculative.proposer import DraftRequest

# ``best_count`` of a node whose best child must be recounted (after a removal lowered it):
# no insertion can beat it, so insertions leave the stale mark alone.
_STALE = sys.maxsize


@attrs.define(eq=False)
class _Node:
    """A substring seen more than once: its count, its continuations' count, its children
    (token -> node, or a ``(tokens, end)`` leaf), and its most frequent child."""

    count: int = 0
    total: int = 0
    best: int | None = None
    best_count: int = 0
    children: dict = attrs.Factory(dict)


def _append(active: list[_Node], tokens: list[int], end: int, max_depth: int) -> list[_Node]:
    """Count the suffixes ending at ``tokens[end]`` (the active nodes were those ending just
    before it); return the new active nodes."""
    token = tokens[end]
    leaf = (tokens, end)
    grown = [active[0]]
    for depth, node in enumerate(active, 1):  # ``depth``: the child's
        node.total += 1
        child = node.children.get(token)
        if child is None:  # first time: this and every longer suffix are new
            node.children[token] = leaf
            count = 1
        else:
            if type(child) is tuple:  # seen once before: split the leaf
                child = node.children[token] = _split(child, depth, max_depth)
            child.count += 1
            count = child.count
            if depth < max_depth:
                grown.append(child)
        # Ties go to the smaller token id, so the choice does not depend on history.
        if count > node.best_count or (count == node.best_count and token < node.best):
            node.best, node.best_count = token, count
    return grown


def _split(leaf: tuple[list[int], int], depth: int, max_depth: int) -> _Node:
    """The node replacing a leaf at ``depth``, holding its one occurrence."""
    tokens, end = leaf
    node = _Node(count=1)
    if depth < max_depth and end + 1 < len(tokens):
        node.children[tokens[end + 1]] = (tokens, end + 1)
        node.total = node.best_count = 1
        node.best = tokens[end + 1]
    return node


def _best(node: _Node) -> int | None:
    """The token of the node's most frequent child (None: no children)."""
    if node.best_count == _STALE:
        node.best, node.best_count = None, 0
        for token, child in node.children.items():
            count = 1 if type(child) is tuple else child.count
            if count > node.best_count or (count == node.best_count and token < node.best):
                node.best, node.best_count = token, count
    return node.best


def _find(root: _Node, tokens: list[int], length: int) -> _Node | tuple | None:
    """Where the last ``length`` tokens end in the trie (a node or a leaf), or None."""
    position = root
    for token in tokens[len(tokens) - length:]:
        if type(position) is tuple:
            sequence, end = position
            if end + 1 == len(sequence) or sequence[end + 1] != token:
                return None
            position = (sequence, end + 1)
        else:
            position = position.children.get(token)
            if position is None:
                return None
    return position


def _draft(
    position: _Node | tuple, limit: int, min_token_prob: float
) -> tuple[list[int], float]:
    """Up to ``limit`` tokens along the most frequent path below ``position``, and the sum of
    their path probabilities."""
    draft: list[int] = []
    prob, score = 1.0, 0.0
    while len(draft) < limit:
        if type(position) is tuple:  # one occurrence: the rest is certain
            tokens, end = position
            rest = tokens[end + 1:end + 1 + limit - len(draft)]
            draft += rest
            score += prob * len(rest)
            break
        token = _best(position)
        if token is None:
            break
        child = position.children[token]
        prob *= (1 if type(child) is tuple else child.count) / position.total
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        position = child
    return draft, score


@attrs.define(eq=False)
class _Row:
    """A running request's own tree: the tokens inserted so far and their active nodes."""

    request_id: str
    num_prompt_tokens: int
    tokens: list[int] = attrs.Factory(list)
    root: _Node = attrs.Factory(_Node)
    active: list[_Node] = attrs.Factory(lambda self: [self.root], takes_self=True)


@attrs.define(eq=False)
class _GlobalTree:
    """Finished requests' outputs, at most ``max_tokens`` of them, evicted oldest first."""

    max_depth: int
    max_tokens: int
    root: _Node = attrs.Factory(_Node)
    outputs: deque[list[int]] = attrs.Factory(deque)
    num_tokens: int = 0

    def add(self, tokens: list[int]) -> None:
        """Insert an output (its last ``max_tokens`` if longer), evicting to make room."""
        if not tokens or not self.max_tokens:
            return
        tokens = tokens[-self.max_tokens:]
        while self.num_tokens + len(tokens) > self.max_tokens:
            self._remove(self.outputs.popleft())
        self.outputs.append(tokens)
        self.num_tokens += len(tokens)
        active = [self.root]
        for end in range(len(tokens)):
            active = _append(active, tokens, end, self.max_depth)

    def _remove(self, tokens: list[int]) -> None:
        self.num_tokens -= len(tokens)
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.max_depth]:
                node.total -= 1
                if node.best == token:
                    node.best_count = _STALE
                child = node.children[token]
                if type(child) is tuple or child.count == 1:  # only this occurrence left
                    del node.children[token]
                    break
                child.count -= 1
                node = child


def _at_least(low: int):
    def check(instance: object, attribute: attrs.Attribute, value: object) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{attribute.name} must be an int >= {low}, got {value!r}")
    return check


def _below_max_depth(instance: SuffixProposer, attribute: attrs.Attribute, value: int) -> None:
    _at_least(1)(instance, attribute, value)
    if value >= instance.max_depth:
        raise ValueError(
            f"{attribute.name} must be < max_depth ({instance.max_depth}), got {value!r}"
        )


def _probability(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ValueError(f"{attribute.name} must be a number in [0, 1], got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
            or not math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


@registry.register("proposer", "suffix")
@attrs.define
class SuffixProposer:
    """SuffixDecoding: continue the longest matching suffix along the most frequent path of a
    suffix tree over the request's own tokens or over earlier requests' outputs (see the
    module).

    Attributes:
        max_depth: the longest substring the trees count.
        min_match: the shortest context suffix a draft may continue.
        min_token_prob: stop the draft when its path probability falls below this.
        max_spec_factor: draft at most this many tokens per matched token.
        max_global_tokens: the most output tokens the global tree holds (0: no global tree).
        name: a label for reports.

    ``max_depth``, ``min_token_prob`` and ``max_spec_factor`` default to vLLM's suffix
    decoding settings. The two sizes are fixed once built: the trees are shaped by them.
    """

    max_depth: int = attrs.field(
        default=24, validator=_at_least(2), on_setattr=attrs.setters.frozen
    )
    min_match: int = attrs.field(default=1, validator=_below_max_depth)
    min_token_prob: float = attrs.field(default=0.1, validator=_probability)
    max_spec_factor: float = attrs.field(default=1.0, validator=_positive)
    max_global_tokens: int = attrs.field(
        default=200_000, validator=_at_least(0), on_setattr=attrs.setters.frozen
    )
    name: str = "suffix"
    _rows: dict[int, _Row] = attrs.field(init=False, factory=dict, repr=False)
    _global: _GlobalTree = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._global = _GlobalTree(self.max_depth, self.max_global_tokens)

    @property
    def num_global_tokens(self) -> int:
        """Output tokens now held by the global tree."""
        return self._global.num_tokens

    def propose(self, requests: Sequence[DraftRequest], k: int) -> list[list[int]]:
        """Up to ``k`` tokens per request; empty where neither tree continues its context."""
        if k < 1:
            return [[] for _ in requests]
        # Matches stop ``k`` short of the depth so that a whole draft fits below them.
        longest = max(self.min_match, self.max_depth - k)
        drafts = []
        for request in requests:
            state = self._sync(request)
            own = self._own_draft(state.active, k, longest)
            other = self._global_draft(state.tokens, k, longest)
            drafts.append((other if other[1:] > own[1:] else own)[0])
        return drafts

    def release(self, rows: Sequence[int]) -> None:
        """Drop the rows' trees; their outputs go into the global tree."""
        for row in rows:
            state = self._rows.pop(row, None)
            if state is not None:
                self._global.add(state.tokens[state.num_prompt_tokens:])

    def reset(self) -> None:
        """Drop every row's tree (the global tree stays)."""
        self._rows.clear()

    def _sync(self, request: DraftRequest) -> _Row:
        """The request's row, its new tokens inserted into its tree."""
        state = self._rows.get(request.row)
        token_ids = request.token_ids
        if (state is None or state.request_id != request.request_id
                or len(token_ids) < len(state.tokens)):  # a new request in the row
            state = self._rows[request.row] = _Row(request.request_id, request.num_prompt_tokens)
        tokens = state.tokens
        start = len(tokens)
        if len(token_ids) > start:
            tokens += token_ids[start:].tolist()
            active = state.active
            for end in range(start, len(tokens)):
                active = _append(active, tokens, end, self.max_depth)
            state.active = active
        return state

    def _own_draft(
        self, active: list[_Node], k: int, longest: int
    ) -> tuple[list[int], float, int]:
        # The active nodes are the context's suffixes seen before, indexed by length.
        for length in range(min(longest, len(active) - 1), self.min_match - 1, -1):
            draft, score = _draft(active[length], self._limit(length, k), self.min_token_prob)
            if draft:
                return draft, score, length
        return [], 0.0, 0

    def _global_draft(
        self, tokens: list[int], k: int, longest: int
    ) -> tuple[list[int], float, int]:
        root = self._global.root
        if not root.children:
            return [], 0.0, 0
        # Every suffix of a path is a path, so the longest match is found by bisection.
        low, high, position = self.min_match - 1, min(longest, len(tokens)), None
        while low < high:
            middle = (low + high + 1) // 2
            found = _find(root, tokens, middle)
            if found is None:
                high = middle - 1
            else:
                low, position = middle, found
        for length in range(low, self.min_match - 1, -1):
            if length < low:  # the longest match had nothing after it (an output's end)
                position = _find(root, tokens, length)
            draft, score = _draft(position, self._limit(length, k), self.min_token_prob)
            if draft:
                return draft, score, length
        return [], 0.0, 0

    def _limit(self, length: int, k: int) -> int:
        return min(k, self.max_depth - length, int(length * self.max_spec_factor + 1e-6))
