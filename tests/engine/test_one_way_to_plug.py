"""One way to plug in any kind (docs/components.md): ``<kind>=`` a name, ``"module:Class"``
or an instance, ``<kind>_config=`` the named class's keyword arguments; names live in
``EngineConfig`` (plain data), instances in the engine builder; one hook, ``bind``."""

from __future__ import annotations

import pickle
import warnings

import attrs
import pytest
import yaml

from llmlab import LLM, EngineConfig, Policy, SamplingParams, registry
from llmlab.engine.builder import EngineBuilder
from llmlab.kvpress import KnormPress
from llmlab.plugin import SchedulerPlugin
from llmlab.speculative.config import SpeculativeConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@attrs.define
class StopAfter(SchedulerPlugin):
    """Stops every request after ``n`` output tokens (reason ``"stop_after"``)."""

    name = "stop_after"
    n: int = 1

    def commit(self, request, sent, returned):
        return "stop_after" if request.num_output_tokens >= self.n else None


class RepeatLast:
    def propose(self, requests, k):
        return [[int(r.token_ids[-1])] * k for r in requests]


# -- registry.build: the one helper --------------------------------------------------------


def test_build_makes_an_instance_from_a_name_a_path_or_a_class_with_its_config():
    spf = registry.build("scheduling_policy", "spf", {"aging": 0.5})
    assert type(spf).__name__ == "ShortestPromptFirst" and spf.aging == 0.5
    path = registry.build("kv_press", "llmlab.kvpress:KnormPress", '{"compression_ratio": 0.5}')
    assert isinstance(path, KnormPress) and path.compression_ratio == 0.5
    assert registry.build("kv_press", KnormPress, {"compression_ratio": 0.25}).compression_ratio == 0.25
    press = KnormPress()
    assert registry.build("kv_press", press) is press
    assert registry.build("router", None) is None


@pytest.mark.parametrize("value, config, error, message", [
    ("nope", None, ValueError, "unknown eviction_policy 'nope'; available: lru"),
    ("random", {"sead": 1}, TypeError,
     "eviction_policy_config key 'sead' is not a keyword argument of eviction_policy "
     "'random'; it takes: name, seed"),
    (None, {"seed": 1}, ValueError, "eviction_policy_config {'seed': 1} is set but "
     "eviction_policy is None"),
    ("random", "{not json", ValueError, "eviction_policy_config is not a JSON object"),
    ("random", ["seed"], ValueError, "eviction_policy_config must be a dict"),
])
def test_build_names_the_kind_the_value_and_what_is_allowed(value, config, error, message):
    with pytest.raises(error) as info:
        registry.build("eviction_policy", value, config)
    assert message in str(info.value)
    assert type(info.value) is error


def test_a_config_with_an_instance_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"kv_press_config \{'compression_ratio': 0.5\} was "
                       r"given with the kv_press instance KnormPress"):
        registry.build("kv_press", KnormPress(), {"compression_ratio": 0.5})


def test_a_constructors_own_error_comes_with_the_kind_in_front():
    with pytest.raises(ValueError, match=r"kv_press 'knorm': compression_ratio must be"):
        registry.build("kv_press", "knorm", {"compression_ratio": 2})


def test_an_instance_is_held_to_its_kinds_contract():
    with pytest.raises(TypeError, match="router object is missing method 'route'"):
        registry.build("router", object())


# -- LLM: every kind the same way, refused before anything loads ---------------------------


@pytest.mark.parametrize("kind, instance", [
    ("scheduling_policy", registry.build("scheduling_policy", "fcfs")),
    ("eviction_policy", registry.build("eviction_policy", "lru")),
    ("attention_backend", registry.build("attention_backend", "torch")),
    ("sampler", registry.build("sampler", "default")),
    ("kv_press", KnormPress()),
    ("router", registry.build("router", "round_robin")),
    ("proposer", RepeatLast()),
])
def test_every_kind_refuses_a_config_with_an_instance(tiny_llama, kind, instance):
    with pytest.raises(ValueError, match=f"{kind}_config .* was given with the {kind} instance"):
        LLM(tiny_llama, **{kind: instance, f"{kind}_config": {"x": 1}})


