"""4-bit checkpoints llmlab cannot load are refused with the file and field named: the
config's, before any weight is read; a tensor's (``g_idx``, a fused layer's parts), when
it is read."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmlab import LLM
from llmlab.models import loader
from llmlab.quantization.int4_formats import int4_format
from tests.quantization.int4_reference import Case, write_checkpoint

SETTINGS = dict(device="cpu", seed=0, dtype="float32", cpu_threads=1)
ATTENTION = "model.layers.0.self_attn"


@pytest.fixture(scope="module")
def gptq_actorder(tiny_llama, tmp_path_factory) -> pathlib.Path:
    return write_checkpoint(tiny_llama, tmp_path_factory.mktemp("gptq") / "ckpt",
                            Case("gptq", 32, act_order=True))


def _copy(source: pathlib.Path, out: pathlib.Path, *, config=None, tensors=None) -> str:
    """``source`` copied to ``out`` with its quantization_config updated by ``config`` and
    its tensors by ``tensors(dict) -> dict``."""
    shutil.copytree(source, out)
    meta = json.loads((out / "config.json").read_text())
    if config is not None:
        meta["quantization_config"] = config(dict(meta.get("quantization_config") or {}))
    (out / "config.json").write_text(json.dumps(meta))
    if tensors is not None:
        weights = tensors(load_file(out / "model.safetensors"))
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _refuse_weight_reads(monkeypatch):
    def read(*args, **kwargs):
        raise AssertionError("weights were read before the setting was refused")

    monkeypatch.setattr(loader, "iterate_weights", read)


def _updated(**fields):
    return lambda config: {**config, **fields}


def _ct_weights(**fields):
    def update(config):
        group = dict(config["config_groups"]["group_0"])
        group["weights"] = {**group["weights"], **fields}
        return {**config, "config_groups": {"group_0": group}}

    return update


# (test id, checkpoint, config change, the field and value the error names)
CONFIG_CASES = [
    ("unknown-method", "float", lambda c: {"quant_method": "bitsandbytes"},
     "quant_method='bitsandbytes'"),
    ("gptq-3-bit", "gptq", _updated(bits=3), "bits=3"),
    ("gptq-8-bit", "gptq", _updated(bits=8), "bits=8"),
    ("awq-2-bit", "awq", _updated(bits=2), "bits=2"),
    ("group-48-vs-width-64", "gptq", _updated(group_size=48),
     "group_size=48 does not divide the input width 64 of layer layers.0.self_attn.qkv_proj"),
    ("group-0", "gptq", _updated(group_size=0), "group_size=0"),
    ("gptq-marlin-format", "gptq", _updated(checkpoint_format="marlin"),
     "checkpoint_format='marlin'"),
    ("gptq-dynamic", "gptq", _updated(dynamic={"-:.*mlp.*": {}}), "dynamic="),
    ("gptq-quantized-head", "gptq", _updated(lm_head=True), "lm_head=True"),
    ("awq-gemv", "awq", _updated(version="gemv"), "version='gemv'"),
    ("ct-int-quantized-4-bit", "ct", _updated(format="int-quantized"),
     "format='int-quantized'"),
    ("ct-2-bit", "ct", _ct_weights(num_bits=2), "config_groups.group_0.weights.num_bits=2"),
    ("ct-tensor-strategy", "ct", _ct_weights(strategy="tensor"),
     "config_groups.group_0.weights.strategy='tensor'"),
    ("ct-group-96", "ct", _ct_weights(group_size=96),
     "config_groups.group_0.weights.group_size=96 does not divide"),
    ("ct-float-4-bit", "ct", _ct_weights(type="float"),
     "config_groups.group_0.weights.type='float'"),
    ("ct-w4a8", "ct", lambda c: {**c, "config_groups": {"group_0": {
        **c["config_groups"]["group_0"],
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"}}}},
     "config_groups.group_0.input_activations="),
]


@pytest.fixture(scope="module")
def checkpoints(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4-configs")
    return {
        "float": pathlib.Path(tiny_llama),
        "gptq": write_checkpoint(tiny_llama, root / "gptq", Case("gptq", 32)),
        "awq": write_checkpoint(tiny_llama, root / "awq", Case("awq", 32)),
        "ct": write_checkpoint(tiny_llama, root / "ct", Case("compressed-tensors", 32)),
    }


@pytest.mark.parametrize(("kind", "change", "named"),
                         [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_a_config_llmlab_cannot_load_is_refused_before_any_weight_is_read(
    checkpoints, tmp_path, monkeypatch, kind, change, named
):
    path = _copy(checkpoints[kind], tmp_path / "ckpt", config=change)
    _refuse_weight_reads(monkeypatch)
    with pytest.raises(ValueError) as error:
        LLM(path, **SETTINGS)
    message = str(error.value)
    assert str(pathlib.Path(path) / "config.json") in message
    assert named in message
    assert "allowed" in message


def test_the_messages_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"my/config.json: .*version='gemv'.*allowed: 'gemm'"):
        int4_format({"quant_method": "awq", "bits": 4, "version": "gemv"}, "my/config.json")
    with pytest.raises(ValueError, match=r"bits=8.*allowed: 4 \(8-bit weights load from"):
        int4_format({"quant_method": "gptq", "bits": 8}, "config.json")


def _g_idx(name):
    return f"{ATTENTION}.{name}.g_idx"


def test_a_g_idx_of_the_wrong_shape_is_refused_naming_the_tensor_and_file(
    gptq_actorder, tmp_path
):
    def shorten(tensors):
        tensors[_g_idx("k_proj")] = tensors[_g_idx("k_proj")][:-8].clone()
        return tensors

    path = _copy(gptq_actorder, tmp_path / "ckpt", tensors=shorten)
    file = re.escape(str(pathlib.Path(path) / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{_g_idx('k_proj')} \(in {file}\) has shape \(56,\)"):
        LLM(path, **SETTINGS)


def test_g_idx_values_outside_the_groups_are_refused(gptq_actorder, tmp_path):
    def corrupt(tensors):
        tensors[_g_idx("o_proj")] = tensors[_g_idx("o_proj")].clone()
        tensors[_g_idx("o_proj")][3] = 7
        return tensors

    path = _copy(gptq_actorder, tmp_path / "ckpt", tensors=corrupt)
    with pytest.raises(ValueError, match=rf"{_g_idx('o_proj')} .*holds group indices from 0 "
                                         r"to 7; allowed: 0 to 1"):
        LLM(path, **SETTINGS)


def test_a_g_idx_that_does_not_fill_each_group_is_refused(gptq_actorder, tmp_path):
    def unbalance(tensors):
        tensors[_g_idx("o_proj")] = torch.zeros_like(tensors[_g_idx("o_proj")])
        return tensors

    path = _copy(gptq_actorder, tmp_path / "ckpt", tensors=unbalance)
    with pytest.raises(ValueError, match=r"puts 64 channels in group 0; every group must "
                                         r"hold group_size=32"):
        LLM(path, **SETTINGS)


def test_fused_parts_whose_act_order_disagrees_are_refused_naming_both(gptq_actorder,
                                                                        tmp_path):
    """q, k and v share one input in ``qkv_proj``; a k ordered otherwise than q cannot."""
    def reorder(tensors):
        # A valid g_idx (two groups of 32), but not q's.
        tensors[_g_idx("k_proj")] = (torch.arange(64, dtype=torch.int32) % 2)
        return tensors

    path = _copy(gptq_actorder, tmp_path / "ckpt", tensors=reorder)
    with pytest.raises(ValueError, match=r"order their input channels differently.*qkv_proj"
                       ) as error:
        LLM(path, **SETTINGS)
    assert _g_idx("q_proj") in str(error.value) and _g_idx("k_proj") in str(error.value)


def test_a_fused_layer_with_a_float_part_is_refused(checkpoints, tiny_llama, tmp_path):
    float_weights = load_file(pathlib.Path(tiny_llama) / "model.safetensors")

    def dequantized_q(tensors):
        for suffix in ("qweight", "qzeros", "scales", "g_idx"):
            del tensors[f"{ATTENTION}.q_proj.{suffix}"]
        tensors[f"{ATTENTION}.q_proj.weight"] = float_weights[f"{ATTENTION}.q_proj.weight"]
        return tensors

    path = _copy(checkpoints["gptq"], tmp_path / "ckpt", tensors=dequantized_q)
    with pytest.raises(ValueError, match=rf"qkv_proj fuses {ATTENTION}.q_proj.weight \(float\) "
                                         rf"with {ATTENTION}.k_proj.qweight"):
        LLM(path, **SETTINGS)


def test_a_4_bit_layer_the_config_keeps_in_float_is_refused(checkpoints, tmp_path):
    path = _copy(checkpoints["gptq"], tmp_path / "ckpt",
                 config=_updated(modules_to_not_convert=["mlp.down_proj"]))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.qweight .*is 4-bit, "
                                         r"but .*modules_to_not_convert"):
        LLM(path, **SETTINGS)


def test_a_layer_missing_a_tensor_is_refused(checkpoints, tmp_path):
    def drop(tensors):
        del tensors["model.layers.1.mlp.up_proj.qzeros"]
        return tensors

    path = _copy(checkpoints["gptq"], tmp_path / "ckpt", tensors=drop)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj is 4-bit .*has no "
                                         r"model.layers.1.mlp.up_proj.qzeros"):
        LLM(path, **SETTINGS)


def test_zero_biases_some_gptq_writers_store_are_dropped_and_others_refused(
    checkpoints, tmp_path
):
    """AutoGPTQ can write a bias for a layer without one; zeros mean nothing (vLLM skips
    them too), anything else would be silently lost, so it is refused."""
    def biases(value):
        def add(tensors):
            for name in [n for n in tensors if n.endswith(".qweight")]:
                out = tensors[name].shape[1]
                tensors[name.replace(".qweight", ".bias")] = torch.full((out,), value)
            return tensors
        return add

    zero = _copy(checkpoints["gptq"], tmp_path / "zero", tensors=biases(0.0))
    plain = LLM(str(checkpoints["gptq"]), **SETTINGS)
    params = dict(temperature=0, max_tokens=8, ignore_eos=True)
    from llmlab import SamplingParams

    prompt = [{"prompt_token_ids": [5, 6, 7, 8]}]
    expected = plain.generate(prompt, SamplingParams(**params), use_tqdm=False)
    got = LLM(zero, **SETTINGS).generate(prompt, SamplingParams(**params), use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    nonzero = _copy(checkpoints["gptq"], tmp_path / "nonzero", tensors=biases(0.5))
    with pytest.raises(ValueError, match=r"\.bias .*is not zero, but .* has no bias"):
        LLM(nonzero, **SETTINGS)


def test_a_4_bit_config_on_float_weights_is_refused(checkpoints, tmp_path):
    path = _copy(checkpoints["float"], tmp_path / "ckpt",
                 config=lambda c: {"quant_method": "gptq", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match=r"config.json declares a 4-bit checkpoint \(gptq "
                                         r"4-bit, group 32.*no \*\.qweight tensor"):
        LLM(path, **SETTINGS)


def test_asking_for_another_scheme_or_dummy_weights_is_refused(checkpoints, monkeypatch):
    path = str(checkpoints["gptq"])
    with pytest.raises(ValueError, match=r"quantization='int8' does not match the checkpoint, "
                                         r"which is quantized as gptq 4-bit.*quantization=None"):
        LLM(path, quantization="int8", **SETTINGS)
    _refuse_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"load_format='dummy' is not supported .*'w4a16'"):
        LLM(path, load_format="dummy", **SETTINGS)


def test_vllm_format_names_load_the_checkpoint_they_name(gptq_actorder, tiny_llama,
                                                          monkeypatch):
    """``quantization="gptq"`` (or vLLM's "gptq_marlin") on a GPTQ checkpoint loads it as
    saved, the same tokens as ``None``; another format's name, or a float checkpoint, is
    refused naming both, before any weight is read."""
    from llmlab import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def tokens(**settings):
        llm = LLM(str(gptq_actorder), **SETTINGS, **settings)
        return llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0].token_ids

    plain = tokens()
    assert tokens(quantization="gptq") == plain
    assert tokens(quantization="gptq_marlin") == plain
    _refuse_weight_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"quantization='awq' .* quant_method='gptq'"):
        LLM(str(gptq_actorder), quantization="awq", **SETTINGS)
    with pytest.raises(ValueError, match=r"quantization='gptq' .* quant_method=None"):
        LLM(tiny_llama, quantization="gptq", **SETTINGS)
    with pytest.raises(ValueError, match=r"quantization must be one of .*'gptq'"):
        LLM(tiny_llama, quantization="int3", **SETTINGS)
