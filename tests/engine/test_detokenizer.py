"""IncrementalDetokenizer: streamed text equals the full decode, stop strings, O(1) per token."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import transformers

from llmlab.engine.detokenizer import IncrementalDetokenizer, decode_token
from llmlab.sampling.params import SamplingParams
from llmlab.testing.tiny import _build_tokenizer

REPLACEMENT = "\ufffd"

TEXTS = [
    "Héllo wörld, ça va? naïve café",
    "日本語のテキストと中文 mixed with ASCII",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 end",
    "specials </s> inside <s>text</s> and\nnew lines\ttabs",
    "Ünïcödé ∑∫√ ≠ ≤ — “quotes” … ½",
    "plain ascii text with the and of to in",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny models' byte-level BPE tokenizer (fast; <s>=0, </s>=1 are special), saved and
    loaded as build_tiny_model does, without building a model (this file stays fast)."""
    path = tmp_path_factory.mktemp("detok_tokenizer")
    _build_tokenizer(vocab_size=512, max_length=1 << 20).save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("Question: what now?")


def feed(d: IncrementalDetokenizer, ids, chunks=None, rng=None):
    """Feed ``ids`` in chunks; return (deltas, cumulative texts reported, stop string)."""
    deltas, reported, stop = [], [], None
    i = 0
    while i < len(ids):
        n = 1 if rng is None else rng.randint(1, 4)
        if chunks is not None:
            n = chunks
        new = ids[i:i + n]
        i += len(new)
        stop = d.update(new, i)
        reported.append(d.text(False))
        deltas.append(d.delta(False))
        if stop is not None:
            break
    reported.append(d.text(True))
    deltas.append(d.delta(True))
    return deltas, reported, stop


def pieces_ids(tok, pieces):
    """Token ids whose boundaries include every boundary between ``pieces``."""
    ids = []
    for p in pieces:
        ids += tok.encode(p, add_special_tokens=False)
    assert tok.decode(ids) == "".join(pieces)
    return ids


# -- text equals the full decode --------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunking", ["one", "random", "all"])
def test_streamed_text_equals_full_decode(tok, prompt, skip, chunking):
    rng = random.Random(0)
    for text in TEXTS + [" ".join(TEXTS)]:
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) > 8
        d = IncrementalDetokenizer.from_params(
            tok, prompt, SamplingParams(skip_special_tokens=skip)
        )
        chunks = {"one": 1, "random": None, "all": len(ids)}[chunking]
        deltas, reported, stop = feed(d, ids, chunks=chunks, rng=rng)
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert stop is None
        assert d.output_text == expected
        assert "".join(deltas) == expected
        assert reported[-1] == expected
        # Test texts are valid UTF-8: a partial character is never reported.
        assert not any(REPLACEMENT in x for x in deltas)
        # Every cumulative report extends the previous one.
        for a, b in itertools.pairwise(reported):
            assert b.startswith(a)


def test_random_token_streams_match_decode_at_every_step(tok):
    """Arbitrary token ids (including special ones and the byte tokens that split characters):
    each step's text is decode(ids so far) minus an incomplete trailing character."""
    rng = random.Random(1)
    vocab = len(tok)
    for trial in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        skip = trial % 2 == 0
        d = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        visible = ""
        for k in range(len(ids)):
            d.update(ids[k:k + 1], k + 1)
            full = tok.decode(ids[:k + 1], skip_special_tokens=skip)
            if not full.endswith(REPLACEMENT):
                visible = full
            assert d.text(False) == visible
        assert d.text(True) == tok.decode(ids, skip_special_tokens=skip)


def test_incomplete_character_held_then_completed_or_flushed(tok):
    ids = tok.encode("日", add_special_tokens=False)
    assert len(ids) >= 2  # split across byte tokens by this small vocabulary
    d = IncrementalDetokenizer(tok, tok.encode("x"))
    for k, t in enumerate(ids[:-1]):
        d.update([t], k + 1)
        assert d.delta(False) == "" and d.output_text == ""
    d.update(ids[-1:], len(ids))
    assert d.delta(False) == "日"
    # Output that ends inside a character: flushed as U+FFFD when finished, like decode().
    d = IncrementalDetokenizer(tok, tok.encode("x"))
    d.update(ids[:-1], len(ids) - 1)
    assert d.text(False) == ""
    assert d.text(True) == tok.decode(ids[:-1]) and REPLACEMENT in d.output_text
    assert d.delta(True) == d.output_text


