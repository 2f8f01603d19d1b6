"""The built-in KV presses on synthetic tensors: what each keeps, checked against references
computed here by hand (no model, no engine)."""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import pytest
import torch

from llmlab import registry
from llmlab.kvpress import (
    H2OPress,
    KnormPress,
    KVPress,
    PressInput,
    PyramidPress,
    RandomPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
    check_budget,
    kept_count,
    register_press,
    resolve_press,
)

BUILTINS = {
    "streaming_llm": StreamingLLMPress,
    "knorm": KnormPress,
    "random": RandomPress,
    "tova": TOVAPress,
    "snapkv": SnapKVPress,
    "h2o": H2OPress,
    "pyramid": PyramidPress,
}

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8  # grouped-query attention: 2 query heads per KV head


def make_layer(
    num_tokens: int = 40,
    num_queries: int | None = None,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    layer: int = 0,
    keys: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> PressInput:
    """A ``PressInput`` of random keys, values and (``num_queries`` > 0) queries."""
    gen = torch.Generator().manual_seed(seed)
    if keys is None:
        keys = torch.randn(KV_HEADS, num_tokens, HEAD_DIM, generator=gen)
    if queries is None and num_queries:
        queries = torch.randn(HEADS, num_queries, HEAD_DIM, generator=gen)
    values = torch.randn(keys.shape, generator=gen)
    return PressInput(
        layer=layer,
        num_layers=4,
        keys=keys.to(dtype),
        values=values.to(dtype),
        queries=None if queries is None else queries.to(dtype),
        scale=1 / math.sqrt(HEAD_DIM),
        context_len=keys.shape[1],
        generator=generator,
    )


def queries_for(press: KVPress, num_tokens: int) -> int:
    """How many recent queries the engine would hand ``press`` (-1: all of them)."""
    return num_tokens if press.query_span < 0 else min(press.query_span, num_tokens)


def reference_attention(layer: PressInput) -> torch.Tensor:
    """``[heads, queries, tokens]`` causal softmax, one head and one query at a time."""
    keys, queries = layer.keys.float(), layer.queries.float()
    heads, num_queries, _ = queries.shape
    n = keys.shape[1]
    group = heads // keys.shape[0]
    out = torch.zeros(heads, num_queries, n)
    for h in range(heads):
        for i in range(num_queries):
            visible = n - num_queries + i + 1  # the query's own token and those before it
            logits = keys[h // group, :visible] @ queries[h, i] * layer.scale
            out[h, i, :visible] = torch.softmax(logits, dim=0)
    return out


def kept(press: KVPress, layer: PressInput, budget: int) -> list[set[int]]:
    """The indices each KV head keeps, as sets."""
    return [set(row.tolist()) for row in press.select(layer, budget)]


# -- registration ------------------------------------------------------------------------------


@pytest.mark.parametrize("name, cls", BUILTINS.items())
def test_builtin_is_registered_and_resolves_by_name_with_config(name, cls):
    assert name in registry.available("kv_press")
    assert cls.name == name
    press = resolve_press(name, {"compression_ratio": 0.5, "compress_every": 4})
    assert type(press) is cls
    assert press.keep_fraction() == 0.5 and press.compress_every == 4
    registry.check("kv_press", press)  # the engine's call shape
    assert "arXiv" in cls.__doc__ or name == "random"  # each method cites its paper


def test_resolve_press_rejects_config_the_press_does_not_take():
    with pytest.raises(ValueError, match="kernel_size"):
        resolve_press("knorm", {"kernel_size": 3})


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (SnapKVPress, "kernel_size", 0),
        (SnapKVPress, "window_size", 0),
        (StreamingLLMPress, "n_sink", -1),
        (StreamingLLMPress, "window", 0),
        (H2OPress, "recent", -1),
        (PyramidPress, "beta", 0),
    ],
)
def test_press_fields_reject_out_of_range_values_naming_the_field(cls, field, value):
    with pytest.raises(ValueError, match=field):
        cls(**{field: value})


