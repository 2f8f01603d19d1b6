"""The batched sampler: filters against exact distributions, seeds, greedy, logprobs."""

import math

import pytest
import torch
from scipy.stats import chisquare

from llmlab.request import Request
from llmlab.sampling import Sampler, SamplingParams
from llmlab.sampling.processors import default_processors
from llmlab.sampling.processors import apply_min_p, apply_top_k, apply_top_p
from llmlab.sampling.sampler import SamplerOutput
from tests.helpers import make_request

LOGITS = torch.tensor([2.2, 1.9, 1.5, 1.2, 0.8, 0.5, 0.1, -0.3, -0.8, -1.4, -2.0, -2.6])
V = len(LOGITS)


def exact(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, allowed_token_ids=None):
    """The truncated distribution computed independently, token by token.

    Filters apply in order, each on what the previous one kept, renormalised (vLLM / HF):
    allowed ids, temperature, top-k, top-p (mass within the top-k), min-p.
    """
    logits = LOGITS.tolist()
    keep = set(range(V)) if allowed_token_ids is None else set(allowed_token_ids) & set(range(V))

    def probs():
        w = {i: math.exp(logits[i] / temperature) for i in keep}
        total = sum(w.values())
        return {i: x / total for i, x in w.items()}

    order = sorted(keep, key=lambda i: -logits[i])
    if top_k > 0:
        keep = set(order[:top_k])
    p = probs()
    mass, nucleus = 0.0, set()
    for i in sorted(keep, key=lambda i: -p[i]):
        if mass >= top_p:
            break
        nucleus.add(i)
        mass += p[i]
    keep = nucleus
    p = probs()
    keep = {i for i in keep if p[i] >= min_p * max(p.values())}
    p = probs()
    return torch.tensor([p.get(i, 0.0) for i in range(V)], dtype=torch.float64)


_POOL: list[Request] = []


def same_requests(n, **params):
    """``n`` fresh-state requests sharing one SamplingParams (pooled: fast to build)."""
    while len(_POOL) < n:
        _POOL.append(Request(f"s{len(_POOL)}", [1], SamplingParams(), 0.0))
    sp = SamplingParams(**params)
    reqs = _POOL[:n]
    for r in reqs:
        r.sampling_params = sp
        assert not r.output_token_ids
    return reqs


def draw(params, n=20000, seed=0):
    sampler = Sampler()
    gen = torch.Generator().manual_seed(seed)
    reqs = same_requests(n, **params)
    out = sampler(LOGITS.repeat(n, 1), reqs, gen)
    return torch.bincount(torch.tensor(out.token_ids), minlength=V).double()


def assert_matches(counts, expected):
    assert torch.all(counts[expected == 0] == 0), "a filtered-out token was sampled"
    kept = expected > 0
    stat = chisquare(counts[kept].numpy(), (expected[kept] * counts.sum()).numpy())
    assert stat.pvalue > 1e-3, (counts, expected * counts.sum())


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 1.0, "top_k": 3},
        {"temperature": 1.3, "top_p": 0.8},
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 0.9, "top_k": 5, "top_p": 0.9, "min_p": 0.05},
        # top-p measures mass within the top-k: 3 tokens kept (the intersection of the
        # separate filters on the full distribution would keep 4).
        {"temperature": 1.0, "top_k": 4, "top_p": 0.8},
        {"temperature": 0.8, "top_k": -1, "top_p": 0.95},
        {"temperature": 1.0, "top_k": 1000},  # beyond the vocabulary: keeps all
        {"temperature": 1.2, "allowed_token_ids": [0, 3, 7, 11, 500]},  # 500 >= V: ignored
        {"temperature": 1.0, "allowed_token_ids": [2, 5, 9], "top_k": 2},
    ],
)
def test_sample_frequencies_match_the_truncated_distribution(params):
    assert_matches(draw(params), exact(**params))


def test_exact_reference_really_differs_between_settings():
    # Guards the reference itself: the cases above would not catch a sampler that ignores
    # top-p within top-k, or temperature, if the reference made them coincide.
    assert (exact(top_k=4, top_p=0.8) > 0).sum() == 3
    assert not torch.allclose(exact(temperature=0.7), exact())