def test_prompt_ending_inside_a_character(tok):
    ids = tok.encode("a日b", add_special_tokens=False)
    for cut in range(1, len(ids)):
        d = IncrementalDetokenizer(tok, ids[:cut])
        deltas, _, _ = feed(d, ids[cut:])
        assert "".join(deltas) == d.output_text == tok.decode(ids[cut:])


# -- special tokens, detokenize=False ----------------------------------------------------------


def test_skip_special_tokens(tok, prompt):
    ids = pieces_ids(tok, ["Hi", "</s>", " there", "<s>", "!"])
    assert tok.eos_token_id in ids and tok.bos_token_id in ids
    on = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams(skip_special_tokens=True))
    off = IncrementalDetokenizer.from_params(
        tok, prompt, SamplingParams(skip_special_tokens=False)
    )
    assert "".join(feed(on, ids)[0]) == "Hi there!"
    assert "".join(feed(off, ids)[0]) == "Hi</s> there<s>!"


def test_stop_terminated_token_left_out_unless_include_stop_str(tok, prompt):
    ids = tok.encode("Hi", add_special_tokens=False) + [tok.eos_token_id]
    for include, expected in [(False, "Hi"), (True, "Hi</s>")]:
        params = SamplingParams(skip_special_tokens=False, include_stop_str_in_output=include)
        d = IncrementalDetokenizer.from_params(tok, prompt, params)
        d.update(ids, len(ids), stop_terminated=True)
        assert d.text(True) == expected


@pytest.mark.parametrize("how", ["detokenize_false", "no_tokenizer"])
def test_no_text_without_detokenization(tok, prompt, how):
    if how == "no_tokenizer":
        d = IncrementalDetokenizer.from_params(None, prompt, SamplingParams(stop=["Hi"]))
    else:
        params = SamplingParams(stop=["Hi"], detokenize=False)
        d = IncrementalDetokenizer.from_params(tok, prompt, params)
    ids = tok.encode("Hi Hi Hi", add_special_tokens=False)
    assert d.update(ids, len(ids)) is None  # stop strings are not checked either
    assert d.output_text == d.text(False) == d.text(True) == d.delta(True) == ""
    assert d.stop_string is None and d.num_tokens == len(ids)


# -- stop strings -----------------------------------------------------------------------------


def _visible_prefixes(tok, ids, skip=True):
    """Brute-force: the text visible after each token (held while it ends mid-character)."""
    out, visible = [], ""
    for k in range(len(ids)):
        full = tok.decode(ids[:k + 1], skip_special_tokens=skip)
        if not full.endswith(REPLACEMENT):
            visible = full
        out.append(visible)
    return out


def reference(tok, ids, stops, include, min_tokens):
    """The specified result by brute force (whole text every step): (text, stop)."""
    prev = ""
    for k, visible in enumerate(_visible_prefixes(tok, ids)):
        if k + 1 > min_tokens and len(visible) > len(prev):
            matches = []
            for s in stops:
                at = visible.find(s, max(0, len(prev) - len(s) + 1))
                if at >= 0:
                    matches.append((at, len(s), s))
            if matches:
                at, n, s = min(matches)
                return visible[:at + n] if include else visible[:at], s
        prev = visible
    return tok.decode(ids, skip_special_tokens=True), None


def test_stop_string_split_across_tokens(tok, prompt):
    ids = pieces_ids(tok, ["Hello wor", "ld: x", "y", "z", " and more"])
    for include, expected in [(False, "Hello world: "), (True, "Hello world: xyz")]:
        params = SamplingParams(stop=["xyz"], include_stop_str_in_output=include)
        d = IncrementalDetokenizer.from_params(tok, prompt, params)
        deltas, reported, stop = feed(d, ids)
        assert stop == "xyz" and d.stop_string == "xyz" and d.stopped
        assert d.output_text == "".join(deltas) == expected
        for r in reported:  # nothing reported is ever taken back
            assert expected.startswith(r)
        if not include:
            assert not any("x" in r for r in reported)  # "x", "xy" were held back
        # Updates after the stop are ignored.
        assert d.update(tok.encode("xyz", add_special_tokens=False), len(ids) + 3) is None
        assert d.output_text == expected


