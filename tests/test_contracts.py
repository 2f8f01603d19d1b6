"""Component contracts (``registry.CONTRACTS``): a component whose methods cannot take the
engine's calls is refused when the engine is built, naming the method and the expected
signature, before anything is loaded."""

from __future__ import annotations

import pytest

from llmlab import LLM, registry
from llmlab.cache import KVCacheManager, LRUEviction
from llmlab.engine import assembly


class OneBlockAtATime:
    """The form the design notes first sketched: one block per call."""

    name = "one_block"

    def __init__(self):
        self.free = []

    def on_free(self, block):
        self.free.append(block)

    def on_hit(self, block):
        self.free.remove(block)

    def evict(self):
        return self.free.pop(0)


class EvictWithoutCount(LRUEviction):
    def evict(self):  # noqa: D102 - the count is missing
        return super().evict(1)


class PopWithoutNow:
    def push(self, request, now): ...
    def pop(self): ...
    def remove(self, request): ...
    def victim(self, candidates): ...


@pytest.fixture
def nothing_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was resolved before the components were checked")

    monkeypatch.setattr(assembly, "resolve_model_path", refuse)


@pytest.mark.parametrize("policy", [OneBlockAtATime(), EvictWithoutCount()],
                         ids=["one-block-at-a-time", "evict-without-count"])
def test_an_eviction_policy_with_the_wrong_call_shapes_is_refused_before_loading(
        policy, nothing_loads):
    with pytest.raises(TypeError, match=r"evict\(\).*expected evict\(self, n\) -> list\[int\]"):
        LLM("any/model", eviction_policy=policy)


def test_a_scheduling_policy_with_the_wrong_call_shape_is_refused_before_loading(nothing_loads):
    with pytest.raises(TypeError, match=r"pop\(\).*expected pop\(self, now\)"):
        LLM("any/model", scheduling_policy=PopWithoutNow())


def test_a_missing_method_names_the_expected_signature():
    class NoHit:
        def on_free(self, block_ids): ...
        def evict(self, n): ...

    with pytest.raises(TypeError, match=r"missing method 'on_hit'; expected "
                                        r"on_hit\(self, block_ids\) -> None"):
        registry.check("eviction_policy", NoHit())


def test_swapping_in_a_bad_policy_later_is_refused_and_keeps_the_old_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    old = kv.eviction
    with pytest.raises(TypeError, match="evict"):
        kv.eviction = OneBlockAtATime()
    assert kv.eviction is old


def test_flexible_signatures_and_every_builtin_pass():
    class Flexible:
        def on_free(self, *ids): ...
        def on_hit(self, block_ids, extra=None): ...
        def evict(self, n=1, **options): ...

    registry.check("eviction_policy", Flexible())
    for kind in ("eviction_policy", "attention_backend", "sampler"):
        for name in registry.available(kind):
            registry.check(kind, registry.create(kind, name))
    for name in registry.available("model"):  # classes, built by the loader from a config
        registry.check("model", registry.resolve("model", name))
    from llmlab.scheduler.policy import as_policy

    for name in registry.available("scheduling_policy"):
        as_policy(registry.create("scheduling_policy", name))


def test_every_kind_declares_its_contract_in_one_place():
    assert set(registry.CONTRACTS) == set(registry.KINDS)
    assert repr(registry.CONTRACTS["attention_backend"][2]) == (
        "forward(self, layer_idx, q, k, v, kv_cache, metadata, *, scale, sliding_window) "
        "-> Tensor")


def test_a_sampler_of_the_older_three_argument_form_is_refused_before_loading(nothing_loads):
    class RequestsAndGenerator:
        def __call__(self, logits, requests, generator): ...

    with pytest.raises(TypeError, match=r"__call__.*expected __call__\(self, logits, "
                                        r"metadata\) -> SamplerOutput"):
        LLM("any/model", sampler=RequestsAndGenerator())
    with pytest.raises(ValueError, match="unknown sampler 'nope'; available: default"):
        LLM("any/model", sampler="nope")


def test_a_model_class_that_breaks_the_model_contract_cannot_be_registered():
    from llmlab.models import register_model
    from llmlab.models.registry import MODEL_REGISTRY

    class NoPositions:
        def forward(self, input_ids, attn): ...
        def compute_logits(self, hidden): ...
        def load_weights(self, weights): ...

    with pytest.raises(TypeError, match=r"model NoPositions.forward.*expected "
                                        r"forward\(self, input_ids, positions, attn\)"):
        register_model("NoPositionsForCausalLM", NoPositions)
    assert "NoPositionsForCausalLM" not in MODEL_REGISTRY
    assert MODEL_REGISTRY is registry.table("model")  # one registry, models included
