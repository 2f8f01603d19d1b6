"""Structured outputs: xgrammar-backed logits masks, driven by random "models".

A random-weight model is the hardest case for a constraint (it puts weight on every token,
whitespace and oddities included), so generation is emulated with random logits: each
step draws fresh logits, masks them, takes the argmax and feeds it back, until EOS. The
decoded text must then satisfy the constraint.
"""

from __future__ import annotations

import json
import re
import sys
import threading

import pytest
import torch

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from llmlab.sampling.params import GuidedDecodingParams, StructuredOutputsParams
from llmlab.sampling.structured import (
    StructuredOutputBackend,
    apply_grammar_masks,
)

SEEDS = range(20)
PADDING = 70  # model vocabulary beyond the tokenizer's (and not a multiple of 32)

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": -5, "maximum": 100},
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["color", "ok", "count", "name", "tags"],
    "additionalProperties": False,
}
EMAIL = r"[a-z]{3,8}@(foo|bar)\.com"
GREETING = 'root ::= greeting " " name ("!" | ".")\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,6}\n'
CHOICES = ['say "hi"', "back\\slash", "new\nline", "tab\there", "café ☕", "\x01ctl", "😀x", "a", "ab"]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def vocab(tokenizer) -> int:
    return len(tokenizer) + PADDING


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.eos_token_id


@pytest.fixture(scope="module")
def backend(tokenizer, vocab, eos):
    return StructuredOutputBackend(tokenizer, vocab, [eos])


def _state(backend, **kind):
    return backend.new_state(backend.compile(StructuredOutputsParams(**kind)))


def _allowed(backend, state) -> torch.Tensor:
    logits = torch.zeros(1, backend.vocab_size)
    apply_grammar_masks(logits, [state])
    return torch.isfinite(logits[0])


def _generate(tokenizer, state, seed, *, bias=None, scale=4.0, max_tokens=400) -> str:
    """Random logits -> mask -> argmax -> accept, until EOS; the decoded text."""
    vocab, eos = state._backend.vocab_size, tokenizer.eos_token_id
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(max_tokens):
        logits = torch.randn(1, vocab, generator=generator) * scale
        if bias is not None:
            logits += bias
        apply_grammar_masks(logits, [state])
        allowed = torch.isfinite(logits[0])
        assert allowed.any()
        assert not allowed[len(tokenizer):].any(), "a token beyond the tokenizer was allowed"
        token = int(logits[0].argmax())
        assert state.accept(token)
        if token == eos:
            assert state.is_terminated
            text = tokenizer.decode(tokens)
            # No special token slipped in (a detokenizer that skips them prints the same).
            assert tokenizer.decode(tokens, skip_special_tokens=True) == text
            return text
        assert not state.is_terminated
        tokens.append(token)
    pytest.fail(f"seed {seed}: no EOS within {max_tokens} tokens: {tokenizer.decode(tokens)!r}")


# --------------------------------------------------------------- random walks


def _reordered(schema: dict) -> dict:
    return {**schema, "properties": dict(reversed(list(schema["properties"].items())))}


@pytest.mark.parametrize("variant", ["dict", "string", "reordered"])
def test_json_schema_outputs_validate_and_are_compact(backend, tokenizer, variant):
    schema = {"dict": SCHEMA, "string": json.dumps(SCHEMA), "reordered": _reordered(SCHEMA)}
    schema = schema[variant]
    order = list(json.loads(schema)["properties"] if variant == "string" else schema["properties"])
    for seed in SEEDS:
        text = _generate(tokenizer, _state(backend, json=schema), seed)
        value = json.loads(text)  # strict: raw control characters in strings fail here
        jsonschema.validate(value, SCHEMA)
        assert list(value) == order  # properties in the schema's order
        # One line, fixed separators: exactly what json.dumps writes.
        assert text == json.dumps(value, ensure_ascii=False), text


def test_regex_outputs_fullmatch(backend, tokenizer):
    for seed in SEEDS:
        text = _generate(tokenizer, _state(backend, regex=EMAIL), seed)
        assert re.fullmatch(EMAIL, text), text


def test_choice_outputs_are_members(backend, tokenizer):
    seen = set()
    for seed in SEEDS:
        text = _generate(tokenizer, _state(backend, choice=CHOICES), seed)
        assert text in CHOICES
        seen.add(text)
    assert len(seen) > 1