def test_partial_stop_prefix_held_until_disproved_or_finished(tok, prompt):
    params = SamplingParams(stop=["xyz"])
    d = IncrementalDetokenizer.from_params(tok, prompt, params)
    assert d.stop_buffer_length == 2
    ids = pieces_ids(tok, ["ab", "x", "y"])
    out = []
    for k in range(len(ids)):
        assert d.update(ids[k:k + 1], k + 1) is None
        out.append(d.delta(False))
    assert "".join(out) == "ab"  # "x", then "xy" held: they may start "xyz"
    assert not any("x" in x for x in out)
    more = tok.encode("q", add_special_tokens=False)
    d.update(more, len(ids) + 1)
    assert d.delta(False) == "x"  # "xyq" is no stop; the last 2 characters stay held
    assert d.delta(True) == "yq"
    assert d.output_text == "abxyq"
    # The same stream finished right after "y": everything comes out.
    d = IncrementalDetokenizer.from_params(tok, prompt, params)
    d.update(ids, len(ids))
    assert d.text(False) == "ab" and d.text(True) == "abxy"


def test_text_after_stop_in_same_token_is_dropped(tok, prompt):
    vocab = tok.get_vocab()
    long_tokens = [
        i for i in sorted(vocab.values())
        if len(t := tok.decode([i])) >= 4 and t.isascii() and t.strip() == t and t.isalpha()
    ]
    assert long_tokens
    token = long_tokens[0]
    word = tok.decode([token])
    stop = word[1:3]  # inside the token: text before and after it in the same token
    ids = pieces_ids(tok, ["123 "]) + [token] + pieces_ids(tok, [" tail"])
    for include, expected in [(False, "123 " + word[0]), (True, "123 " + word[:3])]:
        params = SamplingParams(stop=[stop], include_stop_str_in_output=include)
        d = IncrementalDetokenizer.from_params(tok, prompt, params)
        deltas, _, got = feed(d, ids, chunks=len(ids))
        assert got == stop
        assert d.output_text == "".join(deltas) == expected


def test_stop_at_start_and_several_candidates(tok, prompt):
    ids = pieces_ids(tok, ["STOP", " here and END"])
    d = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams(stop=["END", "STOP"]))
    assert feed(d, ids)[2] == "STOP" and d.output_text == ""
    # All at once: the earliest match wins, whatever the order in the list.
    ids = pieces_ids(tok, ["one two three"])
    d = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams(stop=["three", "two"]))
    d.update(ids, len(ids))
    assert d.stop_string == "two" and d.output_text == "one "
    # Same start: the shorter one (it was complete first).
    d = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams(stop=["two t", "tw"]))
    d.update(ids, len(ids))
    assert d.stop_string == "tw" and d.output_text == "one "


def test_stop_string_with_multibyte_characters(tok, prompt):
    ids = pieces_ids(tok, ["café 日本", "語 ok"])
    d = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams(stop=["本語"]))
    deltas, _, stop = feed(d, ids)
    assert stop == "本語" and "".join(deltas) == d.output_text == "café 日"


def test_min_tokens_ignores_earlier_stop(tok, prompt):
    ids = pieces_ids(tok, ["a", "b", "c", "b", "c", "d"])
    assert len(ids) == 6
    for min_tokens, expected in [(0, "a"), (2, "a"), (3, "abc"), (6, "abcbcd")]:
        params = SamplingParams(stop=["bc"], min_tokens=min_tokens)
        d = IncrementalDetokenizer.from_params(tok, prompt, params)
        _, _, stop = feed(d, ids)
        assert d.output_text == expected, min_tokens
        assert stop == (None if min_tokens == 6 else "bc")
    # Several tokens in one update: each is checked with its own output length.
    d = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams(stop=["bc"], min_tokens=3))
    assert d.update(ids, len(ids)) == "bc" and d.output_text == "abc"