@pytest.mark.parametrize("kind, name", [
    ("scheduling_policy", "spf"), ("eviction_policy", "random"), ("attention_backend", "torch"),
    ("sampler", "default"), ("kv_press", "knorm"), ("router", "prefix_aware"),
    ("proposer", "ngram"),
])
def test_every_kind_names_a_keyword_its_constructor_refuses(tiny_llama, kind, name, monkeypatch):
    from llmlab.runner import build

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the component was checked")

    monkeypatch.setattr(build, "load_model", no_loading)
    with pytest.raises(TypeError, match=f"{kind}_config key 'nope' is not a keyword argument "
                       f"of {kind} '{name}'"):
        LLM(tiny_llama, **{kind: name, f"{kind}_config": {"nope": 1}})


def test_names_and_configs_stay_in_the_config_and_reach_the_engine(tiny_llama):
    registry.register("plugin", "test_stop_after")(StopAfter)
    try:
        llm = LLM(tiny_llama, scheduling_policy="spf", scheduling_policy_config={"aging": 0.5},
                  eviction_policy="random", eviction_policy_config={"seed": 3},
                  attention_backend="torch", attention_backend_config={"decode_mirror": False},
                  sampler="default", sampler_config={}, router="prefix_aware",
                  router_config={"load_cap": 2.0}, kv_press="knorm",
                  kv_press_config={"compression_ratio": 0.5}, plugins=["test_stop_after"],
                  plugin_config={"test_stop_after": {"n": 2}})
        engine = llm.llm_engine
        out = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    finally:
        registry.table("plugin").pop("test_stop_after", None)
    assert engine.scheduler.policy.aging == 0.5
    assert engine.kv_cache.eviction.seed == 3
    assert engine.executor.attention.decode_mirror is False
    assert engine.scheduler.plugin("stop_after").n == 2
    assert len(out.token_ids) == 2 and out.stop_reason == "stop_after"
    config = engine.config
    assert (config.scheduling_policy, config.eviction_policy, config.router) == (
        "spf", "random", "prefix_aware")
    assert config.plugins == ("test_stop_after",)
    assert config.plugin_config == {"test_stop_after": {"n": 2}}


def test_instances_stay_with_the_builder_and_out_of_the_config(tiny_llama):
    press = KnormPress(compression_ratio=0.5)
    budget = StopAfter(n=3)
    llm = LLM(tiny_llama, kv_press=press, plugins=[budget])
    out = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3
    config = llm.llm_engine.config
    assert config.kv_press is None and config.plugins == ()
    pickle.dumps(config)
    builder = EngineBuilder.from_settings(tiny_llama, kv_press=press, plugins=[budget, "x:Y"])
    assert builder.kv_press is press and builder.plugins == (budget,)
    assert builder.config.plugins == ("x:Y",)


def test_engine_config_refuses_an_instance_saying_where_it_goes(tiny_llama):
    with pytest.raises(ValueError, match=r"give an instance to LLM\(kv_press=\.\.\.\)"):
        EngineConfig(model=tiny_llama, kv_press=KnormPress())
    with pytest.raises(ValueError, match=r"LLM\(proposer=\.\.\.\)"):
        EngineConfig(model=tiny_llama, speculative_config={"proposer": RepeatLast()})
    with pytest.raises(ValueError, match="plugin_config names"):
        EngineConfig(model=tiny_llama, plugins=["a"], plugin_config={"b": {}})
    with pytest.raises(ValueError, match="router_config is set but router is None"):
        EngineConfig(model=tiny_llama, router_config={"load_cap": 2})


