"""The logits processors, one at a time, on crafted logits and token histories."""

import sys
import types

import pytest
import torch

from llmlab.sampling import Sampler
from llmlab.sampling.metadata import SamplingRow
from llmlab.sampling.processors import (
    AllowedTokenIds,
    BadWords,
    CustomLogitsProcessors,
    LogitBias,
    LogitsProcessor,
    MinTokens,
    Penalties,
    SamplingBatch,
    StructuredOutputMask,
    count_tokens,
    default_processors,
    tokenize_bad_words,
)
from tests.helpers import make_request

NEG_INF = float("-inf")


def row(**params):
    """Per-row sampling state over a fresh request (what carries a grammar)."""
    return SamplingRow.of(request(**params))


def batch_of(requests, vocab=8, tokenizer=None):
    return SamplingBatch(requests, vocab, torch.device("cpu"), tokenizer=tokenizer)


def request(prompt=(1,), output=(), **params):
    r = make_request(list(prompt), **params)
    r.output_token_ids.extend(output)
    return r


def crafted(rows=1, vocab=8):
    # Positive and negative logits, so the repetition penalty's two branches both show.
    base = torch.tensor([1.5, -0.5, 2.0, -1.0, 0.5, 3.0, -2.0, 0.0])[:vocab]
    return base.repeat(rows, 1)


# -- cost: every processor leaves a batch that does not use it alone ----------------------


def test_every_processor_is_a_no_op_for_default_params():
    reqs = [request(output=(2, 2, 3)), request(temperature=0.0)]
    logits = crafted(2)
    batch = batch_of(reqs)
    for processor in default_processors():
        assert isinstance(processor, LogitsProcessor)
        work = logits.clone()
        out = processor(work, batch)
        assert out is work, processor
        assert torch.equal(out, logits), processor


# -- penalties -----------------------------------------------------------------------------


def expected_penalties(logits, prompt, output, rep=1.0, freq=0.0, pres=0.0):
    """The documented formulas, token by token."""
    out = logits.clone()
    for t in range(len(out)):
        x = float(out[t])
        if t in prompt or t in output:
            x = x / rep if x > 0 else x * rep
        x -= freq * output.count(t)
        x -= pres * (t in output)
        out[t] = x
    return out


HISTORIES = [
    # (prompt, output): tokens with positive and negative logits, repeated, prompt only,
    # output only, and an id beyond the logits (ignored).
    ((0, 1, 1), (2, 3, 3, 3, 5)),
    ((5, 6), ()),
    ((), (7, 0, 0, 11)),
]


@pytest.mark.parametrize(
    "penalty",
    [{"rep": 1.7}, {"rep": 0.6}, {"freq": 0.4}, {"freq": -0.3}, {"pres": 1.1},
     {"pres": -0.8}, {"rep": 1.3, "freq": 0.5, "pres": 0.25}],
)
def test_penalties_match_the_formulas(penalty):
    names = {"rep": "repetition_penalty", "freq": "frequency_penalty", "pres": "presence_penalty"}
    params = {names[k]: v for k, v in penalty.items()}
    reqs = [request(p, o, **params) for p, o in HISTORIES]
    # A row without penalties in the middle: untouched, and the others still line up.
    reqs.insert(1, request((0, 2), (2, 5)))
    logits = crafted(len(reqs))
    out = Penalties()(logits.clone(), batch_of(reqs))
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    for row, (p, o) in zip((0, 2, 3), HISTORIES, strict=True):
        expected = expected_penalties(logits[row], p, list(o), **penalty)
        torch.testing.assert_close(out[row], expected)
    assert not torch.equal(out[0], logits[0])  # the case really exercises the penalty


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    vocab = 50
    logits = torch.randn(3, vocab, generator=gen) * 2
    histories = [([3, 4, 4, 9], [9, 10, 17]), ([1, 2], [2, 30, 31, 31]), ([5] * 6, [49, 0])]
    for penalty in (1.4, 0.7):
        reqs = [request(p, o, repetition_penalty=penalty) for p, o in histories]
        ours = Penalties()(logits.clone(), batch_of(reqs, vocab))
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        for row, (p, o) in enumerate(histories):
            theirs = hf(torch.tensor([p + o]), logits[row : row + 1].clone())
            torch.testing.assert_close(ours[row], theirs[0])


def test_count_tokens_counts_per_row_and_drops_ids_beyond_the_vocabulary():
    counts = count_tokens([[1, 1, 3], [], [0, 9, 9, 2]], vocab_size=4)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 1, 0]]
    assert count_tokens([], 4).shape == (0, 4)


# -- logit bias, allowed ids, min tokens ---------------------------------------------------


