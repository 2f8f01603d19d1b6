"""Beam search against Hugging Face's, on tiny random-weight models.

``expand`` runs the HF model itself (full forward per sequence, ``log_softmax`` of the last
position, ``topk``), so any difference from ``generate`` is the search's. The reference is::

    model.generate(prompt, attention_mask=ones, do_sample=False, num_beams=W,
                   num_return_sequences=W, max_new_tokens=N, length_penalty=L,
                   early_stopping=False, eos_token_id=E, pad_token_id=0,
                   output_scores=True, return_dict_in_generate=True)

one prompt per call (no padding), no other logits processors. ``early_stopping=False`` is
HF's default and the setting whose "done" heuristic the module reproduces; ``eos_token_id=
None`` turns EOS off in HF, which is what ``ignore_eos=True`` (or no EOS ids) means here;
``sequences_scores`` is HF's ``sum_logprobs / generated_len ** length_penalty``, compared
with :func:`beam_score` of each returned sequence. Beam width 1 is compared with HF's greedy
search (``num_beams=1``), which is what HF runs for it. EOS is made reachable by naming as
EOS a token the model's greedy continuation actually produces (the tiny models' own EOS, id
1, is never likely), so finished-by-EOS hypotheses of several lengths compete with full-
length ones, and HF's rules that only the best ``W`` of the ``2W`` candidates may finish, and
that a prompt stops once its best live beam cannot beat the worst finished one, both decide
results in this grid (each was checked to: dropping either rule fails cases here).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import transformers

from llmlab.sampling.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_score,
    beam_search,
)
from llmlab.sampling.logprobs import Logprob

ARCHS = ["LlamaForCausalLM", "GPT2LMHeadModel"]
PROMPTS = [[0, 5, 17, 300, 42], [0, 99, 7], [0, 250, 251, 252, 253, 254, 10], [0, 1, 2, 3]]
WIDTH, MAX_NEW = 4, 6
PAD = 0


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP's spinning
    threads made this module 10x slower; restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    out = {}
    for arch in ARCHS:
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_factory(arch))
        out[arch] = model.eval()
    return out


def make_expand(model, calls=None):
    """``expand`` on an HF model: one forward per group of equal-length sequences."""

    def expand(sequences, k):
        if calls is not None:
            calls.append(([list(s) for s in sequences], k))
        out = [None] * len(sequences)
        by_len: dict[int, list[int]] = {}
        for i, seq in enumerate(sequences):
            by_len.setdefault(len(seq), []).append(i)
        with torch.no_grad():
            for rows in by_len.values():
                logits = model(torch.tensor([sequences[i] for i in rows])).logits[:, -1]
                values, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
                for j, i in enumerate(rows):
                    out[i] = list(zip(ids[j].tolist(), values[j].tolist(), strict=True))
        return out

    return expand


def hf_beams(model, prompt, *, eos, width=WIDTH, max_new=MAX_NEW, length_penalty=1.0):
    """HF's ``width`` best sequences (prompt + generated, EOS kept) and their scores."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=False,
            eos_token_id=eos,
            pad_token_id=PAD,
            output_scores=True,
            return_dict_in_generate=True,
        )
    # beam_indices is -1 past each sequence's end: it gives the generated length.
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    seqs = [out.sequences[i, : len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist()


def hf_greedy(model, prompt, *, eos, max_new=MAX_NEW):
    """HF's greedy sequence (cut after EOS) and the sum of its tokens' logprobs."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new,
            eos_token_id=eos,
            pad_token_id=PAD,
            output_logits=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[tok].item()
        for step, tok in zip(out.logits, generated, strict=False)
    ]
    for i, tok in enumerate(generated):
        if eos is not None and tok in eos:
            generated, logprobs = generated[: i + 1], logprobs[: i + 1]
            break
    return prompt + generated, sum(logprobs)


def greedy_tokens(model, prompt, n=4):
    """The first ``n`` tokens greedy decoding picks with no EOS: candidates for EOS ids."""
    seq, _ = hf_greedy(model, prompt, eos=None, max_new=n)
    return seq[len(prompt) :]


def assert_same_as_hf(output, prompt, hf_seqs, hf_scores, length_penalty, context):
    assert isinstance(output, BeamSearchOutput)
    got = [s.tokens for s in output.sequences]
    assert got == hf_seqs, f"{context}: sequences differ\n ours {got}\n hf   {hf_seqs}"
    scores = [
        beam_score(s.cum_logprob, len(s.tokens) - len(prompt), length_penalty)
        for s in output.sequences
    ]
    assert scores == pytest.approx(hf_scores, abs=1e-4), context


def check_fields(output, prompt, eos, max_len):
    """Per-sequence invariants: logprobs, cum_logprob, finish and stop reasons."""
    for seq in output.sequences:
        assert isinstance(seq, BeamSearchSequence)
        assert seq.tokens[: len(prompt)] == prompt
        generated = seq.tokens[len(prompt) :]
        assert len(seq.logprobs) == len(generated) >= 1
        for tok, position in zip(generated, seq.logprobs, strict=True):
            assert list(position) == [tok]
            assert isinstance(position[tok], Logprob)
            assert position[tok].rank >= 1 and position[tok].decoded_token is None
        assert seq.cum_logprob == pytest.approx(sum(p[t].logprob for t, p in
                                                    zip(generated, seq.logprobs, strict=True)))
        if generated[-1] in eos:
            assert (seq.finish_reason, seq.stop_reason) == ("stop", generated[-1])
            assert all(t not in eos for t in generated[:-1])
        else:
            assert (seq.finish_reason, seq.stop_reason) == ("length", None)
            assert len(seq.tokens) == max_len


# --- parameters ---------------------------------------------------------------------------


def test_params_defaults_and_positional_construction():
    p = BeamSearchParams(4, 16)
    assert (p.beam_width, p.max_tokens, p.ignore_eos, p.temperature) == (4, 16, False, 0.0)
    assert (p.length_penalty, p.include_stop_str_in_output) == (1.0, False)
    q = BeamSearchParams(beam_width=2, max_tokens=3, temperature=0.5, length_penalty=-1)
    assert (q.temperature, q.length_penalty) == (0.5, -1.0)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("beam_width", 0, ValueError),
        ("beam_width", -1, ValueError),
        ("beam_width", 2.0, TypeError),
        ("beam_width", True, TypeError),
        ("beam_width", None, TypeError),
        ("max_tokens", 0, ValueError),
        ("max_tokens", "8", TypeError),
        ("temperature", -0.5, ValueError),
        ("temperature", math.inf, ValueError),
        ("temperature", math.nan, ValueError),
        ("temperature", "0", TypeError),
        ("length_penalty", math.nan, ValueError),
        ("length_penalty", -math.inf, ValueError),
        ("length_penalty", None, TypeError),
        ("ignore_eos", 1, TypeError),
        ("include_stop_str_in_output", "yes", TypeError),
    ],
)
def test_params_reject_bad_values_naming_the_field(field, value, error):
    kwargs = {"beam_width": 2, "max_tokens": 4, field: value}
    with pytest.raises(error, match=field):
        BeamSearchParams(**kwargs)


# --- against Hugging Face -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0, -1.0])
def test_matches_hf_when_no_eos_is_reached(models, arch, length_penalty):
    """No EOS ids, and EOS ids with ignore_eos: both are HF with eos_token_id=None."""
    model = models[arch]
    expand = make_expand(model)
    for eos, ignore in [(frozenset(), False), (frozenset({1}), True)]:
        params = BeamSearchParams(WIDTH, MAX_NEW, ignore_eos=ignore, length_penalty=length_penalty)
        outputs = beam_search(expand, PROMPTS, params, eos)
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            hf_seqs, hf_scores = hf_beams(model, prompt, eos=None, length_penalty=length_penalty)
            assert_same_as_hf(output, prompt, hf_seqs, hf_scores, length_penalty, (prompt, eos))
            check_fields(output, prompt, frozenset(), len(prompt) + MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_hf_when_eos_is_reached(models, arch):
    """EOS = the greedy continuation's i-th token, so EOS competes at several lengths."""
    model = models[arch]
    expand = make_expand(model)
    stopped = early = 0
    for prompt in PROMPTS:
        greedy = greedy_tokens(model, prompt)
        for length_penalty, position in itertools.product([1.0, 0.0, 2.0, -1.0], range(4)):
            eos = frozenset({greedy[position]})
            params = BeamSearchParams(WIDTH, MAX_NEW, length_penalty=length_penalty)
            [output] = beam_search(expand, [prompt], params, eos)
            hf_seqs, hf_scores = hf_beams(
                model, prompt, eos=sorted(eos), length_penalty=length_penalty
            )
            context = (prompt, sorted(eos), length_penalty)
            assert_same_as_hf(output, prompt, hf_seqs, hf_scores, length_penalty, context)
            check_fields(output, prompt, eos, len(prompt) + MAX_NEW)
            stopped += [s.finish_reason for s in output.sequences].count("stop")
            early += all(len(s.tokens) < len(prompt) + MAX_NEW for s in output.sequences)
    # The grid must exercise what it is for: EOS-finished results, and prompts that ended
    # before max_tokens.
    assert stopped >= 10 and early >= 1, (stopped, early)


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_width_one_is_greedy(models, arch):
    model = models[arch]
    expand = make_expand(model)
    for prompt in PROMPTS:
        for eos_position in [None, 0, 2]:
            eos = None if eos_position is None else [greedy_tokens(model, prompt)[eos_position]]
            for length_penalty in [1.0, 0.0, 2.0]:
                params = BeamSearchParams(1, MAX_NEW, length_penalty=length_penalty)
                [output] = beam_search(expand, [prompt], params, frozenset(eos or ()))
                tokens, cum = hf_greedy(model, prompt, eos=eos)
                [seq] = output.sequences
                assert seq.tokens == tokens, (prompt, eos, length_penalty)
                assert seq.cum_logprob == pytest.approx(cum, abs=1e-4)
                assert seq.finish_reason == ("length" if eos is None else "stop")


def test_several_eos_ids_keep_hf_candidate_count(models):
    """With E EOS ids HF keeps (1 + E) * width candidates per step; so does the search."""
    model = models["GPT2LMHeadModel"]
    calls: list = []
    expand = make_expand(model, calls)
    for prompt in PROMPTS:
        eos = greedy_tokens(model, prompt)[:2]
        calls.clear()
        [output] = beam_search(expand, [prompt], BeamSearchParams(WIDTH, MAX_NEW), frozenset(eos))
        assert {k for _, k in calls} == {(1 + len(set(eos))) * WIDTH}
        hf_seqs, hf_scores = hf_beams(model, prompt, eos=sorted(set(eos)))
        assert_same_as_hf(output, prompt, hf_seqs, hf_scores, 1.0, (prompt, eos))


def test_max_model_len_caps_each_prompt(models):
    """A per-prompt cap at prompt + 3 tokens is HF with max_new_tokens=3 for that prompt."""
    model = models["LlamaForCausalLM"]
    expand = make_expand(model)
    max_model_len = 8  # leaves 3, 5, 1 and 4 tokens to the prompts
    outputs = beam_search(expand, PROMPTS, BeamSearchParams(WIDTH, MAX_NEW), frozenset(),
                          max_model_len=max_model_len)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        room = max_model_len - len(prompt)
        hf_seqs, hf_scores = hf_beams(model, prompt, eos=None, max_new=room)
        assert_same_as_hf(output, prompt, hf_seqs, hf_scores, 1.0, prompt)
        assert all(s.finish_reason == "length" for s in output.sequences)
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_model_len=5"):
        beam_search(expand, PROMPTS, BeamSearchParams(WIDTH, MAX_NEW), frozenset(),
                    max_model_len=5)


# --- the expand contract and output fields ------------------------------------------------


def test_one_expand_call_per_step_over_every_live_beam(models):
    model = models["LlamaForCausalLM"]
    calls: list = []
    params = BeamSearchParams(3, 4)
    beam_search(make_expand(model, calls), PROMPTS, params, frozenset())
    assert len(calls) == 4  # no EOS: every prompt runs to max_tokens, in lockstep
    first_sequences, k = calls[0]
    assert k == 2 * params.beam_width
    assert first_sequences == PROMPTS  # the first step expands each prompt once
    for step, (sequences, _) in enumerate(calls[1:], start=1):
        assert len(sequences) == len(PROMPTS) * params.beam_width
        assert sorted({len(s) for s in sequences}) == sorted(len(p) + step for p in PROMPTS)


def test_logprob_ranks_text_and_stop_string(models):
    model = models["GPT2LMHeadModel"]
    prompt = PROMPTS[2]
    eos = frozenset(greedy_tokens(model, prompt)[:1])

    def decode(tokens):
        return " ".join(map(str, tokens))

    for include in (False, True):
        params = BeamSearchParams(WIDTH, MAX_NEW, include_stop_str_in_output=include)
        [output] = beam_search(make_expand(model), [prompt], params, eos, decode=decode)
        stops = [s for s in output.sequences if s.finish_reason == "stop"]
        assert stops, "the greedy first token as EOS must finish a beam"
        for seq in output.sequences:
            ends_on_eos = seq.finish_reason == "stop"
            shown = seq.tokens[:-1] if ends_on_eos and not include else seq.tokens
            assert seq.text == decode(shown)
        # The one-token EOS hypothesis took the model's top token: rank 1.
        [(tok, logprob)] = stops[0].logprobs[0].items()
        assert tok in eos and logprob.rank == 1
    [plain] = beam_search(make_expand(model), [prompt], BeamSearchParams(2, 2), eos)
    assert all(s.text is None for s in plain.sequences)


def test_bad_inputs():
    def expand(sequences, k):
        return [[(3, -0.1), (4, -2.0)] for _ in sequences]

    params = BeamSearchParams(1, 2)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        beam_search(expand, [[1], []], params, frozenset())
    with pytest.raises(RuntimeError, match="expand returned 0"):
        beam_search(lambda seqs, k: [], [[1]], params, frozenset())
    # A toy expand: always 3 then 4; width 1 is greedy on it.
    [out] = beam_search(expand, [[1]], params, frozenset())
    assert out.sequences[0].tokens == [1, 3, 3]
    assert out.sequences[0].cum_logprob == pytest.approx(-0.2)