def test_user_press_defined_here_registers_and_resolves_by_name():
    name = "test_presses_value_norm"  # the registry is global: a name no one else uses

    @register_press(name)
    @attrs.define
    class ValueNorm(KVPress):
        """Keep the tokens whose values are largest."""

        name: ClassVar[str] = "test_presses_value_norm"

        def score(self, layer: PressInput) -> torch.Tensor:
            return layer.values.float().norm(dim=-1)

    press = resolve_press(name, {"compression_ratio": 0.75})
    assert isinstance(press, ValueNorm) and press.keep_fraction() == 0.25
    layer = make_layer(12)
    norms = layer.values.float().norm(dim=-1)
    expected = [set(torch.topk(norms[h], 3).indices.tolist()) for h in range(KV_HEADS)]
    assert kept(press, layer, 3) == expected


# -- select() on every press -------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_returns_budget_ascending_unique_indices_per_head(name, dtype):
    press = resolve_press(name)
    n = 48
    layer = make_layer(n, queries_for(press, n), dtype=dtype)
    for budget in (1, 5, 17, n - 1):
        indices = press.select(layer, budget)
        assert indices.shape == (KV_HEADS, budget)
        assert indices.dtype == torch.int64
        assert bool((indices >= 0).all()) and bool((indices < n).all())
        assert bool((indices[:, 1:] > indices[:, :-1]).all())  # strictly ascending: unique


@pytest.mark.parametrize("name", BUILTINS)
def test_select_at_full_budget_keeps_everything_in_order(name):
    press = resolve_press(name)
    n = 20
    layer = make_layer(n, queries_for(press, n))
    for budget in (n, n + 5):
        assert press.select(layer, budget).tolist() == [list(range(n))] * KV_HEADS


@pytest.mark.parametrize("name", ["tova", "snapkv", "h2o", "pyramid"])
def test_attention_press_without_queries_falls_back_to_the_most_recent_tokens(name):
    press = resolve_press(name)
    layer = make_layer(30, None)
    assert press.select(layer, 7).tolist() == [list(range(23, 30))] * KV_HEADS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", BUILTINS)
def test_press_scores_on_the_cache_device(name):
    press = resolve_press(name)
    cpu = make_layer(40, queries_for(press, 40), dtype=torch.bfloat16)
    layer = attrs.evolve(
        cpu,
        keys=cpu.keys.cuda(),
        values=cpu.values.cuda(),
        queries=None if cpu.queries is None else cpu.queries.cuda(),
    )
    assert press.select(layer, 10).device.type == "cuda"


# -- what each press keeps ---------------------------------------------------------------------


def test_streaming_llm_keeps_exactly_the_sinks_and_the_most_recent_tokens():
    layer = make_layer(30)
    expected = [0, 1, 2, 3, *range(24, 30)]
    assert StreamingLLMPress().select(layer, 10).tolist() == [expected] * KV_HEADS
    assert StreamingLLMPress(n_sink=2).select(layer, 5).tolist() == [[0, 1, 27, 28, 29]] * 2


def test_streaming_llm_window_fixes_every_layer_budget_whatever_the_ratio():
    press = StreamingLLMPress(n_sink=4, window=16)
    for keep in (0.1, 0.5, 1.0):
        assert press.layer_budgets(100, keep, 3) == [20, 20, 20]
    assert press.layer_budgets(12, 0.5, 2) == [12, 12]  # capped at the context
    uniform = StreamingLLMPress()
    assert uniform.layer_budgets(100, 0.3, 3) == [kept_count(100, 0.3)] * 3


def test_streaming_llm_window_argument_does_not_change_the_queries_it_reads():
    # press.query_span is what the engine reads as the query window: sinks need none.
    press = resolve_press("streaming_llm", {"n_sink": 2, "window": 64})
    assert press.window == 64 and press.query_span == 0
    assert attrs.evolve(press, window=8).window == 8


def test_knorm_keeps_the_smallest_norm_keys():
    layer = make_layer(40, dtype=torch.bfloat16)
    norms = layer.keys.float().norm(dim=-1)
    for budget in (1, 10, 25):
        expected = [set(torch.argsort(norms[h])[:budget].tolist()) for h in range(KV_HEADS)]
        assert kept(KnormPress(), layer, budget) == expected


def test_random_is_deterministic_per_seed_and_differs_across_seeds_and_layers():
    layer = make_layer(64)
    first = RandomPress(seed=3).select(layer, 16)
    assert torch.equal(first, RandomPress(seed=3).select(layer, 16))
    assert not torch.equal(first, RandomPress(seed=4).select(layer, 16))
    other_layer = attrs.evolve(layer, layer=1)
    assert not torch.equal(first, RandomPress(seed=3).select(other_layer, 16))
    assert not torch.equal(first[0], first[1])  # each KV head draws its own


