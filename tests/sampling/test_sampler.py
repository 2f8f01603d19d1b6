"""The batched sampler: filters against exact distributions, seeds, greedy."""

import pytest
import torch
from scipy.stats import chisquare

from llmlab.sampling import Sampler, SamplingParams
from llmlab.sampling.sampler import filtered_probs
from tests.helpers import make_request

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def exact(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The truncated distribution computed independently, token by token."""
    p = torch.softmax(LOGITS / temperature, -1)
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order[:top_k] if top_k else order)
    mass, nucleus = 0.0, set()
    for i in order:
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += float(p[i])
    keep &= nucleus
    keep &= {i for i in range(len(p)) if p[i] >= min_p * p.max()}
    out = torch.tensor([float(p[i]) if i in keep else 0.0 for i in range(len(p))])
    return out / out.sum()


def draw(params, n=20000, seed=0):
    sampler = Sampler()
    gen = torch.Generator().manual_seed(seed)
    reqs = [make_request([1], **params) for _ in range(n)]
    out = sampler(LOGITS.repeat(n, 1), reqs, gen)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(LOGITS)).float()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1.0, top_k=3),
        dict(temperature=1.3, top_p=0.8),
        dict(temperature=1.0, min_p=0.2),
        dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
    ],
)
def test_sample_frequencies_match_the_truncated_distribution(params):
    counts = draw(params)
    expected = exact(**params)
    assert torch.all(counts[expected == 0] == 0), "a filtered-out token was sampled"
    kept = expected > 0
    stat = chisquare(counts[kept].numpy(), (expected[kept] * counts.sum()).numpy())
    assert stat.pvalue > 1e-3, (counts, expected * counts.sum())


def test_filtered_probs_matches_exact_for_a_batch_of_mixed_settings():
    rows = [dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), dict()]
    probs = filtered_probs(
        LOGITS.repeat(4, 1),
        torch.ones(4),
        torch.tensor([r.get("top_k", 0) for r in rows]),
        torch.tensor([r.get("top_p", 1.0) for r in rows]),
        torch.tensor([r.get("min_p", 0.0) for r in rows]),
    )
    for row, r in enumerate(rows):
        torch.testing.assert_close(probs[row], exact(**r))


def test_greedy_and_top_k_one_pick_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy = [make_request([1], temperature=0.0) for _ in range(3)]
    topk1 = [make_request([1], temperature=0.8, top_k=1) for _ in range(3)]
    out = Sampler()(logits, greedy + topk1, torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(-1).tolist()
    expected_lp = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(torch.tensor(out.logprobs), expected_lp)


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))

    def tokens(batch_extra):
        r = make_request([1], temperature=1.0, seed=1234)
        r.generator = torch.Generator().manual_seed(1234)
        others = [make_request([1], temperature=1.0) for _ in range(batch_extra)]
        seq = []
        for _ in range(20):
            reqs = others + [r]
            out = Sampler()(logits.repeat(len(reqs), 1), reqs, torch.Generator().manual_seed(len(seq)))
            seq.append(out.token_ids[-1])
        return seq

    assert tokens(0) == tokens(5) == tokens(17)
    assert len(set(tokens(0))) > 1  # it really is sampling


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(1, 10)
    logits[0, 3] = 100.0  # EOS dominates
    logits[0, 5] = 50.0  # then a stop token
    r = make_request([1], temperature=0.0, min_tokens=2, stop_token_ids=[5])
    r.eos_token_ids = frozenset({3})
    out = Sampler()(logits.clone(), [r]).token_ids[0]
    assert out not in (3, 5)
    r.output_token_ids.extend([0, 0])
    assert Sampler()(logits.clone(), [r]).token_ids == [3]


def test_sampling_params_validation_names_the_field():
    for kwargs, field in [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