def test_proposer_is_speculative_configs_method_spelled_the_one_way(tiny_llama):
    by_name = LLM(tiny_llama, max_model_len=64, proposer="ngram",
                  proposer_config={"prompt_lookup_max": 3})
    spec = by_name.llm_engine.config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)
    assert dict(spec.proposer_config) == {"prompt_lookup_max": 3}
    assert by_name.llm_engine.executor.speculator.proposer.prompt_lookup_max == 3
    vllm = LLM(tiny_llama, max_model_len=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    prompts = ["a b a b a b a b", "one two one two"]
    assert [o.outputs[0].token_ids for o in by_name.generate(prompts, GREEDY, use_tqdm=False)] \
        == [o.outputs[0].token_ids for o in vllm.generate(prompts, GREEDY, use_tqdm=False)]
    drafter = RepeatLast()
    custom = LLM(tiny_llama, max_model_len=64, proposer=drafter,
                 speculative_config={"num_speculative_tokens": 3})
    spec = custom.llm_engine.config.speculative_config
    assert (spec.method, spec.proposer, spec.num_speculative_tokens) == ("custom", "RepeatLast", 3)
    assert custom.llm_engine.executor.speculator.proposer is drafter
    with pytest.raises(ValueError, match="both name the drafter"):
        LLM(tiny_llama, proposer="ngram", speculative_config={"method": "suffix",
                                                              "num_speculative_tokens": 2})


def test_a_builder_holds_a_proposer_for_a_config_that_names_it(tiny_llama):
    config = EngineConfig(model=tiny_llama, max_model_len=64)
    engine = EngineBuilder(config).with_proposer(RepeatLast()).build()
    assert engine.config.speculative_config.proposer == "RepeatLast"
    spec, drafter, _ = SpeculativeConfig.split({"proposer": RepeatLast(),
                                                "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="engine builder must hold"):
        EngineBuilder(attrs.evolve(config, speculative_config=spec)).build()


def test_pooler_names_pooler_configs_pooling_type(tiny_llama):
    llm = LLM(tiny_llama, runner="pooling", pooler="mean")
    assert llm.llm_engine.config.pooler_config.pooling_type == "mean"
    assert len(llm.embed("The cat sat.", use_tqdm=False)[0].outputs.embedding) > 0
    with pytest.raises(ValueError, match="register its class"):
        LLM(tiny_llama, runner="pooling", pooler=object())
    with pytest.raises(ValueError, match="name two poolers"):
        LLM(tiny_llama, runner="pooling", pooler="mean", pooler_config={"pooling_type": "cls"})


def test_a_tool_parser_is_the_servers_setting(tiny_llama):
    with pytest.raises(ValueError, match="tool_parser is a server setting"):
        LLM(tiny_llama, tool_parser="hermes")


# -- the command line ----------------------------------------------------------------------


def test_every_kind_has_its_flags_and_the_old_ones_still_work():
    from llmlab.entrypoints.cli import _engine_settings, _tool_parser, build_parser

    args = build_parser().parse_args([
        "serve", "--scheduling-policy", "spf", "--scheduling-policy-config", '{"aging": 1}',
        "--eviction-policy", "random", "--eviction-policy-config", '{"seed": 2}',
        "--attention-backend", "torch", "--attention-backend-config", '{"decode_mirror": false}',
        "--sampler", "default", "--sampler-config", "{}",
        "--router", "least_loaded", "--router-config", "{}",
        "--kv-press", "knorm", "--kv-press-config", '{"compression_ratio": 0.5}',
        "--proposer", "ngram", "--proposer-config", '{"prompt_lookup_max": 2}',
        "--pooler", "mean", "--plugins", "a:B", "c", "--plugin-config", '{"c": {"n": 1}}',
        "--tool-parser", "hermes", "--tool-parser-config", "{}",
    ])
    settings = _engine_settings(args)
    assert settings["scheduling_policy"] == "spf"
    assert settings["scheduling_policy_config"] == '{"aging": 1}'
    assert settings["plugins"] == ["a:B", "c"] and settings["pooler"] == "mean"
    assert settings["proposer"] == "ngram" and settings["router"] == "least_loaded"
    assert args.tool_call_parser == "hermes"
    assert _tool_parser(args)() is not None
    config = EngineBuilder.from_settings("m", **settings).config
    assert config.scheduling_policy_config == {"aging": 1}
    assert config.speculative_config.method == "ngram"
    assert config.pooler_config.pooling_type == "mean"
    assert config.plugins == ("a:B", "c") and config.plugin_config == {"c": {"n": 1}}
    old = build_parser().parse_args(["serve", "--tool-call-parser", "hermes",
                                     "--speculative-config", '{"method": "ngram"}'])
    assert old.tool_call_parser == "hermes"
    assert old.speculative_config == '{"method": "ngram"}'
    bad = build_parser().parse_args(["serve", "--tool-parser", "hermes",
                                     "--tool-parser-config", '{"nope": 1}'])
    with pytest.raises(TypeError, match="tool_parser_config key 'nope'"):
        _tool_parser(bad)


def test_engine_args_generate_the_config_flags_for_other_scripts():
    import argparse

    from llmlab.entrypoints.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--scheduling-policy", "fair", "--scheduling-policy-config",
                              '{"input_weight": 2}', "--plugins", "a,b"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.scheduling_policy == "fair"
    assert config.scheduling_policy_config == {"input_weight": 2}
    assert config.plugins == ("a", "b")


# -- the config is plain data ----------------------------------------------------------------


def test_a_fully_configured_engine_config_round_trips_through_yaml_and_pickle(tiny_llama):
    config = EngineConfig(
        model=tiny_llama, scheduling_policy="priority", eviction_policy="s3fifo",
        eviction_policy_config={"small_ratio": 0.2}, attention_backend="torch",
        attention_backend_config={"decode_mirror": False}, sampler="default",
        router="prefix_aware", router_config={"load_cap": 2.0}, data_parallel_size=2,
        kv_press="snapkv", kv_press_config={"compression_ratio": 0.5, "window_size": 8},
        speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 4, "speculation_length": "fixed",
                            "num_speculative_tokens_per_batch_size": {1: 3, 8: 1}},
        enable_lora=True, max_loras=2, max_lora_rank=8, plugins=["mypkg.features:Budget"],
        plugin_config={"mypkg.features:Budget": {"n": 4}}, pooler_config={"normalize": False},
    )
    text = yaml.safe_dump(attrs.asdict(config))
    assert EngineConfig(**yaml.safe_load(text)) == config
    assert pickle.loads(pickle.dumps(config)) == config


def test_a_built_engines_config_round_trips_too(tiny_llama):
    llm = LLM(tiny_llama, max_model_len=64, kv_press=KnormPress(compression_ratio=0.5),
              enable_lora=True, router="least_loaded", plugins=[StopAfter(n=2)])
    config = llm.llm_engine.config
    assert EngineConfig(**yaml.safe_load(yaml.safe_dump(attrs.asdict(config)))) == config
    spec = LLM(tiny_llama, max_model_len=64, proposer=RepeatLast()).llm_engine.config
    assert spec.speculative_config.to_dict()["proposer"] == "RepeatLast"
    assert EngineConfig(**yaml.safe_load(yaml.safe_dump(attrs.asdict(spec)))) == spec
    assert pickle.loads(pickle.dumps(spec)) == spec


# -- one hook: bind ----------------------------------------------------------------------------


class _Bound(Policy):
    name = "bound"

    def __init__(self):
        self.view = None

    def key(self, request):
        return request.arrival_time

    def bind(self, view):
        self.view = view


class _Attached(_Bound):
    name = "attached"
    bind = None  # only the older name

    def attach(self, view):
        self.view = view


def test_policies_bind_and_the_old_attach_still_works_with_a_warning(tiny_llama):
    from llmlab.scheduler.policies import CacheAware

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        bound = _Bound()
        LLM(tiny_llama, scheduling_policy=bound)
        assert bound.view is not None
        cache_aware = CacheAware()
        LLM(tiny_llama, scheduling_policy=cache_aware)
        assert cache_aware._cache is not None
    attached = _Attached()
    with pytest.warns(DeprecationWarning, match=r"_Attached.attach\(view\) is deprecated"):
        LLM(tiny_llama, scheduling_policy=attached)
    assert attached.view is not None


def test_an_instance_serves_one_engine_and_a_second_is_refused_saying_so(tiny_llama):
    """A component instance keeps its engine's state (an eviction policy that pool's block
    ids): a second engine built from it is refused before any weights load, naming the
    kind and what to do; names and classes build afresh each time; the first engine runs
    on."""
    from llmlab.cache.eviction import LRUEviction as LRU

    lru, press = LRU(), KnormPress(compression_ratio=0.5)
    first = LLM(tiny_llama, eviction_policy=lru, kv_press=press)
    for settings, kind in (({"eviction_policy": lru}, "eviction_policy"),
                           ({"kv_press": press}, "kv_press")):
        with pytest.raises(ValueError, match=rf"{kind}=.* is already part of another engine"
                                             r".*copy\.deepcopy"):
            LLM(tiny_llama, **settings)
    LLM(tiny_llama, eviction_policy="lru", kv_press="knorm")
    LLM(tiny_llama, eviction_policy=LRU)  # a class: each build makes its own
    assert first.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