def test_random_streams_against_brute_force(tok, prompt):
    """Random pieces, stops and chunking against the specification computed naively."""
    rng = random.Random(7)
    alphabet = ["a", "b", "c", "ab", "bca", " ", "é", "日", "😀", "x", "cab", "\n"]
    for trial in range(150):
        pieces = [rng.choice(alphabet) for _ in range(rng.randint(1, 25))]
        ids = pieces_ids(tok, pieces)
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
                 for _ in range(rng.randint(1, 3))]
        if trial % 5 == 0:
            stops.append(rng.choice(["é日", "😀a", " b", "\nc"]))
        include = rng.random() < 0.3
        min_tokens = rng.choice([0, 0, 1, 3, 8])
        params = SamplingParams(stop=stops, include_stop_str_in_output=include,
                                min_tokens=min_tokens)
        d = IncrementalDetokenizer.from_params(tok, prompt, params)
        deltas, reported, stop = feed(d, ids, rng=rng)
        want_text, want_stop = reference(tok, ids, stops, include, min_tokens)
        context = (pieces, stops, include, min_tokens)
        assert (d.output_text, stop) == (want_text, want_stop), context
        assert "".join(deltas) == want_text, context
        assert all(want_text.startswith(r) for r in reported), context
        assert not any(REPLACEMENT in x for x in deltas), context


# -- cost per token -----------------------------------------------------------------------------


class CountingSlowTokenizer:
    """A slow (non-``is_fast``) tokenizer that counts the ids it decodes."""

    is_fast = False

    def __init__(self, inner):
        self.inner = inner
        self.all_special_ids = inner.all_special_ids
        self.calls = 0
        self.ids_decoded = 0

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        self.calls += 1
        self.ids_decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def _long_ids(tok, n=2000):
    ids = []
    while len(ids) < n:
        ids += tok.encode(" ".join(TEXTS), add_special_tokens=False)
    return ids[:n]


@pytest.mark.parametrize("stream", ["text", "invalid_bytes", "specials"])
def test_decoding_cost_per_token_is_constant_slow_path(tok, prompt, stream):
    n = 2000
    ids = {
        "text": _long_ids(tok, n),
        # Lone UTF-8 continuation bytes: text that never becomes valid must not grow the window.
        "invalid_bytes": tok.encode("é", add_special_tokens=False)[-1:] * n,
        "specials": [tok.eos_token_id] * n,
    }[stream]
    if stream == "invalid_bytes":
        assert tok.decode(ids[:3]) == REPLACEMENT * 3
    counting = CountingSlowTokenizer(tok)
    d = IncrementalDetokenizer.from_params(counting, prompt, SamplingParams(stop=["zzz"]))
    for k in range(n):
        d.update(ids[k:k + 1], k + 1)
    d.finish()
    assert d.output_text == tok.decode(ids, skip_special_tokens=True)
    assert counting.calls <= 2 * n + 10
    if stream == "specials":  # skipped special tokens are not even decoded
        assert counting.calls <= 25
    assert counting.ids_decoded < 20 * n, counting.ids_decoded / n


def test_decoding_cost_per_token_is_constant_fast_path(tok, prompt):
    n = 2000
    ids = _long_ids(tok, n)
    d = IncrementalDetokenizer.from_params(tok, prompt, SamplingParams())
    inner = d._decode
    seen = []

    def counting(window):
        seen.append(len(window))
        return inner(window)

    d._decode = counting
    for k in range(0, n, 3):  # several tokens per update too
        d.update(ids[k:k + 3], min(k + 3, n))
    assert d.text(True) == tok.decode(ids, skip_special_tokens=True)
    assert len(seen) <= 2 * n and sum(seen) < 20 * n and max(seen) <= 20


# -- other tokenizers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_tok():
    return _sentencepiece_style_tokenizer()