def test_each_choice_is_accepted_exactly(backend, tokenizer, eos):
    compiled = backend.compile(StructuredOutputsParams(choice=CHOICES))
    for choice in CHOICES:
        state = backend.new_state(compiled)
        ids = tokenizer.encode(choice, add_special_tokens=False)
        assert state.accept_many(ids) == len(ids), choice
        assert state.accept(eos) and state.is_terminated
    state = backend.new_state(compiled)
    ids = tokenizer.encode("say hi", add_special_tokens=False)
    assert state.accept_many(ids) < len(ids)


def test_grammar_outputs_are_sentences(backend, tokenizer):
    for seed in SEEDS:
        text = _generate(tokenizer, _state(backend, grammar=GREETING), seed)
        assert re.fullmatch(r"(hello|hi) [a-z]{1,6}[!.]", text), text


def test_json_object_outputs_are_objects(backend, tokenizer, vocab):
    # Free-form JSON has unbounded strings and nesting; a model that likes closing them a
    # little keeps a random walk short.
    bias = torch.zeros(vocab)
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        if text and set(text) <= set('"}]'):
            bias[i] = 1.0
    assert bias.sum() >= 3
    shapes = set()
    for seed in SEEDS:
        text = _generate(tokenizer, _state(backend, json_object=True), seed, bias=bias, scale=1.0)
        value = json.loads(text)
        assert isinstance(value, dict), text
        assert text == json.dumps(value, ensure_ascii=False), text
        shapes.add(bool(value))
    assert shapes == {False, True}


def test_bounded_json_strings_exclude_control_characters(backend, tokenizer):
    # xgrammar writes maxLength strings' characters as [^"\\\r\n]; the backend narrows it.
    state = _state(backend, json={"type": "string", "maxLength": 5})
    assert state.accept(tokenizer.convert_tokens_to_ids('"'))
    allowed = _allowed(backend, state).nonzero().flatten().tolist()
    texts = [tokenizer.decode([t]) for t in allowed if t != tokenizer.eos_token_id]
    assert len(texts) > 100
    assert not [t for t in texts if any(ord(c) < 0x20 for c in t)]


