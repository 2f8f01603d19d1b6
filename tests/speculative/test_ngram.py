"""NgramProposer: exact prompt lookup against a plain-Python reference, and its contract."""

from __future__ import annotations

import numpy as np
import pytest

from llmlab import registry
from llmlab.speculative.ngram import NgramProposer
from llmlab.speculative.proposer import DraftRequest, Proposer


def request(tokens, row: int = 0) -> DraftRequest:
    token_ids = np.asarray(tokens, dtype=np.int64)
    token_ids.flags.writeable = False
    return DraftRequest(f"r{row}", row, token_ids, num_prompt_tokens=1)


def reference_draft(tokens, k, lookup_min, lookup_max, max_search):
    """Longest suffix first; its rightmost earlier occurrence; the tokens after it."""
    tokens = list(tokens)[-max_search:]
    for n in range(lookup_max, lookup_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("lookup_min, lookup_max, max_search", [
    (1, 1, 2048), (1, 4, 2048), (2, 3, 2048), (3, 5, 2048), (1, 4, 17), (2, 2, 5),
])
def test_drafts_equal_the_reference_on_random_sequences(lookup_min, lookup_max, max_search):
    proposer = NgramProposer(lookup_min, lookup_max, max_search=max_search)
    rng = np.random.default_rng(lookup_min * 100 + lookup_max * 10 + max_search)
    for _ in range(120):
        vocab = int(rng.integers(2, 6))
        batch = [rng.integers(0, vocab, size=int(rng.integers(1, 60))) for _ in range(4)]
        requests = [request(tokens, row) for row, tokens in enumerate(batch)]
        for k in range(1, 7):
            expected = [
                reference_draft(t, k, lookup_min, lookup_max, max_search) for t in batch
            ]
            assert proposer.propose(requests, k) == expected


def test_a_repeated_phrase_is_continued_from_its_most_recent_occurrence():
    tokens = [5, 6, 7, 1, 9, 5, 6, 7, 2, 8, 3, 5, 6, 7]
    assert NgramProposer().propose([request(tokens)], 3) == [[2, 8, 3]]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    # "1 2 3" occurred once, early; "3" alone occurred more recently, followed by 8.
    tokens = [1, 2, 3, 4, 5, 3, 8, 0, 1, 2, 3]
    assert NgramProposer(1, 3).propose([request(tokens)], 2) == [[4, 5]]


def test_drafts_stop_at_the_end_of_the_history_and_may_overlap_the_suffix():
    assert NgramProposer().propose([request([7, 7, 7])], 5) == [[7]]


def test_no_earlier_occurrence_gives_an_empty_draft():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3)
    requests = [request([1, 2, 3, 4]), request([9]), request([1, 2, 3, 1], row=1)]
    assert proposer.propose(requests, 4) == [[], [], []]
    assert proposer.propose([], 4) == []


def test_drafts_are_at_most_k_python_ints_from_the_history():
    rng = np.random.default_rng(0)
    proposer = NgramProposer()
    batch = [rng.integers(0, 3, size=200) for _ in range(8)]
    for k in (1, 3, 8):
        for tokens, draft in zip(batch, proposer.propose([request(t) for t in batch], k)):
            assert 0 < len(draft) <= k
            assert all(type(token) is int and token in set(tokens.tolist()) for token in draft)


def test_the_search_is_bounded_to_the_last_max_search_tokens():
    tokens = [4, 5, 6] + [0] * 10 + [1, 2, 3, 4]
    assert NgramProposer(max_search=100).propose([request(tokens)], 2) == [[5, 6]]
    assert NgramProposer(max_search=10).propose([request(tokens)], 2) == [[]]


def test_registered_and_satisfies_the_proposer_contract():
    proposer = registry.resolve("proposer", "ngram")()
    assert isinstance(proposer, NgramProposer) and isinstance(proposer, Proposer)
    registry.check("proposer", proposer)


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt_lookup_min": 0}, "prompt_lookup_min must be an int >= 1, got 0"),
    ({"prompt_lookup_min": 2.0}, "prompt_lookup_min must be an int >= 1, got 2.0"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2},
     r"prompt_lookup_max must be >= prompt_lookup_min \(3\), got 2"),
    ({"prompt_lookup_max": 0}, "prompt_lookup_max must be an int >= 1, got 0"),
    ({"max_search": 0}, "max_search must be an int >= 1, got 0"),
])
def test_invalid_arguments_are_rejected_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NgramProposer(**kwargs)
