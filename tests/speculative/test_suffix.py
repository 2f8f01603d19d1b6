"""SuffixProposer: its trees against brute-force substring counts, its drafts against a
reference drafter built on those counts, and the per-row and global tree lifecycles."""

from __future__ import annotations

from collections import Counter, deque

import numpy as np
import pytest

from llmlab import registry
from llmlab.speculative.proposer import DraftRequest, Proposer
from llmlab.speculative.suffix import SuffixProposer, _best, _Node


def request(tokens, row: int = 0, num_prompt_tokens: int = 0, request_id: str | None = None):
    token_ids = np.asarray(tokens, dtype=np.int64)
    token_ids.flags.writeable = False
    return DraftRequest(request_id or f"r{row}", row, token_ids, num_prompt_tokens)


def substring_counts(sequences, max_depth: int) -> Counter:
    counts: Counter = Counter()
    for tokens in sequences:
        for start in range(len(tokens)):
            for end in range(start + 1, min(len(tokens), start + max_depth) + 1):
                counts[tuple(tokens[start:end])] += 1
    return counts


def trie_counts(root: _Node, max_depth: int) -> Counter:
    """The substring counts a trie encodes, checking each node's bookkeeping on the way."""
    counts: Counter = Counter()
    stack = [((), root)]
    while stack:
        path, node = stack.pop()
        if type(node) is tuple:  # a leaf: one occurrence, read on from its tokens
            tokens, end = node
            rest = tokens[end + 1:end + 1 + max_depth - len(path)]
            for length in range(len(rest) + 1):
                counts[path + tuple(rest[:length])] += 1
            continue
        if path:
            counts[path] = node.count
        sizes = {t: 1 if type(c) is tuple else c.count for t, c in node.children.items()}
        assert node.total == sum(sizes.values())
        if sizes:
            assert _best(node) == min(sizes, key=lambda t: (-sizes[t], t))
        stack += [(path + (token,), child) for token, child in node.children.items()]
    return counts


def count_nodes(root: _Node) -> int:
    stack, nodes = [root], 0
    while stack:
        node = stack.pop()
        nodes += 1
        stack += [c for c in node.children.values() if type(c) is not tuple]
    return nodes


def reference_continuation(counts, context, length, limit, min_token_prob):
    """Greedy most-frequent path (ties: smaller token) below the context's last tokens."""
    path, draft, prob, score = tuple(context[-length:]), [], 1.0, 0.0
    while len(draft) < limit:
        children = {t: n for t in set(counts_children(counts, path)) if (n := counts[path + (t,)])}
        if not children:
            break
        token = min(children, key=lambda t: (-children[t], t))
        prob *= children[token] / sum(children.values())
        if prob < min_token_prob:
            break
        draft.append(token)
        score += prob
        path += (token,)
    return draft, score


def counts_children(counts, path):
    return [key[-1] for key in counts if len(key) == len(path) + 1 and key[:-1] == path]


def reference_drafts(own_tokens, outputs, k, proposer: SuffixProposer):
    """The acceptable drafts: the winner of the two trees (either when their scores differ by
    rounding only: the proposer sums a leaf's tokens as one product)."""
    depth, min_match = proposer.max_depth, proposer.min_match
    longest = max(min_match, depth - k)

    def best_of(counts, seen):
        top = min(longest, len(own_tokens))
        lengths = [m for m in range(top, min_match - 1, -1)
                   if counts[tuple(own_tokens[-m:])] >= seen]
        for m in lengths:
            limit = min(k, depth - m, int(m * proposer.max_spec_factor + 1e-6))
            draft, score = reference_continuation(
                counts, own_tokens, m, limit, proposer.min_token_prob
            )
            if draft:
                return draft, score, m
        return [], 0.0, 0

    # In its own tree the context's suffix must have occurred before (twice with itself).
    own = best_of(substring_counts([own_tokens], depth), 2)
    other = best_of(substring_counts(outputs, depth), 1)
    if 0 < abs(own[1] - other[1]) < 1e-9 and own[2] == other[2]:
        return {tuple(own[0]), tuple(other[0])}
    return {tuple((other if other[1:] > own[1:] else own)[0])}