def _byte_token(tokenizer, byte: int) -> int:
    """The byte-level BPE token of one raw byte (GPT-2's byte-to-character table)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    if byte in printable:
        char = chr(byte)
    else:
        char = chr(0x100 + [b for b in range(256) if b not in printable].index(byte))
    token = tokenizer.convert_tokens_to_ids(char)
    assert tokenizer.convert_ids_to_tokens(token) == char
    return token


def test_json_strings_are_valid_utf8(backend, tokenizer):
    # xgrammar's negated classes match a UTF-8-encoded surrogate (ED A0-BF xx), which is
    # not UTF-8; the backend's JSON string class excludes U+D800-U+DFFF.
    for schema in ({"type": "string"}, {"type": "string", "maxLength": 5}):
        state = _state(backend, json=schema)
        assert state.accept(tokenizer.convert_tokens_to_ids('"'))
        assert state.accept(_byte_token(tokenizer, 0xED))  # a lead byte: U+D000-U+DFFF
        assert state.accept(_byte_token(tokenizer, 0x9F))  # U+D7C0-U+D7FF: fine
        state.rollback(1)
        assert not state.accept(_byte_token(tokenizer, 0xA0))  # U+D800-: a surrogate


# --------------------------------------------------------------- the batched mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_batch_masks_constrained_rows_and_leaves_others_bit_exact(backend, tokenizer, eos, dtype):
    regex = _state(backend, regex=EMAIL)
    json_state = _state(backend, json=SCHEMA)
    done = _state(backend, choice=["a"])
    assert done.accept_many([tokenizer.convert_tokens_to_ids("a"), eos]) == 2
    states = [json_state, None, regex, None, done]
    logits = torch.randn(len(states), backend.vocab_size, generator=torch.Generator().manual_seed(0))
    logits = logits.to(dtype)
    before = logits.clone()
    apply_grammar_masks(logits, states)
    for row in (1, 3):
        assert torch.equal(logits[row], before[row])
    for row, state in ((0, json_state), (2, regex)):
        alone = before[row : row + 1].clone()
        apply_grammar_masks(alone, [state])
        assert torch.equal(logits[row], alone[0])
        kept = torch.isfinite(logits[row])
        assert 0 < kept.sum() < 200
        assert torch.equal(logits[row][kept], before[row][kept])  # allowed logits untouched
    assert torch.isfinite(logits[4]).nonzero().flatten().tolist() == [eos]
    # Every row constrained (no indices) gives the same rows.
    full = before[[0, 2]].clone()
    apply_grammar_masks(full, [json_state, regex])
    assert torch.equal(full, logits[[0, 2]])


def test_no_constrained_rows_is_a_no_op(backend):
    logits = torch.randn(3, backend.vocab_size)
    before = logits.clone()
    apply_grammar_masks(logits, [None, None, None])
    assert torch.equal(logits, before)


def test_logits_wider_than_the_vocab_are_masked_and_narrower_refused(backend):
    state = _state(backend, regex=EMAIL)
    logits = torch.zeros(2, backend.vocab_size + 10)
    apply_grammar_masks(logits, [state, None])
    assert torch.isinf(logits[0, backend.vocab_size :]).all()
    assert (logits[1] == 0).all()
    with pytest.raises(ValueError, match="fewer than"):
        apply_grammar_masks(torch.zeros(1, backend.vocab_size - 1), [state])
    with pytest.raises(ValueError, match="len\\(states\\)"):
        apply_grammar_masks(torch.zeros(2, backend.vocab_size), [state])


def test_tokens_beyond_the_tokenizer_and_special_tokens_are_never_allowed(backend, tokenizer, eos):
    state = _state(backend, regex=".{0,20}")
    allowed = _allowed(backend, state)
    assert allowed[: len(tokenizer)].sum() > len(tokenizer) // 2
    assert not allowed[len(tokenizer) :].any()
    assert not allowed[tokenizer.bos_token_id]  # "<s>" is not the text "<s>"
    assert allowed[eos]  # the empty string matches
    for token in (len(tokenizer), backend.vocab_size - 1, backend.vocab_size, -1,
                  tokenizer.bos_token_id):
        assert not state.accept(token)


def test_a_forbidden_token_is_refused_and_changes_nothing(backend, tokenizer, eos):
    state = _state(backend, regex=EMAIL)
    ids = tokenizer.encode("abc", add_special_tokens=False)
    assert state.accept_many(ids) == len(ids)
    before = _allowed(backend, state)
    forbidden = [t for t in (tokenizer.convert_tokens_to_ids("."), eos, 5)
                 if not before[t]]
    assert eos in forbidden
    for token in forbidden:
        assert not state.accept(token)
        assert torch.equal(_allowed(backend, state), before)
    rest = tokenizer.encode("@foo.com", add_special_tokens=False)
    assert state.accept_many(rest) == len(rest)
    assert state.accept(eos) and state.is_terminated


def test_terminated_state_allows_only_eos(backend, tokenizer, eos):
    state = _state(backend, choice=["yes", "no"])
    assert state.accept_many(tokenizer.encode("no", add_special_tokens=False) + [eos]) >= 2
    assert state.is_terminated
    assert _allowed(backend, state).nonzero().flatten().tolist() == [eos]
    assert not state.accept(tokenizer.convert_tokens_to_ids("a"))
    assert state.accept(eos) and state.is_terminated  # what the mask allows
    state.rollback(2)  # the repeated EOS, then the real one
    assert not state.is_terminated
    assert _allowed(backend, state).nonzero().flatten().tolist() == [eos]


def test_rollback_restores_the_mask(backend, tokenizer):
    state = _state(backend, json=SCHEMA)
    start = _allowed(backend, state)
    ids = tokenizer.encode('{"color": "red"', add_special_tokens=False)
    assert state.accept_many(ids) == len(ids)
    assert not torch.equal(_allowed(backend, state), start)
    state.rollback(len(ids))
    assert torch.equal(_allowed(backend, state), start)


def test_a_dead_end_allows_only_eos_instead_of_nothing(backend, tokenizer, eos, caplog):
    state = _state(backend, grammar='root ::= "a" x\nx ::= x "b"')  # x never finishes
    assert state.accept(tokenizer.convert_tokens_to_ids("a"))
    logits = torch.randn(1, backend.vocab_size)
    with caplog.at_level("WARNING", logger="llmlab.sampling.structured"):
        apply_grammar_masks(logits, [state])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos]
    assert "allows no token" in caplog.text
    bitmask = torch.zeros(2, backend.bitmask_width, dtype=torch.int32)
    state.fill_bitmask(bitmask, 1)  # the per-row entry point does the same
    assert bitmask[0].eq(0).all()
    assert bitmask[1].tolist() == [1 << eos if w == eos // 32 else 0
                                   for w in range(backend.bitmask_width)]


# --------------------------------------------------------------- compilation


@pytest.mark.parametrize(
    ("kind", "value", "field"),
    [
        ("json", {"type": "foo"}, r"structured_outputs\.json .*foo"),
        ("json", {"type": "integer", "minimum": 5, "maximum": 1}, r"structured_outputs\.json"),
        ("json", '{"enum": []}', r"structured_outputs\.json .*enum"),
        ("regex", "[a-z", r"structured_outputs\.regex .*\["),
        ("regex", "a(?=b)", r"structured_outputs\.regex .*[Ll]ookahead"),
        ("grammar", "root ::= undefined_rule", r"structured_outputs\.grammar .*undefined_rule"),
        ("grammar", 'start ::= "x"', r"structured_outputs\.grammar .*root"),
        ("grammar", r"root ::= [^\x00-\U0010FFFF]", r"structured_outputs\.grammar matches no text"),
        ("choice", ["ok", "nul\x00"], r"structured_outputs\.choice\[1\] .*NUL"),
    ],
)
def test_invalid_constraints_raise_value_error_naming_the_field(backend, kind, value, field):
    with pytest.raises(ValueError, match=field) as info:
        backend.compile(StructuredOutputsParams(**{kind: value}))
    assert "/project/" not in str(info.value)  # xgrammar's C++ location is stripped


def test_compiled_grammars_are_cached_by_canonical_key(tokenizer, vocab, eos):
    backend = StructuredOutputBackend(tokenizer, vocab, [eos], max_cache_entries=2)
    first = backend.compile(StructuredOutputsParams(json=SCHEMA))
    assert backend.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2))) is first
    assert backend.compile(GuidedDecodingParams(json=SCHEMA)) is first
    assert backend.compile({"json": SCHEMA}) is first
    info = backend.cache_info()
    assert (info.hits, info.misses, info.currsize) == (3, 1, 1)
    # Property order is output order: another grammar.
    assert backend.compile(StructuredOutputsParams(json=_reordered(SCHEMA))) is not first
    # Another kind with the same text is another grammar; the LRU keeps two.
    regex = backend.compile(StructuredOutputsParams(regex="abc"))
    assert backend.compile(StructuredOutputsParams(grammar='root ::= "abc"')) is not regex
    assert backend.cache_info().currsize == 2
    assert backend.compile(StructuredOutputsParams(json=SCHEMA)) is not first  # evicted
    assert backend.cache_info().misses == 5


def test_concurrent_compiles_agree(backend):
    schemas = [{"type": "integer", "minimum": 0, "maximum": i} for i in range(1, 9)]
    results: dict[int, list] = {}

    def work(k):
        results[k] = [backend.compile(StructuredOutputsParams(json=s)).key for s in schemas]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({tuple(r) for r in results.values()}) == 1


def test_states_are_independent_and_tied_to_their_backend(backend, tokenizer, vocab, eos):
    compiled = backend.compile(StructuredOutputsParams(regex=EMAIL))
    a, b = backend.new_state(compiled), backend.new_state(compiled)
    ids = tokenizer.encode("abc", add_special_tokens=False)
    assert a.accept_many(ids) == len(ids)
    assert torch.equal(_allowed(backend, b), _allowed(backend, backend.new_state(compiled)))
    other = StructuredOutputBackend(tokenizer, vocab, [eos])
    with pytest.raises(ValueError, match="another"):
        other.new_state(compiled)


def test_eos_must_be_inside_the_vocab(tokenizer, vocab):
    with pytest.raises(ValueError, match="EOS"):
        StructuredOutputBackend(tokenizer, vocab, [vocab + 5])


def test_missing_xgrammar_is_a_clear_import_error(tokenizer, vocab, eos, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(ImportError, match="pip install xgrammar"):
        StructuredOutputBackend(tokenizer, vocab, [eos])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_logits_match_cpu(backend, dtype):
    states = [_state(backend, json=SCHEMA), None, _state(backend, regex=EMAIL)]
    logits = torch.randn(3, backend.vocab_size + 6, generator=torch.Generator().manual_seed(1))
    logits = logits.to(dtype)
    on_cpu = logits.clone()
    apply_grammar_masks(on_cpu, states)
    on_gpu = logits.cuda()
    apply_grammar_masks(on_gpu, states)
    assert torch.equal(on_gpu.cpu(), on_cpu)
