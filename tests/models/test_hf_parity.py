"""Our models, run through real paged attention, reproduce Hugging Face logits exactly."""

from __future__ import annotations

import pytest
import torch

ATOL = 1e-4
PROMPT_LEN = 37
DECODE_STEPS = 3


def test_prefill_then_decode_matches_hf_at_every_step(
    tiny_variant, load_pair, paged_runner, hf_logits, random_tokens
):
    ours, reference = load_pair(tiny_variant)
    tokens = random_tokens(PROMPT_LEN + DECODE_STEPS, ours.vocab_size, seed=1)
    runner = paged_runner(ours)

    prefill = runner.step({0: tokens[:PROMPT_LEN]})[0]
    expected = hf_logits(reference, tokens[:PROMPT_LEN])
    torch.testing.assert_close(prefill, expected, atol=ATOL, rtol=0)

    for length in range(PROMPT_LEN + 1, PROMPT_LEN + DECODE_STEPS + 1):
        decoded = runner.step({0: [tokens[length - 1]]})[0]
        expected = hf_logits(reference, tokens[:length])[-1:]
        torch.testing.assert_close(decoded, expected, atol=ATOL, rtol=0)


def test_mixed_flat_batch_of_two_sequences_matches_hf(
    tiny_variant, load_pair, paged_runner, hf_logits, random_tokens
):
    ours, reference = load_pair(tiny_variant)
    seq_a = random_tokens(40, ours.vocab_size, seed=2)
    seq_b = random_tokens(29, ours.vocab_size, seed=3)
    runner = paged_runner(ours)

    # Step 1: A's whole prompt and B's first chunk, side by side in one flat batch.
    out = runner.step({0: seq_a[:37], 1: seq_b[:20]})
    torch.testing.assert_close(out[0], hf_logits(reference, seq_a[:37]), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(reference, seq_b[:20]), atol=ATOL, rtol=0)

    # Step 2: A decodes while B continues its chunked prefill over cached context.
    out = runner.step({0: seq_a[37:38], 1: seq_b[20:28]})
    torch.testing.assert_close(out[0], hf_logits(reference, seq_a[:38])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(reference, seq_b[:28])[-8:], atol=ATOL, rtol=0)

    # Step 3: both decode (B listed first, so batch order differs from step 1).
    out = runner.step({1: seq_b[28:29], 0: seq_a[38:39]})
    torch.testing.assert_close(out[0], hf_logits(reference, seq_a[:39])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[1], hf_logits(reference, seq_b[:29])[-1:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", ["mistral", "qwen2"])
def test_sliding_window_is_exercised_by_the_parity_tests(
    variant, load_pair, paged_runner, random_tokens
):
    # Without this, a model that ignored its window could still match an HF model that
    # also ignored it; the window must change logits past its length.
    ours, _ = load_pair(variant)
    windows = [layer.self_attn.sliding_window for layer in ours.layers]
    assert any(w is not None and w < PROMPT_LEN for w in windows)
    tokens = random_tokens(PROMPT_LEN, ours.vocab_size, seed=4)
    windowed = paged_runner(ours).step({0: tokens})[0]
    try:
        for layer in ours.layers:
            layer.self_attn.sliding_window = None
        full = paged_runner(ours).step({0: tokens})[0]
    finally:
        for layer, window in zip(ours.layers, windows):
            layer.self_attn.sliding_window = window
    window = min(w for w in windows if w is not None)
    torch.testing.assert_close(windowed[:window], full[:window], atol=ATOL, rtol=0)
    assert (windowed[window:] - full[window:]).abs().max() > 1e-2


def test_qwen2_windows_only_layers_from_max_window_layers(load_pair):
    ours, _ = load_pair("qwen2")
    assert [layer.self_attn.sliding_window for layer in ours.layers] == [None, 24]


@pytest.mark.parametrize("variant", ["llama", "gpt2", "opt"])
def test_bfloat16_model_stays_close_to_float32(
    variant, tiny_model_dirs, load_pair, paged_runner, random_tokens
):
    import transformers

    from llmlab.models import load_model

    path = tiny_model_dirs[variant]
    ours32, _ = load_pair(variant)
    config = transformers.AutoConfig.from_pretrained(path)
    ours16 = load_model(path, config, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in ours16.parameters())
    tokens = random_tokens(PROMPT_LEN, ours32.vocab_size, seed=5)
    logits16 = paged_runner(ours16).step({0: tokens})[0]
    logits32 = paged_runner(ours32).step({0: tokens})[0]
    assert logits16.dtype == torch.float32
    assert (logits16 - logits32).abs().max() < 0.25