def test_logit_bias_is_added_and_ids_beyond_the_logits_are_ignored():
    reqs = [
        request(logit_bias={2: 5.0, 7: -100.0, 50: 3.0}),
        request(),
        request(logit_bias={0: 1.25}),
    ]
    logits = crafted(3)
    out = LogitBias()(logits.clone(), batch_of(reqs))
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 100.0
    expected[2, 0] += 1.25
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_allowed_token_ids_leave_only_those():
    reqs = [request(allowed_token_ids=[1, 4, 30]), request(), request(allowed_token_ids=[7])]
    logits = crafted(3)
    out = AllowedTokenIds()(logits.clone(), batch_of(reqs))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1, 4]
    assert torch.equal(out[0, [1, 4]], logits[0, [1, 4]])
    assert torch.equal(out[1], logits[1])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [7]


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    def make(n_out, **params):
        r = request(output=[0] * n_out, min_tokens=3, stop_token_ids=[4, 99], **params)
        r.eos_token_ids = frozenset({1, 6, 120})  # 99 and 120 are past the logits: ignored
        return r

    reqs = [make(0), make(2), make(3), make(1, ignore_eos=True), make(5)]
    logits = crafted(len(reqs))
    out = MinTokens()(logits.clone(), batch_of(reqs))
    for row in (0, 1):
        assert torch.isinf(out[row]).nonzero().flatten().tolist() == [1, 4, 6]
    assert torch.equal(out[2], logits[2])  # min_tokens reached
    assert torch.isinf(out[3]).nonzero().flatten().tolist() == [4]  # EOS allowed
    assert torch.equal(out[4], logits[4])


# -- bad words -----------------------------------------------------------------------------