def test_random_draws_from_the_layer_generator_when_given():
    def with_generator(seed: int) -> PressInput:
        return make_layer(64, generator=torch.Generator().manual_seed(seed))

    press = RandomPress(seed=0)
    assert torch.equal(press.select(with_generator(7), 16), press.select(with_generator(7), 16))
    assert not torch.equal(press.select(with_generator(7), 16), press.select(with_generator(8), 16))


def test_tova_keeps_the_tokens_the_last_query_attends_to_most_and_the_newest():
    n, budget = 30, 8
    layer = make_layer(n, 1, seed=5)
    keys, last_query = layer.keys.float(), layer.queries.float()[:, -1]
    # By hand: softmax of q.k * scale per query head (head h reads KV head h // 2), averaged.
    weights = torch.stack(
        [torch.softmax(keys[h // 2] @ last_query[h] * layer.scale, dim=0) for h in range(HEADS)]
    ).mean(dim=0)
    older = torch.argsort(weights[:-1], descending=True)[: budget - 1].tolist()
    expected = set(older) | {n - 1}
    assert kept(TOVAPress(), layer, budget) == [expected] * KV_HEADS


def test_tova_always_keeps_the_newest_token_even_when_it_draws_no_attention():
    n = 20
    gen = torch.Generator().manual_seed(2)
    direction = torch.randn(KV_HEADS, 1, HEAD_DIM, generator=gen)
    queries = direction.repeat_interleave(HEADS // KV_HEADS, dim=0)  # both heads of a group
    keys = torch.randn(KV_HEADS, n, HEAD_DIM, generator=gen) * 0.1
    keys[:, -1] = -5 * direction[:, 0]  # the newest key points away from its own query
    layer = make_layer(keys=keys, queries=queries)
    assert reference_attention(layer)[:, -1, -1].max() < 1e-3
    assert all(n - 1 in row for row in kept(TOVAPress(), layer, 3))


def planted_layer(num_tokens: int, num_queries: int, planted: list[int]) -> PressInput:
    """Queries that all point one way per KV head and keys at ``planted`` aligned with it."""
    gen = torch.Generator().manual_seed(11)
    direction = torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    queries = direction.repeat_interleave(HEADS // KV_HEADS, dim=0)[:, None, :] * 4
    queries = queries + 0.1 * torch.randn(HEADS, num_queries, HEAD_DIM, generator=gen)
    keys = 0.3 * torch.randn(KV_HEADS, num_tokens, HEAD_DIM, generator=gen)
    keys[:, planted] = 4 * direction[:, None, :]
    return make_layer(keys=keys, queries=queries)


def test_snapkv_keeps_its_window_and_the_tokens_the_window_attends_to():
    n, window, planted = 40, 8, [5, 17, 26]
    layer = planted_layer(n, window, planted)
    press = SnapKVPress(window_size=window, kernel_size=1)
    expected = set(planted) | set(range(n - window, n))
    assert kept(press, layer, window + len(planted)) == [expected] * KV_HEADS


def test_snapkv_pooling_keeps_the_neighbours_of_an_attended_token():
    n, window, planted = 40, 8, 12
    layer = planted_layer(n, window, [planted])
    press = SnapKVPress(window_size=window, kernel_size=5)
    # Max pooling over 5 tokens gives the planted token's score to two neighbours each side.
    expected = set(range(planted - 2, planted + 3)) | set(range(n - window, n))
    assert kept(press, layer, window + 5) == [expected] * KV_HEADS


def test_snapkv_scores_are_window_attention_pooled_over_neighbours_by_hand():
    n, window, kernel, budget = 36, 6, 3, 14
    layer = make_layer(n, window, seed=4)
    summed = reference_attention(layer).sum(dim=1)  # over the window's queries
    per_kv = summed.reshape(KV_HEADS, HEADS // KV_HEADS, n).mean(dim=1)
    prefix = n - window
    pooled = torch.tensor(
        [
            [per_kv[h, max(0, j - kernel // 2) : min(prefix, j + kernel // 2 + 1)].max()
             for j in range(prefix)]
            for h in range(KV_HEADS)
        ]
    )
    press = SnapKVPress(window_size=window, kernel_size=kernel)
    for h, row in enumerate(press.select(layer, budget)):
        assert row[-window:].tolist() == list(range(prefix, n))
        # Pooling makes ties (a peak spreads to its neighbours): compare the kept scores.
        kept_scores = pooled[h, row[:-window]].sort(descending=True).values
        best_scores = pooled[h].sort(descending=True).values[: budget - window]
        torch.testing.assert_close(kept_scores, best_scores)


def test_snapkv_window_size_is_the_window_the_engine_reads():
    assert SnapKVPress().query_span == 32
    assert SnapKVPress(window_size=16).query_span == 16
    assert resolve_press("snapkv", {"window_size": 4}).query_span == 4


def test_snapkv_keeps_the_window_when_every_token_is_in_it():
    layer = make_layer(6, 6)
    assert SnapKVPress().select(layer, 3).shape == (KV_HEADS, 3)
    assert bool(torch.isinf(SnapKVPress().score(layer)).all())


def test_h2o_keeps_planted_heavy_hitters_and_the_recent_tokens():
    n, planted = 40, [3, 11, 20]
    layer = planted_layer(n, n, planted)  # every query since the prompt started
    expected = set(planted) | set(range(n - 4, n))
    assert kept(H2OPress(recent=4), layer, 4 + len(planted)) == [expected] * KV_HEADS


def test_h2o_scores_are_accumulated_attention_averaged_per_kv_head():
    n, recent, budget = 32, 4, 12
    layer = make_layer(n, n, seed=9)
    accumulated = reference_attention(layer).sum(dim=1)  # [heads, tokens]
    per_kv = accumulated.reshape(KV_HEADS, HEADS // KV_HEADS, n).mean(dim=1)
    expected = [
        set(torch.argsort(per_kv[h, : n - recent], descending=True)[: budget - recent].tolist())
        | set(range(n - recent, n))
        for h in range(KV_HEADS)
    ]
    assert kept(H2OPress(recent=recent), layer, budget) == expected


# -- pyramid -----------------------------------------------------------------------------------


@pytest.mark.parametrize("context_len", [10, 100, 1000, 4097])
@pytest.mark.parametrize("keep", [0.05, 0.1, 0.3, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("num_layers", [2, 5, 32])
def test_pyramid_budgets_decrease_and_keep_the_uniform_mean(context_len, keep, num_layers):
    budgets = PyramidPress().layer_budgets(context_len, keep, num_layers)
    uniform = kept_count(context_len, keep)
    assert len(budgets) == num_layers
    assert all(isinstance(b, int) and 1 <= b <= context_len for b in budgets)
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert abs(sum(budgets) / num_layers - uniform) <= 1
    if uniform >= 40:  # room for a visible pyramid
        assert budgets[0] > uniform > budgets[-1]


def test_pyramid_top_layer_gets_the_mean_over_beta_when_nothing_is_clamped():
    mean = kept_count(1000, 0.2)
    budgets = PyramidPress(press=KnormPress(), beta=20).layer_budgets(1000, 0.2, 8)
    assert budgets[-1] == round(mean / 20)
    assert budgets[0] == round(2 * mean - mean / 20)


def test_pyramid_keeps_the_inner_query_window_in_every_layer():
    """As in PyramidKV: the pyramid is built over the budget less the window, and every
    layer keeps the window on top (so no layer spends its budget inside the window)."""
    mean, window = kept_count(1000, 0.2), 32
    budgets = PyramidPress(press=SnapKVPress(window_size=window), beta=20).layer_budgets(
        1000, 0.2, 8
    )
    assert budgets[-1] == window + round((mean - window) / 20)
    assert min(budgets) > window
    assert abs(sum(budgets) / 8 - mean) <= 1
    # a budget no larger than the window: uniform
    assert PyramidPress(press=SnapKVPress(window_size=64)).layer_budgets(100, 0.5, 4) == [50] * 4


def test_attention_sum_equals_summed_attention_in_chunks():
    layer = make_layer(40, 23)
    expected = layer.attention().sum(dim=1)
    fresh = make_layer(40, 23)
    assert torch.allclose(fresh.attention_sum(chunk=5), expected, atol=1e-5)


def test_pyramid_keeps_everything_at_keep_one_and_the_mean_for_one_layer():
    assert PyramidPress().layer_budgets(50, 1.0, 6) == [50] * 6
    assert PyramidPress().layer_budgets(50, 0.4, 1) == [20]


def test_pyramid_delegates_scoring_and_window_to_its_inner_press():
    layer = make_layer(30, 30)
    wrapped = PyramidPress(press="knorm")
    assert isinstance(wrapped.press, KnormPress)
    assert torch.equal(wrapped.score(layer), KnormPress().score(layer))
    assert torch.equal(wrapped.select(layer, 9), KnormPress().select(layer, 9))
    assert PyramidPress().query_span == 32  # snapkv by default
    assert PyramidPress(press=SnapKVPress(window_size=8)).query_span == 8
    assert PyramidPress(press=H2OPress()).query_span == -1
    assert resolve_press("pyramid", {"press": "tova"}).query_span == 1


def test_pyramid_ratio_and_schedule_are_the_wrappers_own():
    inner = KnormPress(compression_ratio=0.1, compress_every=2)
    wrapped = PyramidPress(press=inner, compression_ratio=0.6)
    assert wrapped.keep_fraction() == pytest.approx(0.4)
    assert wrapped.compress_every is None


# -- the base: attention, select's checks, validators ------------------------------------------


def test_press_input_attention_is_causal_softmax_matching_a_by_hand_reference():
    n, q = 12, 5
    layer = make_layer(n, q, dtype=torch.bfloat16)
    weights = layer.attention()
    assert weights.shape == (HEADS, q, n) and weights.dtype == torch.float32
    for i in range(q):
        assert bool((weights[:, i, n - q + i + 1 :] == 0).all())  # no key after its own token
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(HEADS, q))
    torch.testing.assert_close(weights, reference_attention(layer))
    assert layer.attention() is weights  # computed once per layer


@attrs.define
class _FixedScores(KVPress):
    scores: torch.Tensor | None = None

    def score(self, layer: PressInput) -> torch.Tensor:
        return self.scores


@pytest.mark.parametrize("shape", [(KV_HEADS, 11), (HEADS, 10), (10, KV_HEADS), (9,)])
def test_select_rejects_a_wrong_shaped_score_naming_the_shape(shape):
    press = _FixedScores(torch.zeros(shape))
    with pytest.raises(ValueError, match=str(list(shape)).replace("[", r"\[")):
        press.select(make_layer(10), 4)


def test_select_rejects_nan_scores():
    scores = torch.zeros(KV_HEADS, 10)
    scores[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _FixedScores(scores).select(make_layer(10), 4)


@pytest.mark.parametrize("value", [1.0, 1, -0.1, 1.5, True, "x", None])
def test_compression_ratio_outside_zero_one_is_rejected_naming_the_field(value):
    with pytest.raises(ValueError, match="compression_ratio"):
        KnormPress(compression_ratio=value)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "x"])
def test_compress_every_below_one_is_rejected_naming_the_field(value):
    with pytest.raises(ValueError, match="compress_every"):
        KnormPress(compress_every=value)


@pytest.mark.parametrize("value", [0, 1.5, -0.1, True, "x"])
def test_check_budget_rejects_values_outside_zero_one_naming_the_field(value):
    with pytest.raises(ValueError, match="kv_budget"):
        check_budget(value)
    with pytest.raises(ValueError, match="my_budget"):
        check_budget(value, "my_budget")


def test_check_budget_accepts_kept_fractions():
    assert check_budget(1) == 1.0 and check_budget(0.25) == 0.25


def test_ties_keep_the_newest_tokens():
    """Equal scores (a press's +inf for what it always keeps, cut by a small budget) keep
    the later tokens: snapkv with a budget under its window keeps the newest ones."""
    layer = make_layer(60, 32)
    kept = SnapKVPress(window_size=32).select(layer, 10)
    assert kept.tolist() == [list(range(50, 60))] * kept.shape[0]
    flat = KnormPress().select(make_layer(20, keys=torch.ones(KV_HEADS, 20, HEAD_DIM)), 5)
    assert flat.tolist() == [list(range(15, 20))] * KV_HEADS