def test_mixed_rows_each_follow_their_own_parameters():
    settings = [{"temperature": 0.7}, {"top_k": 3}, {"top_p": 0.6}, {"min_p": 0.3},
                {"temperature": 0.0}]
    per, k = 6000, len(settings)
    shared = [SamplingParams(**s) for s in settings]
    # Interleaved rows, so a parameter applied to the wrong row shows.
    reqs = same_requests(per * k)
    for i, r in enumerate(reqs):
        r.sampling_params = shared[i % k]
    out = Sampler()(LOGITS.repeat(per * k, 1), reqs, torch.Generator().manual_seed(3))
    tokens = torch.tensor(out.token_ids).view(per, k)
    for j, s in enumerate(settings[:-1]):
        assert_matches(torch.bincount(tokens[:, j], minlength=V).double(), exact(**s))
    assert torch.all(tokens[:, -1] == 0)  # the greedy rows


def filtered_probs(logits, temperature, top_k, top_p, min_p):
    """The filter kernels composed as the default processors apply them (0/-1/>=V top_k,
    top_p 1 and min_p 0 are off)."""
    logits = logits.float() / temperature[:, None]
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    logits = apply_min_p(apply_top_p(apply_top_k(logits, k), top_p.float()), min_p.float())
    return torch.softmax(logits, dim=-1)