def _sentencepiece_style_tokenizer():
    """A Llama-2-style tokenizer built offline: "▁" for spaces, byte fallback, and a decoder
    that strips the leading space of the text (so a lone first token loses its space)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from llmlab.testing.tiny_corpus import corpus_lines

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never", split=True)
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=40, show_progress=False)
    backend.train_from_iterator(corpus_lines(), trainer=trainer)
    spec = json.loads(backend.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{b:02X}>": base + b for b in range(256)})  # byte-fallback pieces
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )


@pytest.mark.parametrize("skip", [True, False])
def test_sentencepiece_style_first_token_decodes_in_context(sp_tok, skip):
    sp = sp_tok
    text = "Hello there, my café 日本 😀 friend</s> again"
    full = [sp.bos_token_id] + sp.encode(text, add_special_tokens=False)
    assert any(sp.convert_ids_to_tokens(i).startswith("<0x") for i in full)  # byte fallback
    whole = sp.decode(full, skip_special_tokens=skip)
    differs = 0
    for cut in range(1, len(full)):
        head = sp.decode(full[:cut], skip_special_tokens=skip)
        if head.endswith(REPLACEMENT) or not whole.startswith(head):
            continue  # the prompt ends inside a character
        params = SamplingParams(skip_special_tokens=skip)
        d = IncrementalDetokenizer.from_params(sp, full[:cut], params)
        deltas, _, _ = feed(d, full[cut:])
        assert "".join(deltas) == d.output_text == whole[len(head):], cut
        assert not any(REPLACEMENT in x for x in deltas)
        differs += d.output_text != sp.decode(full[cut:], skip_special_tokens=skip)
    assert differs >= 3  # decoded alone, the first "▁word" would lose its space


def test_slow_tokenizer_byt5():
    sp = transformers.ByT5Tokenizer()
    assert not sp.is_fast
    ids = sp.encode(" ".join(TEXTS), add_special_tokens=True)
    for skip in (True, False):
        d = IncrementalDetokenizer(sp, sp.encode("hi"), skip_special_tokens=skip,
                                   spaces_between_special_tokens=False, stop=["ASCII"])
        deltas, _, stop = feed(d, ids)
        expected = sp.decode(ids, skip_special_tokens=skip)
        assert stop == "ASCII"
        assert "".join(deltas) == d.output_text == expected[:expected.index("ASCII")]


# -- decode_token -----------------------------------------------------------------------------


def test_decode_token_matches_single_token_decode(tok):
    for i in [0, 1, 5, 100, 300, len(tok) - 1]:
        assert decode_token(tok, i) == tok.decode([i])
        assert decode_token(tok, i, True) == tok.decode([i], skip_special_tokens=True)
    assert decode_token(tok, tok.eos_token_id) == "</s>"
    assert decode_token(tok, tok.eos_token_id, skip_special_tokens=True) == ""
    assert decode_token(tok, len(tok) + 100) == ""  # padded vocabulary row
    assert decode_token(tok, -1) == ""


def test_decode_token_is_cached_per_tokenizer(tok):
    counting = CountingSlowTokenizer(tok)
    for _ in range(5):
        assert decode_token(counting, 42) == tok.decode([42])
    assert counting.calls == 1
    assert decode_token(counting, 42, skip_special_tokens=True) == tok.decode([42])
    assert counting.calls == 2  # cached per (token, skip_special_tokens)
    other = CountingSlowTokenizer(tok)  # another tokenizer: its own cache
    decode_token(other, 42)
    assert other.calls == 1


def _builtin_tokenizer():
    from llmlab.builtin import ensure_builtin_model

    return transformers.AutoTokenizer.from_pretrained(str(ensure_builtin_model()))


@pytest.mark.parametrize("which", ["tiny", "builtin"])
def test_the_final_tokens_in_one_decode_give_the_token_by_token_text(tok, which, monkeypatch):
    """A request without stop strings whose text is due only at its end (``FINAL_ONLY``) is
    decoded in one call then (``update(..., final=True)``): the same text as feeding the
    tokens one by one, for whole texts, arbitrary ids (split characters, specials, ids the
    window holds back), skipped specials and an EOS left out."""
    tokenizer = tok if which == "tiny" else _builtin_tokenizer()
    one_call, took = [], []
    append_all = IncrementalDetokenizer._append_all
    monkeypatch.setattr(IncrementalDetokenizer, "_append_all",
                        lambda self, ids: one_call.append(append_all(self, ids)) or one_call[-1])
    rng = random.Random(7)
    cases = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    cases += [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(2, 60))]
              for _ in range(60)]
    for i, ids in enumerate(cases):
        prompt = tokenizer.encode(TEXTS[i % len(TEXTS)], add_special_tokens=False)[-7:]
        params = SamplingParams(skip_special_tokens=i % 2 == 0)
        terminated = i % 3 == 0
        one = IncrementalDetokenizer.from_params(tokenizer, prompt, params)
        for k in range(len(ids)):
            one.update(ids[k:k + 1], k + 1, stop_terminated=terminated and k == len(ids) - 1)
        at_once = IncrementalDetokenizer.from_params(tokenizer, prompt, params)
        calls = len(one_call)
        at_once.update(ids, len(ids), stop_terminated=terminated, final=True)
        took.append(len(one_call) > calls and one_call[-1])
        assert at_once.text(True) == one.text(True), (which, ids)
    # The whole texts (their last token kept) took the one-call path; some random ids fell
    # back to token by token.
    assert all(took[i] for i in range(len(TEXTS)) if i % 3)
    assert not all(took)
