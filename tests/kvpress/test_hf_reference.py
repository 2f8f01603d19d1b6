"""The HF eviction reference (``tests/kvpress/hf_reference.py``) is itself right.

Checked against two independent computations: ``model.generate`` when nothing is evicted, and a
cache-free brute force that reruns the whole sequence with an explicit per-(layer, KV head)
attention pattern, the one the eviction semantics imply, when something is.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers

from tests.kvpress.hf_reference import hf_greedy_with_eviction, sinks_and_window

ARCHITECTURES = ["LlamaForCausalLM", "Qwen3ForCausalLM"]
# Weights are random, so any ids below the vocab size make a prompt; varied, not a ramp.
PROMPT = [(7 * i * i + 3 * i + 11) % 500 + 2 for i in range(40)]
MAX_NEW_TOKENS = 10

# visible(layer_idx, seq_len) -> bool [num_kv_heads or 1, seq_len, seq_len]: row p may see key j.
VisibleFn = Callable[[int, int], torch.Tensor]


@pytest.fixture(scope="module")
def load(tiny_model_factory):
    """``load(architecture, attn_implementation) -> model``: tiny float32 HF models, eval mode."""
    loaded: dict[tuple[str, str], torch.nn.Module] = {}

    def _load(architecture: str, attn: str = "sdpa"):
        if (architecture, attn) not in loaded:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_model_factory(architecture), dtype=torch.float32, attn_implementation=attn
            )
            loaded[architecture, attn] = model.eval()
        return loaded[architecture, attn]

    return _load


def keep_everything(layer_idx: int, keys: torch.Tensor, context_len: int) -> torch.Tensor:
    return torch.arange(keys.shape[1]).expand(keys.shape[0], -1)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """``model.generate`` greedy, EOS ignored (the reference has no EOS handling either)."""
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    generated = out[0, len(prompt):].tolist()
    assert len(generated) == max_new_tokens
    return generated


def brute_force_greedy(
    eager_model, prompt: list[int], max_new_tokens: int, visible: VisibleFn
) -> list[int]:
    """Greedy decoding without a cache: every step reruns prompt + generated tokens, each
    attention module getting the additive mask that ``visible`` gives for its layer (per KV
    head, shared by that head's query heads as grouped-query attention shares the keys)."""
    config = eager_model.config
    n_rep = config.num_attention_heads // config.num_key_value_heads
    seq_len = 0

    def set_mask(module, args, kwargs):
        allowed = visible(module.layer_idx, seq_len)
        # repeat_kv lays query heads out as kv_head * n_rep + r.
        allowed = allowed.expand(config.num_key_value_heads, -1, -1)
        allowed = allowed.repeat_interleave(n_rep, dim=0)
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        return args, {**kwargs, "attention_mask": mask[None]}

    attention = [m for name, m in eager_model.named_modules() if name.endswith("self_attn")]
    handles = [m.register_forward_pre_hook(set_mask, with_kwargs=True) for m in attention]
    tokens = list(prompt)
    try:
        with torch.no_grad():
            for _ in range(max_new_tokens):
                seq_len = len(tokens)
                logits = eager_model(torch.tensor([tokens]), use_cache=False).logits
                tokens.append(int(logits[0, -1].argmax()))
    finally:
        for handle in handles:
            handle.remove()
    return tokens[len(prompt):]


def sinks_window_visible(
    prompt_len: int, n_sink: int, window: int, compress_every: int | None
) -> VisibleFn:
    """The attention pattern that sinks + window eviction implies, worked out from positions.

    Prompt rows are causal (full prefill). Row ``p >= prompt_len`` is the token fed at decode
    step ``s = p - prompt_len + 1``; the last eviction before it ran after ``e`` decode steps
    (``e`` the largest multiple of ``compress_every`` below ``s``, 0 without repeats), when
    ``prompt_len + e`` tokens had been seen and the last ``window`` of them were kept. So it sees
    the sinks, positions ``prompt_len + e - window ..`` and everything fed since, itself included.
    """

    def visible(layer_idx: int, seq_len: int) -> torch.Tensor:
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        for p in range(prompt_len, seq_len):
            s = p - prompt_len + 1
            e = 0 if compress_every is None else (s - 1) // compress_every * compress_every
            window_start = prompt_len + e - window
            allowed[p, n_sink:window_start] = False
        return allowed[None]

    return visible


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_keeping_everything_matches_generate(load, architecture):
    model = load(architecture)
    expected = hf_greedy(model, PROMPT, MAX_NEW_TOKENS)
    for compress_every in (None, 1):
        got = hf_greedy_with_eviction(
            model, PROMPT, MAX_NEW_TOKENS, keep_everything, compress_every=compress_every
        )
        assert got == expected, f"compress_every={compress_every}"
    # A prompt shorter than sinks + window is not touched by the sinks/window keep either.
    short = PROMPT[:6]
    got = hf_greedy_with_eviction(model, short, MAX_NEW_TOKENS, sinks_and_window(2, 4))
    assert got == hf_greedy(model, short, MAX_NEW_TOKENS)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_sinks_and_window_matches_brute_force_attention_pattern(load, architecture):
    model, eager = load(architecture), load(architecture, "eager")
    n_sink, window = 2, 5
    no_eviction = hf_greedy(model, PROMPT, MAX_NEW_TOKENS)
    changed = []
    for compress_every in (None, 1, 3):
        got = hf_greedy_with_eviction(
            model, PROMPT, MAX_NEW_TOKENS, sinks_and_window(n_sink, window), compress_every
        )
        visible = sinks_window_visible(len(PROMPT), n_sink, window, compress_every)
        assert got == brute_force_greedy(eager, PROMPT, MAX_NEW_TOKENS, visible), (
            f"compress_every={compress_every}"
        )
        changed.append(got != no_eviction)
    # Otherwise the comparison could not tell eviction from no eviction.
    assert any(changed)


def test_brute_force_with_causal_pattern_matches_generate(load):
    """The brute force's mask plumbing is live: a plain causal pattern reproduces generate, a
    restricted one does not."""
    eager = load("LlamaForCausalLM", "eager")
    causal = brute_force_greedy(
        eager, PROMPT, MAX_NEW_TOKENS, lambda layer, n: torch.ones(1, n, n, dtype=torch.bool).tril()
    )
    assert causal == hf_greedy(load("LlamaForCausalLM"), PROMPT, MAX_NEW_TOKENS)
    diagonal = brute_force_greedy(
        eager, PROMPT, MAX_NEW_TOKENS, lambda layer, n: torch.eye(n, dtype=torch.bool)[None]
    )
    assert diagonal != causal


def per_head_sink_keep(windows: list[int]) -> Callable[[int, torch.Tensor, int], torch.Tensor]:
    """KV head ``h`` keeps cache slot ``h`` plus the last ``windows[layer]`` slots: different
    sets per head, different counts per layer."""

    def keep(layer_idx: int, keys: torch.Tensor, context_len: int) -> torch.Tensor:
        num_heads, n = keys.shape[0], keys.shape[1]
        window = windows[layer_idx]
        return torch.stack(
            [torch.cat([torch.tensor([h]), torch.arange(n - window, n)]) for h in range(num_heads)]
        )

    return keep


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_per_head_per_layer_sets_match_brute_force(load, architecture, attn):
    model, eager = load(architecture, attn), load(architecture, "eager")
    windows = [3, 7]
    assert len(windows) == model.config.num_hidden_layers
    prompt_len = len(PROMPT)
    got = hf_greedy_with_eviction(model, PROMPT, MAX_NEW_TOKENS, per_head_sink_keep(windows))

    def visible(layer_idx: int, seq_len: int) -> torch.Tensor:
        allowed = torch.ones(model.config.num_key_value_heads, seq_len, seq_len).tril().bool()
        for h in range(allowed.shape[0]):
            hidden = torch.ones(prompt_len, dtype=torch.bool)
            hidden[h] = False
            hidden[prompt_len - windows[layer_idx]:] = False
            allowed[h, prompt_len:, :prompt_len] &= ~hidden
        return allowed

    assert got == brute_force_greedy(eager, PROMPT, MAX_NEW_TOKENS, visible)
    # The sets must matter per head: giving every head head 0's sink changes the output.
    shared_sink = brute_force_greedy(
        eager, PROMPT, MAX_NEW_TOKENS,
        lambda layer, n: visible(layer, n)[:1].expand(model.config.num_key_value_heads, -1, -1),
    )
    assert shared_sink != got


def keep_by_key_norm(budgets: list[int], calls: list[dict]):
    """Per head, the ``budgets[layer]`` highest-norm keys (ascending indices); records calls."""

    def keep(layer_idx: int, keys: torch.Tensor, context_len: int) -> torch.Tensor:
        k = min(budgets[layer_idx], keys.shape[1])
        kept = keys.norm(dim=-1).topk(k, dim=-1).indices.sort(dim=-1).values
        calls.append(dict(layer=layer_idx, keys=keys.clone(), context_len=context_len, kept=kept))
        return kept

    return keep


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_per_head_key_norm_keep_retains_exactly_the_requested_entries(load, architecture, attn):
    model = load(architecture, attn)
    budgets, compress_every = [6, 9], 2
    calls: list[dict] = []
    got = hf_greedy_with_eviction(
        model, PROMPT, MAX_NEW_TOKENS, keep_by_key_norm(budgets, calls), compress_every
    )
    assert len(got) == MAX_NEW_TOKENS
    num_layers = model.config.num_hidden_layers
    # Once after the prefill, then after every compress_every of the 9 decode steps.
    assert len(calls) == num_layers * (1 + (MAX_NEW_TOKENS - 1) // compress_every)
    assert [c["context_len"] for c in calls[::num_layers]] == [40, 42, 44, 46, 48]
    assert calls[0]["keys"].shape[:2] == (model.config.num_key_value_heads, len(PROMPT))

    previous: dict[int, dict] = {}
    for call in calls:
        layer, keys = call["layer"], call["keys"]
        assert call["kept"].shape == (keys.shape[0], budgets[layer])
        if layer in previous:
            before = previous[layer]
            k = budgets[layer]
            # The cache held exactly the kept entries, then the tokens decoded since.
            assert keys.shape[1] == k + compress_every
            gathered = before["keys"].gather(
                1, before["kept"][:, :, None].expand(-1, -1, keys.shape[-1])
            )
            torch.testing.assert_close(keys[:, :k], gathered, rtol=0, atol=0)
        previous[layer] = call
    # Heads chose different entries, or this would not test per-head gathering.
    assert any((c["kept"] != c["kept"][:1]).any() for c in calls)


def test_bad_keep_results_are_rejected(load):
    model = load("LlamaForCausalLM")

    def too_few_heads(layer_idx, keys, context_len):
        return torch.arange(4)[None]

    def descending(layer_idx, keys, context_len):
        return torch.arange(keys.shape[1] - 1, -1, -1).expand(keys.shape[0], -1)

    def out_of_range(layer_idx, keys, context_len):
        return torch.arange(1, keys.shape[1] + 1).expand(keys.shape[0], -1)

    for keep, message in [
        (too_few_heads, "num_kv_heads"),
        (descending, "ascending"),
        (out_of_range, "outside"),
    ]:
        with pytest.raises(ValueError, match=message):
            hf_greedy_with_eviction(model, PROMPT, 2, keep)


def test_sliding_window_models_are_rejected(tiny_model_factory):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_factory("MistralForCausalLM"), dtype=torch.float32
    ).eval()
    with pytest.raises(ValueError, match="full-attention"):
        hf_greedy_with_eviction(model, PROMPT, 2, keep_everything)


def test_sinks_and_window_slots():
    keys = torch.zeros(3, 10, 4)
    assert sinks_and_window(2, 3)(0, keys, 10).tolist() == [[0, 1, 7, 8, 9]] * 3
    assert sinks_and_window(4, 6)(0, keys, 10).tolist() == [list(range(10))] * 3
    assert sinks_and_window(0, 2)(0, keys, 10).tolist() == [[8, 9]] * 3