@pytest.mark.parametrize("max_depth, min_match, min_token_prob, max_spec_factor", [
    (4, 1, 0.1, 1.0), (6, 1, 0.0, 3.0), (8, 2, 0.1, 1.0), (6, 1, 0.5, 0.5), (12, 3, 0.1, 2.0),
])
def test_drafts_equal_the_brute_force_reference(
    max_depth, min_match, min_token_prob, max_spec_factor
):
    rng = np.random.default_rng(max_depth * 10 + min_match)
    proposer = SuffixProposer(
        max_depth, min_match, min_token_prob, max_spec_factor, max_global_tokens=60
    )
    held: deque[list[int]] = deque()  # the global tree's outputs, as the reference sees them
    for serial in range(12):
        vocab = int(rng.integers(2, 5))
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        tokens = list(prompt)
        for _ in range(int(rng.integers(1, 8))):
            tokens += rng.integers(0, vocab, size=int(rng.integers(1, 4))).tolist()
            k = int(rng.integers(1, 7))
            [draft] = proposer.propose([request(tokens, 3, len(prompt), f"s{serial}")], k)
            expected = reference_drafts(tokens, list(held), k, proposer)
            assert tuple(draft) in expected, (tokens, list(held), k)
        proposer.release([3])
        output = tokens[len(prompt):][-60:]
        while output and sum(map(len, held)) + len(output) > 60:
            held.popleft()
        if output:
            held.append(output)
        assert proposer.num_global_tokens == sum(map(len, held))


def test_incremental_rows_equal_a_rebuild_and_brute_force_counts():
    rng = np.random.default_rng(7)
    for max_depth in (2, 5, 9):
        proposer, rebuilt = SuffixProposer(max_depth), SuffixProposer(max_depth)
        tokens: list[int] = []
        for _ in range(30):
            tokens += rng.integers(0, 3, size=int(rng.integers(1, 5))).tolist()
            grown = proposer.propose([request(tokens)], 3)
            assert grown == SuffixProposer(max_depth).propose([request(tokens)], 3)
        rebuilt.propose([request(tokens)], 3)
        expected = substring_counts([tokens], max_depth)
        assert trie_counts(proposer._rows[0].root, max_depth) == expected
        assert trie_counts(rebuilt._rows[0].root, max_depth) == expected


def test_drafts_are_at_most_k_tokens_from_the_history():
    rng = np.random.default_rng(1)
    proposer = SuffixProposer(max_spec_factor=8.0, min_token_prob=0.0)
    batch = [rng.integers(0, 4, size=150).tolist() for _ in range(6)]
    for k in (1, 3, 8):
        drafts = proposer.propose([request(t, row) for row, t in enumerate(batch)], k)
        for tokens, draft in zip(batch, drafts):
            assert 0 < len(draft) <= k
            assert all(type(token) is int and token in tokens for token in draft)


def test_the_most_frequent_continuation_is_drafted():
    tokens = [1, 5, 0, 1, 6, 0, 1, 6, 0, 3, 1]  # after 1: 5 once, 6 twice
    assert SuffixProposer(max_spec_factor=2.0).propose([request(tokens)], 2) == [[6, 0]]


def test_a_context_never_seen_before_gives_an_empty_draft():
    proposer = SuffixProposer(min_match=2)
    requests = [request([1, 2, 3, 4]), request([5], row=1), request([1, 2, 1], row=2)]
    assert proposer.propose(requests, 4) == [[], [], []]
    assert proposer.propose([], 4) == []
    assert proposer.propose([request([1, 1, 1, 1], row=3)], 0) == [[]]


def test_draft_length_adapts_to_the_match_and_the_path_probability():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert SuffixProposer(max_spec_factor=1.0).propose([request(tokens)], 6) == [[3, 4]]
    assert SuffixProposer(max_spec_factor=2.0).propose([request(tokens)], 6) == [[3, 4, 5, 6]]
    # After 5: 6 once, 7 once, 8 twice; 5 -> 8 has probability 1/2.
    branching = [5, 6, 0, 5, 7, 1, 5, 8, 2, 5, 8, 3, 5]
    assert SuffixProposer(min_token_prob=0.5).propose([request(branching)], 1) == [[8]]
    assert SuffixProposer(min_token_prob=0.6).propose([request(branching)], 1) == [[]]


