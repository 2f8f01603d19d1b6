"""Mixture-of-experts models (Mixtral, Qwen3-MoE, OLMoE) in the engine: what the architecture
parity tests (tests/engine/test_hf_parity.py, tests/models/test_hf_parity.py, which run
them with the dense models) do not cover: prefix-cache hits and parallel samples, routing
that really spreads tokens, the layers a config keeps dense, refused configs."""

from __future__ import annotations

import json

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.models.moe import Qwen3MoeForCausalLM, SparseMoeBlock
from llmlab.testing import build_tiny_model
from tests.engine.test_hf_parity import NUM_NEW_TOKENS, hf_greedy

MOE = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"]


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = hf_greedy(tiny_model_factory(arch), seed=3)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", MOE)
def test_prefix_hits_and_parallel_samples_match_hf(reference, arch):
    """Each prompt twice, the second time behind a long cached prefix, with n=2 greedy
    samples: every sample is HF's greedy continuation."""
    path, prompts, expected = reference(arch)
    llm = LLM(path, dtype="float32", seed=0, block_size=4, enable_prefix_caching=True)
    events = []
    llm.llm_engine.subscribe(events.append)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True, n=2)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for out, want in zip(outs, expected, strict=True):
            assert [c.token_ids for c in out.outputs] == [want, want]
    assert sum(len(e.blocks_prefix_hit) for e in events) > 0


@pytest.mark.parametrize("arch", MOE)
def test_routing_spreads_tokens_over_the_experts(tiny_model_factory, arch):
    llm = LLM(tiny_model_factory(arch), dtype="float32", enforce_eager=True)
    model = llm.llm_engine.executor.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    x = torch.randn(256, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, chosen = blocks[0].route(x)
    assert chosen.shape == (256, model.moe.top_k) and weights.shape == chosen.shape
    counts = torch.bincount(chosen.reshape(-1), minlength=model.moe.num_experts)
    assert (counts > 0).all()  # every expert gets tokens: routing is not degenerate
    assert len(set(map(tuple, chosen.sort(dim=1).values.tolist()))) > 1


def test_qwen3_moe_keeps_the_dense_mlp_where_the_config_says(tmp_path):
    path = build_tiny_model(tmp_path / "q", "Qwen3MoeForCausalLM", num_hidden_layers=4,
                            mlp_only_layers=[0], decoder_sparse_step=2)
    llm = LLM(str(path), dtype="float32")
    model = llm.llm_engine.executor.model
    assert isinstance(model, Qwen3MoeForCausalLM)
    # Sparse where (i + 1) % 2 == 0 and i not in mlp_only_layers: layers 1 and 3.
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers]
    assert sparse == [False, True, False, True]
    assert model.moe.sparse_layers == (False, True, False, True)


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Reading any checkpoint tensor fails the test: refusals must come before it."""
    from llmlab.models import loader

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(loader, "iterate_weights", refuse)


def test_a_config_picking_more_experts_than_it_has_is_refused(tmp_path, no_weight_reads):
    path = build_tiny_model(tmp_path / "m", "MixtralForCausalLM")
    config = json.loads((path / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: num_experts_per_tok=9 .* \(4\)"):
        LLM(str(path), dtype="float32")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_missing_an_expert_is_refused_before_reading(
    tmp_path, no_weight_reads, sharded
):
    """One expert's down projection gone (from a single file, or from a sharded
    checkpoint's index): refused naming the file and the missing tensors' module."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path / "m", "MixtralForCausalLM")
    file = path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    if sharded:  # two shards and an index
        file.unlink()
        names = sorted(tensors)
        weight_map = {}
        for shard, part in enumerate((names[::2], names[1::2])):
            shard_name = f"model-0000{shard + 1}-of-00002.safetensors"
            save_file({n: tensors[n] for n in part}, path / shard_name, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, shard_name))
        index = path / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        where = "model.safetensors.index.json"
    else:
        save_file(tensors, file, metadata={"format": "pt"})
        where = "model.safetensors"
    with pytest.raises(ValueError, match=rf"{where}: .*layers\.1\.block_sparse_moe\.experts\.2"
                       r"\.w2; its config\.json declares 4 experts"):
        LLM(str(path), dtype="float32")


def test_moe_models_decode_eagerly_on_cuda(tiny_model_factory):
    """A captured CUDA graph would replay one step's routing: the build decides to capture
    decode for a dense model on CUDA and not for an MoE one (decided without a GPU)."""
    from llmlab.runner.build import captures_decode

    class GraphableBackend:
        def decode_graph_metadata(self, *args):
            pass

    cuda, backend = torch.device("cuda"), GraphableBackend()
    for arch, captures in (("LlamaForCausalLM", True), *((arch, False) for arch in MOE)):
        model = LLM(tiny_model_factory(arch), dtype="float32").llm_engine.executor.model
        assert captures_decode(cuda, False, backend, None, model) is captures, arch
        assert not captures_decode(torch.device("cpu"), False, backend, None, model)