def word_tokenizer():
    """A real (HF fast) tokenizer with one token per word, and distinct " word" tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "hello", "Ġhello", "New", "ĠNew", "York", "ĠYork", "the", "Ġthe",
             "cat", "Ġcat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]"), tok


def test_bad_words_tokenization_follows_vllm():
    hf, raw = word_tokenizer()
    for tokenizer in (hf, raw):  # transformers' list or tokenizers' Encoding
        assert tokenize_bad_words(["hello", " New York"], tokenizer) == [
            (1,), (2,), (3, 6), (4, 6)
        ]

    class SpaceIsItsOwnToken:
        def encode(self, text, add_special_tokens=False):
            return [0] * text.startswith(" ") + [len(w) for w in text.split()]

    # " ab" tokenizes to one more token than "ab": vLLM keeps only the plain form.
    assert tokenize_bad_words(["ab"], SpaceIsItsOwnToken()) == [(2,)]


def test_bad_words_ban_single_tokens_always_and_multi_token_words_after_their_prefix():
    hf, _ = word_tokenizer()
    vocab = 11
    words = ["hello", "New York"]
    reqs = [
        request(output=(), bad_words=words),
        request(output=(7, 3), bad_words=words),  # "... New": York banned
        request(output=(4,), bad_words=words),  # " New": York banned
        request(output=(3, 7), bad_words=words),  # New is not the last token
        request(output=(3,)),  # no bad words
    ]
    logits = torch.zeros(len(reqs), vocab)
    out = BadWords()(logits.clone(), batch_of(reqs, vocab, tokenizer=hf))
    banned = [torch.isinf(row).nonzero().flatten().tolist() for row in out]
    assert banned == [[1, 2], [1, 2, 6], [1, 2, 6], [1, 2], []]


def test_bad_words_are_tokenized_once_and_need_a_tokenizer():
    hf, _ = word_tokenizer()
    calls = []

    class Counting:
        def encode(self, text, add_special_tokens=False):
            calls.append(text)
            return hf.encode(text, add_special_tokens=add_special_tokens)

    processor, counting = BadWords(), Counting()
    reqs = [request(bad_words=["cat"]), request(bad_words=["cat"])]
    for _ in range(3):
        out = processor(torch.zeros(2, 11), batch_of(reqs, 11, tokenizer=counting))
        assert torch.isinf(out).nonzero().tolist() == [[0, 9], [0, 10], [1, 9], [1, 10]]
    assert calls == ["cat", " cat"]

    with pytest.raises(ValueError, match="tokenizer"):
        Sampler()(torch.zeros(1, 11), [request(bad_words=["cat"])])


# -- custom logits processors --------------------------------------------------------------


def test_custom_processors_get_their_arguments_and_run_in_order():
    seen = []

    def two(output_ids, row):
        seen.append(("two", output_ids, row.clone()))
        row[0] = 100.0  # in place, returned
        return row

    def three(prompt_ids, output_ids, row):
        seen.append(("three", prompt_ids, output_ids, row.clone()))
        return row * 2  # a new tensor

    class Callable2:
        def __call__(self, output_ids, logits):
            return logits - 1.0

    reqs = [
        request((5, 6), (1, 2), logits_processors=[two, three]),
        request((7,), (3,)),
        request((8,), (), logits_processors=[Callable2()]),
    ]
    logits = crafted(3)
    out = CustomLogitsProcessors()(logits.clone(), batch_of(reqs))
    expected0 = logits[0].clone()
    expected0[0] = 100.0
    torch.testing.assert_close(out[0], expected0 * 2)
    assert torch.equal(out[1], logits[1])
    torch.testing.assert_close(out[2], logits[2] - 1.0)
    assert seen[0][:2] == ("two", (1, 2)) and torch.equal(seen[0][2], logits[0])
    assert seen[1][:3] == ("three", (5, 6), (1, 2))
    assert torch.equal(seen[1][3], expected0)


def test_a_custom_processor_returning_the_wrong_shape_is_named():
    r = request(logits_processors=[lambda out, row: row[:3]])
    with pytest.raises(ValueError, match="1-D tensor of 8 logits"):
        CustomLogitsProcessors()(crafted(), batch_of([r]))


# -- structured outputs --------------------------------------------------------------------


class FakeGrammar:
    def __init__(self, allowed):
        self.allowed = allowed


def fake_apply(calls):
    def apply_grammar_masks(logits, grammars):
        calls.append(list(grammars))
        for row, g in enumerate(grammars):
            if g is not None:
                keep = logits[row, list(g.allowed)].clone()
                logits[row] = NEG_INF
                logits[row, list(g.allowed)] = keep

    return apply_grammar_masks


def test_structured_mask_applies_to_rows_with_a_grammar(monkeypatch):
    calls = []
    module = types.ModuleType("llmlab.sampling.structured")
    module.apply_grammar_masks = fake_apply(calls)
    monkeypatch.setitem(sys.modules, "llmlab.sampling.structured", module)

    g = FakeGrammar({2, 3})
    a, b = row(), request()
    a.grammar = g
    logits = crafted(2)
    out = StructuredOutputMask()(logits.clone(), batch_of([a, b]))
    assert calls == [[g, None]]
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2, 3]
    assert torch.equal(out[1], logits[1])

    # Through the whole sampler: a greedy row follows the grammar (the argmax is 5).
    a = row(temperature=0.0)
    a.grammar = g
    assert Sampler()(crafted(), [a]).token_ids == [2]
    # No grammar in the batch: the module is never called.
    calls.clear()
    Sampler()(crafted(), [request()], torch.Generator().manual_seed(0))
    assert calls == []


def test_structured_mask_function_can_be_injected():
    calls = []
    g = FakeGrammar({4})
    r = row(temperature=1.0)
    r.grammar = g
    sampler = Sampler(processors=[StructuredOutputMask(apply_masks=fake_apply(calls))])
    assert sampler(crafted(), [r], torch.Generator().manual_seed(0)).token_ids == [4]
    assert calls == [[g]]


# -- composition ---------------------------------------------------------------------------


def test_a_researchers_processor_can_be_inserted():
    class BanToken:
        def __init__(self, token):
            self.token = token

        def __call__(self, logits, batch):
            rows = batch.rows_where(lambda p: p.temperature == 0.0)
            if rows:
                logits[batch.index(rows), self.token] = NEG_INF
            return logits

    processors = default_processors()
    processors.insert(1, BanToken(5))  # 5 is the argmax of the crafted logits
    sampler = Sampler(processors=processors)
    reqs = [request(temperature=0.0), request(temperature=0.0, logit_bias={5: 50.0})]
    assert sampler(crafted(2), reqs).token_ids == [2, 2]
    assert Sampler()(crafted(2), reqs).token_ids == [5, 5]


def test_sparse_penalties_equal_the_dense_formula_on_random_histories():
    from llmlab.sampling.processors import Penalties, apply_penalties, count_tokens

    gen = torch.Generator().manual_seed(3)
    vocab = 50
    requests = []
    for i in range(6):
        prompt = torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=gen)),),
                               generator=gen).tolist()
        r = make_request(prompt, repetition_penalty=[1.0, 1.3, 0.7][i % 3],
                         frequency_penalty=[0.0, 0.4, -0.5][(i + 1) % 3],
                         presence_penalty=[0.0, 0.9, 1.5][(i + 2) % 3])
        for t in torch.randint(0, vocab, (i * 3,), generator=gen).tolist():
            r.append_output(t, 0.0)
        requests.append(r)
    logits = torch.randn(6, vocab, generator=gen)
    got = Penalties()(logits.clone(), SamplingBatch(requests, vocab, torch.device("cpu")))
    ps = [r.sampling_params for r in requests]
    want = apply_penalties(
        logits.clone(),
        count_tokens([r.output_token_ids for r in requests], vocab),
        count_tokens([r.prompt_token_ids for r in requests], vocab),
        torch.tensor([p.repetition_penalty for p in ps]),
        torch.tensor([p.frequency_penalty for p in ps]),
        torch.tensor([p.presence_penalty for p in ps]),
    )
    torch.testing.assert_close(got, want)