def test_a_seeded_stream_depends_only_on_the_seed_and_the_tokens_so_far():
    """Counter-based: the draw after k tokens is the same on a fresh row as on one that
    drew those k itself (a request resumed after preemption continues its stream), and
    differs from draw to draw and from seed to seed."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(5))
    a = make_request([1], temperature=1.0, seed=7)
    for _ in range(12):
        a.output_token_ids.append(Sampler()(logits, [a]).token_ids[0])
    resumed = make_request([1], temperature=1.0, seed=7)
    resumed.output_token_ids.extend(a.output_token_ids[:6])
    for k in range(6, 12):
        assert Sampler()(logits, [resumed]).token_ids[0] == a.output_token_ids[k]
        resumed.output_token_ids.append(a.output_token_ids[k])
    assert len(set(a.output_token_ids)) > 3
    other = make_request([1], temperature=1.0, seed=8)
    draws = []
    for _ in range(12):
        draws.append(Sampler()(logits, [other]).token_ids[0])
        other.output_token_ids.append(draws[-1])
    assert draws != a.output_token_ids


def test_filter_kernels_match_exact_for_a_batch_of_mixed_settings():
    rows = [{"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.3}, {}, {"top_k": 4, "top_p": 0.8},
            {"temperature": 0.6, "top_k": -1, "min_p": 0.1}]
    probs = filtered_probs(
        LOGITS.repeat(len(rows), 1),
        torch.tensor([r.get("temperature", 1.0) for r in rows]),
        torch.tensor([r.get("top_k", 0) for r in rows]),
        torch.tensor([r.get("top_p", 1.0) for r in rows]),
        torch.tensor([r.get("min_p", 0.0) for r in rows]),
    )
    for row, r in enumerate(rows):
        torch.testing.assert_close(probs[row], exact(**r).float())


def test_greedy_and_top_k_one_pick_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    greedy = [make_request([1], temperature=0.0) for _ in range(3)]
    topk1 = [make_request([1], temperature=0.8, top_k=1) for _ in range(3)]
    out = Sampler()(logits, greedy + topk1, torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(-1).tolist()
    expected_lp = torch.log_softmax(logits, -1).max(-1).values
    torch.testing.assert_close(torch.tensor(out.logprobs), expected_lp)
    assert out.top == [None] * 6


def test_the_callers_logits_are_not_modified():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    before = logits.clone()
    reqs = [make_request([1, 2], temperature=0.5, top_k=3, repetition_penalty=1.5,
                         logit_bias={0: 10.0}) for _ in range(3)]
    Sampler()(logits, reqs, torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)


def test_expanded_logits_rows_are_processed_independently():
    # Parallel samples may hold identical rows; a stride-0 view must not alias the work.
    logits = LOGITS[None, :].expand(2, V)
    a = make_request([1], temperature=0.0, logit_bias={5: 50.0})
    b = make_request([1], temperature=0.0)
    assert Sampler()(logits, [a, b]).token_ids == [5, 0]


class _Recorder:
    """A processor that records the logits it sees (to inspect earlier steps)."""

    def __init__(self):
        self.seen = None

    def __call__(self, logits, batch):
        self.seen = logits.clone()
        return logits


def test_greedy_rows_skip_temperature_and_filters_but_keep_the_rest():
    recorder = _Recorder()
    sampler = Sampler(processors=[*default_processors(), recorder])
    logits = LOGITS.repeat(3, 1)
    filters = {"top_k": 2, "top_p": 0.3, "min_p": 0.9}
    greedy = make_request([1], temperature=0.0, **filters)
    random = make_request([1], temperature=0.5, **filters)
    plain = make_request([1], temperature=0.0)
    out = sampler(logits, [greedy, random, plain], torch.Generator().manual_seed(0))
    assert torch.equal(recorder.seen[0], LOGITS)  # untouched by temperature and filters
    assert torch.equal(recorder.seen[2], LOGITS)
    assert torch.isinf(recorder.seen[1]).sum() == V - 1  # the random row was filtered
    assert out.token_ids == [0, 0, 0]


@pytest.mark.parametrize(
    "params, expected",
    [
        ({"logit_bias": {4: 3.0}}, 4),
        ({"allowed_token_ids": [3, 6]}, 3),
        ({"repetition_penalty": 2.0}, 1),  # 2.2 / 2 < 1.9: token 0 (in the prompt) loses
        ({"presence_penalty": 1.0, "frequency_penalty": 0.0}, 1),
        ({"logits_processors": [lambda out, row: row.flip(0)]}, V - 1),
    ],
)
def test_greedy_rows_respect_bias_allowed_ids_penalties_and_processors(params, expected):
    r = make_request([0], temperature=0.0, top_k=1, **params)
    if "presence_penalty" in params:
        r.output_token_ids.append(0)
    assert Sampler()(LOGITS[None].clone(), [r]).token_ids == [expected]


def test_greedy_rows_respect_bad_words():
    class OneTokenPerWord:
        def encode(self, text, add_special_tokens=False):
            return [{"w0": 0, "w1": 1}.get(w, 99) for w in text.split()]

    r = make_request([1], temperature=0.0, bad_words=["w0"])
    out = Sampler(tokenizer=OneTokenPerWord())(LOGITS[None].clone(), [r])
    assert out.token_ids == [1]


def test_seeded_rows_do_not_depend_on_batch_neighbours():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))

    def tokens(batch_extra, position=-1, **neighbour):
        r = make_request([1], temperature=1.0, seed=1234)
        others = [make_request([1, 2, 3], **neighbour) for _ in range(batch_extra)]
        seq = []
        for _ in range(20):
            reqs = list(others)
            reqs.insert(position if position >= 0 else len(reqs), r)
            out = Sampler()(logits.repeat(len(reqs), 1), reqs,
                            torch.Generator().manual_seed(len(seq)))
            seq.append(out.token_ids[reqs.index(r)])
            r.output_token_ids.append(seq[-1])
        return seq

    base = tokens(0)
    assert base == tokens(5) == tokens(17, position=3)
    assert base == tokens(4, temperature=0.0, repetition_penalty=1.3)
    assert base == tokens(6, position=2, top_k=5, seed=7, logit_bias={1: 2.0})
    assert len(set(base)) > 1  # it really is sampling


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


def test_sampled_logprob_is_the_raw_one_whatever_the_processing():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 30, generator=gen) * 3
    reqs = [
        make_request([1, 2], temperature=0.3, repetition_penalty=1.8, logprobs=3),
        make_request([1], temperature=1.7, top_k=4, logit_bias={7: 20.0}, logprobs=0),
        make_request([4], temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0),
        make_request([1], temperature=0.9, min_p=0.2, allowed_token_ids=[3, 4, 5],
                     logprobs=30),
    ]
    reqs[2].output_token_ids.extend([int(logits[2].argmax())] * 2)
    out = Sampler()(logits.clone(), reqs, torch.Generator().manual_seed(0))
    raw = torch.log_softmax(logits, -1)
    chosen = torch.tensor(out.token_ids)
    torch.testing.assert_close(torch.tensor(out.logprobs), raw[torch.arange(4), chosen])
    assert out.token_ids[1] == 7  # the bias really applied
    assert out.token_ids[2] != int(logits[2].argmax())  # and the penalties
    assert out.token_ids[3] in (3, 4, 5)

    assert out.top[2] is None
    for row, k in [(0, 3), (1, 0), (3, 30)]:
        top = out.top[row]
        tok = out.token_ids[row]
        order = raw[row].argsort(descending=True).tolist()
        assert top.token_ids == (tok, *order[:k])
        torch.testing.assert_close(torch.tensor(top.logprobs),
                                   raw[row, list(top.token_ids)])
        assert top.ranks == (order.index(tok) + 1, *range(1, k + 1))


def test_logprobs_on_crafted_logits():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    r = make_request([1], temperature=0.0, logprobs=2, logit_bias={0: 100.0})
    out = Sampler()(logits.clone(), [r])
    assert out.token_ids == [0]  # forced by the bias; reported under the raw distribution
    top = out.top[0]
    assert top.token_ids == (0, 1, 3)
    assert top.ranks == (4, 1, 2)
    torch.testing.assert_close(
        torch.tensor(top.logprobs), torch.log(torch.tensor([0.1, 0.4, 0.3]))
    )
    assert out.logprobs[0] == pytest.approx(math.log(0.1), rel=1e-5)


def test_sampler_output_top_defaults_to_none_per_row():
    assert SamplerOutput([1, 2], [0.0, -1.0]).top == [None, None]
    assert Sampler()(torch.zeros(0, 5), []) == SamplerOutput([], [], [])


def test_sampling_params_validation_names_the_field():
    for kwargs, field in [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_seeded_top_k_rows_do_not_depend_on_neighbours_with_other_k():
    """Rows cut by top-k race among their own k survivors; the width of the batch's
    compact tensor (the largest k) must not change a seeded row's draw."""
    torch.manual_seed(0)
    logits = torch.randn(1, 300)

    seq_alone, seq_wide, seq_full = [], [], []
    a = make_request([1], temperature=1.0, top_k=5, seed=42)
    b = make_request([1], temperature=1.0, top_k=5, seed=42)
    c = make_request([1], temperature=1.0, top_k=5, seed=42)
    for _ in range(30):
        seq_alone.append(Sampler()(logits.clone(), [a]).token_ids[0])
        two = torch.cat([logits, logits])
        seq_wide.append(Sampler()(two, [b, make_request([1], temperature=1.0, top_k=200)])
                        .token_ids[0])
        seq_full.append(Sampler()(two.clone(), [c, make_request([1], temperature=0.5)])
                        .token_ids[0])
        # The seeded stream is counter-based: each draw's noise follows the tokens so far.
        for request, seq in ((a, seq_alone), (b, seq_wide), (c, seq_full)):
            request.output_token_ids.append(seq[-1])
    assert seq_alone == seq_wide == seq_full
    assert len(set(seq_alone)) > 1  # it does sample
    assert set(seq_alone) <= set(logits[0].topk(5).indices.tolist())


