"""vLLM's entry-point conventions that its scripts and docs lean on: the
``FlexibleArgumentParser`` + ``EngineArgs.add_cli_args`` / ``from_cli_args`` script pattern
(``--model`` included), and the ``load_format`` / ``cpu_offload_gb`` settings: the values
that make sense here work, the rest are refused naming the field, the value and what is
allowed."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmlab import LLM, SamplingParams
from llmlab.testing import build_tiny_model

GREEDY = SamplingParams(max_tokens=4, temperature=0, logprobs=1)


def _greedy(llm: LLM) -> tuple[list[int], float]:
    out = llm.generate("Once upon a time", GREEDY, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.cumulative_logprob


# -- FlexibleArgumentParser and the script pattern ---------------------------------------


def test_flexible_parser_takes_dashes_or_underscores_with_or_without_equals():
    from llmlab.utils import FlexibleArgumentParser
    from llmlab.utils.argparse_utils import FlexibleArgumentParser as FromArgparseUtils

    assert FromArgparseUtils is FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--enable-prefix-caching", action="store_true")
    parser.add_argument("--kept_underscore", default=None)  # defined so: still works
    parser.add_argument("rest", nargs="*")
    for argv in (["--max-num-seqs", "8"], ["--max_num_seqs", "8"], ["--max-num-seqs=8"],
                 ["--max_num_seqs=8"]):
        assert parser.parse_args(argv).max_num_seqs == 8, argv
    args = parser.parse_args(["--enable_prefix_caching", "--kept_underscore=a_b",
                              "--max_num_seqs=3", "--", "--max_num_seqs"])
    assert args.enable_prefix_caching and args.kept_underscore == "a_b"
    assert args.max_num_seqs == 3 and args.rest == ["--max_num_seqs"]  # after "--": as is
    with pytest.raises(SystemExit):
        parser.parse_args(["--no_such_flag", "1"])


def test_flexible_parser_subcommands_respell_their_own_flags():
    from llmlab.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve")
    assert isinstance(serve, FlexibleArgumentParser)
    serve.add_argument("--max-model-len", type=int)
    assert parser.parse_args(["serve", "--max_model_len=64"]).max_model_len == 64


def test_vllm_script_pattern_builds_an_llm(tiny_llama):
    from llmlab import EngineArgs
    from llmlab.utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="a vLLM example script")
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args(["--model", tiny_llama, "--max_num_seqs", "4", "--dtype=float32",
                              "--no-enable_prefix_caching", "--load-format", "safetensors",
                              "--cpu_offload_gb=0"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model == tiny_llama and engine_args.max_num_seqs == 4
    assert engine_args.enable_prefix_caching is False
    assert engine_args.load_format == "safetensors" and engine_args.cpu_offload_gb == 0
    llm = LLM(**vars(engine_args))
    assert len(_greedy(llm)[0]) == 4
    # Without --model: vLLM's default model, as vLLM's parser has it.
    assert EngineArgs.from_cli_args(parser.parse_args([])).model == "Qwen/Qwen3-0.6B"


def test_async_engine_args_add_disable_log_requests():
    import argparse

    from llmlab import AsyncEngineArgs

    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", "m",
                                                            "--disable-log-requests"]))
    assert args.disable_log_requests is True and args.model == "m"


def test_llmlab_serve_takes_the_new_flags_and_keeps_its_own_model():
    from llmlab.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--load-format", "dummy",
                                      "--cpu-offload-gb", "0"])
    assert args.model == "m" and args.model_tag is None  # serve's own --model: no default
    assert args.load_format == "dummy" and args.cpu_offload_gb == 0.0


# -- load_format and cpu_offload_gb ------------------------------------------------------


@pytest.mark.parametrize("settings, message", [
    ({"load_format": "gguf"}, "load_format must be one of 'auto', 'safetensors', 'pt', "
                              "'dummy', got 'gguf'"),
    ({"load_format": "bitsandbytes"}, "load_format must be one of"),
    ({"load_format": "tensorizer"}, "load_format must be one of"),
    ({"cpu_offload_gb": 4}, "cpu_offload_gb=4 is not supported.*only 0 is allowed"),
    ({"cpu_offload_gb": 0.5}, "cpu_offload_gb=0.5 is not supported"),
])
def test_unsupported_values_are_refused_naming_field_value_and_allowed(settings, message):
    from llmlab import EngineArgs, EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **settings)
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", **settings).create_engine_config()


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """``(a, b, both)``: two tiny models of different weights, and a folder holding a's
    safetensors and b's weights as a PyTorch ``pytorch_model.bin``."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("formats")
    a = build_tiny_model(root / "a", seed=1)
    b = build_tiny_model(root / "b", seed=2)
    both = root / "both"
    shutil.copytree(a, both)
    torch.save(load_file(str(b / "model.safetensors")), both / "pytorch_model.bin")
    return str(a), str(b), str(both)


def test_load_format_picks_the_files_it_reads(two_checkpoints):
    a, b, both = two_checkpoints
    from_a, from_b = _greedy(LLM(a, dtype="float32")), _greedy(LLM(b, dtype="float32"))
    assert from_a != from_b
    assert _greedy(LLM(both, dtype="float32", load_format="pt")) == from_b
    assert _greedy(LLM(both, dtype="float32", load_format="safetensors")) == from_a
    assert _greedy(LLM(both, dtype="float32", load_format="auto")) == from_a


def test_a_format_the_folder_lacks_is_a_clear_error(two_checkpoints, tmp_path):
    a, _, _ = two_checkpoints
    with pytest.raises(FileNotFoundError, match=r"load_format='pt' reads pytorch_model\*\.bin"):
        LLM(a, load_format="pt")
    bin_only = tmp_path / "bin_only"
    shutil.copytree(two_checkpoints[2], bin_only)
    (bin_only / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"load_format='safetensors' reads \*\.safetens"):
        LLM(str(bin_only), load_format="safetensors")


def test_dummy_weights_read_no_file_and_keep_dtype_and_tokenizer(two_checkpoints, tmp_path):
    a, _, _ = two_checkpoints
    no_weights = tmp_path / "no_weights"
    shutil.copytree(a, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError):
        LLM(str(no_weights))
    llm = LLM(str(no_weights), load_format="dummy", dtype="bfloat16")
    model = llm.llm_engine.executor.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and isinstance(out.outputs[0].text, str)
    # The same random weights every time.
    again = LLM(str(no_weights), load_format="dummy", dtype="float32")
    assert _greedy(again) == _greedy(LLM(str(no_weights), load_format="dummy",
                                         dtype="float32"))


def test_dummy_with_quantization_quantizes_random_weights_but_refuses_a_saved_scheme(
        two_checkpoints):
    from transformers import AutoConfig

    from llmlab.quantization.loading import QuantizationSpec

    a, _, _ = two_checkpoints
    llm = LLM(a, load_format="dummy", quantization="int8", dtype="float32")
    assert len(_greedy(llm)[0]) == 4
    with pytest.raises(ValueError, match="load_format='dummy' is not supported for a "
                                         "checkpoint saved quantized"):
        QuantizationSpec("int8", prequantized=True).load_model(
            a, AutoConfig.from_pretrained(a), torch.float32, torch.device("cpu"),
            load_format="dummy")