def test_a_released_output_drafts_for_a_later_request():
    proposer = SuffixProposer()
    answer = [40, 41, 42, 43, 44, 45]
    proposer.propose([request([1, 2, 3] + answer, row=0, num_prompt_tokens=3)], 4)
    proposer.release([0])
    assert proposer.num_global_tokens == len(answer)
    later = request([7, 8, 40, 41, 42], row=0, num_prompt_tokens=2, request_id="later")
    assert proposer.propose([later], 3) == [[43, 44, 45]]
    # The prompt of the released request was not kept.
    assert proposer.propose([request([9, 1, 2], row=1, num_prompt_tokens=3)], 2) == [[]]


def test_the_global_tree_is_bounded_and_forgets_the_oldest_output():
    proposer = SuffixProposer(max_depth=8, max_global_tokens=500)
    rng = np.random.default_rng(3)
    outputs = [rng.integers(0, 50, size=int(rng.integers(20, 80))).tolist() for _ in range(60)]
    outputs[0] = [1000, 1001, 1002, 1003]  # seen only in the oldest output
    for serial, output in enumerate(outputs):
        proposer.propose([request([5] + output, 0, 1, f"q{serial}")], 2)
        proposer.release([0])
        assert proposer.num_global_tokens <= 500
        if serial == 0:
            assert proposer.propose([request([1000, 1001], 1, 2, "probe")], 2) == [[1002, 1003]]
            proposer.release([1])
    held = list(proposer._global.outputs)
    assert held == outputs[-len(held):] and sum(map(len, held)) == proposer.num_global_tokens
    root = proposer._global.root
    assert trie_counts(root, 8) == substring_counts(held, 8)
    assert count_nodes(root) <= 8 * proposer.num_global_tokens
    assert proposer.propose([request([1000, 1001], 1, 2, "again")], 2) == [[]]


def test_an_output_longer_than_the_bound_keeps_its_tail():
    proposer = SuffixProposer(max_global_tokens=5)
    proposer.propose([request([0, 1, 2, 3, 4, 5, 6, 7], 0, 1)], 1)
    proposer.release([0])
    assert list(proposer._global.outputs) == [[3, 4, 5, 6, 7]]
    disabled = SuffixProposer(max_global_tokens=0)
    disabled.propose([request([0, 1, 2, 3], 0, 1)], 1)
    disabled.release([0])
    assert disabled.num_global_tokens == 0 and not disabled._global.root.children


def test_unrepeated_tokens_cost_no_nodes():
    proposer = SuffixProposer(max_depth=32)
    proposer.propose([request(np.arange(5000))], 4)
    assert count_nodes(proposer._rows[0].root) == 1


def test_reset_drops_the_rows_but_keeps_the_global_tree():
    proposer = SuffixProposer()
    proposer.propose([request([1, 2, 3, 1, 2], 0, 1)], 2)
    proposer.release([0])
    proposer.propose([request([4, 5, 4, 5], 1, 1), request([6, 6], 2, 1)], 2)
    proposer.reset()
    assert not proposer._rows and proposer.num_global_tokens == 4
    proposer.release([1, 2])  # already dropped: nothing reaches the global tree
    assert proposer.num_global_tokens == 4


def test_a_new_request_in_a_row_starts_a_new_tree():
    proposer = SuffixProposer()
    assert proposer.propose([request([1, 2, 3, 1, 2], request_id="a")], 1) == [[3]]
    assert proposer.propose([request([1, 2], request_id="b")], 1) == [[]]
    assert proposer._rows[0].tokens == [1, 2]


def test_registered_and_satisfies_the_proposer_contract():
    proposer = registry.resolve("proposer", "suffix")()
    assert isinstance(proposer, SuffixProposer) and isinstance(proposer, Proposer)
    registry.check("proposer", proposer)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_depth": 1}, "max_depth must be an int >= 2, got 1"),
    ({"max_depth": 4.0}, "max_depth must be an int >= 2, got 4.0"),
    ({"min_match": 0}, "min_match must be an int >= 1, got 0"),
    ({"max_depth": 4, "min_match": 4}, r"min_match must be < max_depth \(4\), got 4"),
    ({"min_token_prob": 1.5}, r"min_token_prob must be a number in \[0, 1\], got 1.5"),
    ({"max_spec_factor": 0}, "max_spec_factor must be a finite number > 0, got 0"),
    ({"max_spec_factor": float("inf")}, "max_spec_factor must be a finite number > 0, got inf"),
    ({"max_global_tokens": -1}, "max_global_tokens must be an int >= 0, got -1"),
])
def test_invalid_arguments_are_rejected_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SuffixProposer(**kwargs)