def test_plain_greedy_batches_skip_the_pipeline_but_custom_processors_still_run():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    plain = [make_request([1], temperature=0.0) for _ in range(3)]
    out = Sampler()(logits.clone(), plain)
    assert out.token_ids == logits.argmax(-1).tolist()
    torch.testing.assert_close(
        torch.tensor(out.logprobs), torch.log_softmax(logits, -1).max(-1).values
    )

    calls = []

    def ban_argmax(logits, batch):
        calls.append(len(batch.requests))
        return logits.scatter_(1, logits.argmax(-1, keepdim=True), float("-inf"))

    custom = Sampler(processors=[ban_argmax, *default_processors()])
    out = custom(logits.clone(), plain)
    assert calls == [3] and out.token_ids != logits.argmax(-1).tolist()
    # A greedy row with a bias is not plain: the pipeline runs.
    biased = [make_request([1], temperature=0.0, logit_bias={7: 100.0})] + plain[1:]
    assert Sampler()(logits.clone(), biased).token_ids[0] == 7


def test_parameter_columns_give_what_the_parameters_say():
    """The executor's per-row columns (set once per row) and a pass over the parameters
    give the same per-row tensors and the same random rows, whatever the row order."""
    import numpy as np

    from llmlab.sampling.metadata import ParamColumns, SamplingMetadata, SamplingRow

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.3, min_p=0.1, repetition_penalty=1.2,
                             frequency_penalty=0.5, presence_penalty=-0.25)]
    columns = ParamColumns(8)
    scheduler_rows = [5, 2, 7]
    for row, p in zip(scheduler_rows, params, strict=True):
        columns.set(row, p)
    rows = [SamplingRow(f"r{i}", p, (1,)) for i, p in enumerate(params)]
    plain = SamplingMetadata(rows, V, torch.device("cpu"))
    gathered = SamplingMetadata(rows, V, torch.device("cpu"), columns=columns,
                                row_ids=np.asarray(scheduler_rows))
    for name in ParamColumns.NAMES:
        torch.testing.assert_close(gathered.column(name), plain.column(name))
        torch.testing.assert_close(gathered.column(name, [2, 0]), plain.column(name, [2, 0]))
    assert gathered.random_rows == plain.random_rows == [1, 2]
