"""Bad adapters and unsupported combinations are refused at the edge, naming the field, and
leave nothing queued or allocated."""

from __future__ import annotations

import pathlib
import shutil

import pytest

from llmlab import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import build_adapter, edit_config

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [5, 6, 7, 8]}]


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.fixture
def adapter_copy(tiny_llama, adapter_factory, tmp_path):
    def copy(**options) -> str:
        src = adapter_factory(tiny_llama, "errors-base", r=8, **options)
        return str(shutil.copytree(src, tmp_path / "copy"))

    return copy


def assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    kv = engine.kv_cache
    assert kv.pool.num_free_blocks == kv.num_blocks
    kv.check()


def refused(llm: LLM, lora: object, match: str, error=ValueError) -> None:
    with pytest.raises(error, match=match):
        llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=lora)
    assert_clean(llm)


def test_an_adapter_needs_enable_lora(tiny_llama, adapter_factory):
    plain = LLM(tiny_llama)
    lora = LoRARequest("a", 1, adapter_factory(tiny_llama, "errors-base", r=8))
    refused(plain, lora, "enable_lora")
    with pytest.raises(ValueError, match="enable_lora"):
        plain.llm_engine.add_request("x", [1, 2, 3], PARAMS, lora_request=lora)


def test_rank_above_max_lora_rank_is_refused(llm, tiny_llama, adapter_factory):
    path = adapter_factory(tiny_llama, "rank16", r=16)
    refused(llm, LoRARequest("big", 3, path), r"r=16 is more than max_lora_rank=8")


def test_unknown_adapter_paths_and_garbled_files_are_refused(llm, adapter_copy, tmp_path):
    refused(llm, LoRARequest("nope", 4, str(tmp_path / "missing")), "adapter_config.json")
    refused(llm, LoRARequest("empty", 5, ""), "lora_path")
    path = adapter_copy()
    (pathlib.Path(path) / "adapter_config.json").write_text("{not json")
    refused(llm, LoRARequest("json", 6, path), "not valid JSON")
    shutil.rmtree(path)
    path = adapter_copy()
    (pathlib.Path(path) / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    refused(llm, LoRARequest("weights", 7, path), "adapter_model.safetensors is unreadable")


def test_a_base_model_mismatch_is_refused(llm, tiny_model_factory, adapter_factory):
    qwen3 = tiny_model_factory("Qwen3ForCausalLM")  # q is 4 heads x 32, not 4 x 16
    path = adapter_factory(qwen3, "qwen3-errors", r=8)
    refused(llm, LoRARequest("qwen", 8, path), "base-model mismatch")


def test_a_base_model_name_other_than_the_served_model_is_refused(llm, tiny_llama,
                                                                   adapter_factory):
    path = adapter_factory(tiny_llama, "errors-base", r=8)
    refused(llm, LoRARequest("named", 10, path, base_model_name="gpt-9"),
            "base_model_name='gpt-9'")
    out = llm.generate(PROMPT, PARAMS, use_tqdm=False,
                       lora_request=LoRARequest("named", 10, path, base_model_name=tiny_llama))
    assert len(out[0].outputs[0].token_ids) == 4


def test_unsupported_options_and_targets_are_refused(llm, adapter_copy, tiny_llama, tmp_path):
    path = adapter_copy()
    edit_config(path, use_dora=True)
    refused(llm, LoRARequest("dora", 11, path), "use_dora")
    edit_config(path, use_dora=False, target_modules=["q_proj", "embed_tokens"])
    refused(llm, LoRARequest("emb", 12, path), r"target_modules \['embed_tokens'\]")
    lm_head = build_adapter(tiny_llama, tmp_path / "head", targets=("q_proj", "lm_head"))
    edit_config(lm_head, target_modules=None)  # only the tensors tell
    refused(llm, LoRARequest("head", 13, lm_head), "target_modules")


def test_a_bad_lora_request_object_is_a_type_error(llm):
    refused(llm, "adapter-name", "lora_request", TypeError)
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("a", 0, "/x")


def test_one_id_names_one_adapter(llm, tiny_llama, adapter_factory):
    first = adapter_factory(tiny_llama, "errors-base", r=8)
    other = adapter_factory(tiny_llama, "errors-other", r=8, seed=5)
    llm.generate(PROMPT, PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 20, first))
    refused(llm, LoRARequest("b", 20, other), "lora_int_id=20 is already adapter 'a'")


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"data_parallel_size": 2}, "data_parallel_size=2"),
        ({"engine_core_process": True}, "engine_core_process=True"),
        ({"runner": "pooling"}, "runner='pooling'"),
    ],
)
def test_unsupported_combinations_are_refused_before_loading(tiny_llama, settings, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama, enable_lora=True, **settings)


def test_architectures_outside_the_llama_family_are_refused(tiny_model_factory):
    with pytest.raises(ValueError, match="Llama family"):
        LLM(tiny_model_factory("GPT2LMHeadModel"), enable_lora=True)


def test_the_triton_kernel_is_refused_where_it_cannot_run(tiny_llama):
    """The SGMV Triton kernels need CUDA and a float32/16-bit dtype; asked for elsewhere,
    the error names the kernel, the device and the dtype (the default picks torch)."""
    import torch

    from llmlab.lora.attach import attach_lora
    from llmlab.models.loader import load_model

    from transformers import AutoConfig

    model = load_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), torch.float64, "cpu")
    with pytest.raises(ValueError, match=r"'triton' needs a CUDA device.*cpu and float64"):
        attach_lora(model, max_loras=1, max_lora_rank=8, max_cpu_loras=None, max_num_seqs=2,
                    dtype=torch.float64, device=torch.device("cpu"), kernel="triton")
