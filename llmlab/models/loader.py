"""From a model name to a ready model: find the files, pick a dtype, stream the weights.

``load_model`` builds the network on the ``meta`` device and materialises it uninitialised
on the target device, because a random init of billions of parameters that the checkpoint
immediately overwrites would dominate load time. The row-count check in
:func:`llmlab.models.weights.load_mapped_weights` is what makes skipping init safe: a
parameter the checkpoint does not fill is an error, never silent garbage. The one random
init is ``load_format="dummy"`` (vLLM's, for benchmarks), which reads no weight file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llmlab.builtin import DRAFT_MODEL_NAME, MAIN_MODEL_NAME, builtin_model_path
from llmlab.distributed.parallel_state import TensorParallel
from llmlab.dtypes import AUTO_DTYPES, DTYPE_NAMES, dtype_from_name
from llmlab.models.layers import config_value
from llmlab.models.registry import get_model_class
from llmlab.models.weights import LazyTensor

# Config, tokenizer (json, sentencepiece, tiktoken, GPT-2 merges/vocab txt) and weights.
_METADATA_PATTERNS = ["*.json", "*.model", "*.tiktoken", "*.txt"]
# Mistral repos also carry consolidated.safetensors (Mistral-native names, a second copy of
# every weight) and Llama 3 repos an original/ folder; neither is HF format.
_IGNORE_PATTERNS = ["consolidated*", "original/*"]


def resolve_model_path(
    model: str, revision: str | None = None, cache_dir: str | None = None
) -> pathlib.Path:
    """A local model directory as-is; the built-in models by name (``"llmlab-stories"``,
    ``"llmlab-stories-draft"``, the names ``llmlab serve`` gives them), shipped in the
    package; else a Hub repo id downloaded (or found in cache).

    ``cache_dir`` (vLLM's ``download_dir``) is where hub downloads go (default: the
    Hugging Face cache).

    Only config, tokenizer and weight files are fetched: safetensors when the repo has
    them, otherwise PyTorch ``.bin`` files.
    """
    local = pathlib.Path(model).expanduser()
    if local.is_dir():
        return local
    if model.startswith(("/", "./", "../", "~")) or local.exists():
        raise FileNotFoundError(f"model path {model!r} is not a directory")
    if model in (MAIN_MODEL_NAME, DRAFT_MODEL_NAME):
        return builtin_model_path(draft=model == DRAFT_MODEL_NAME)

    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    def download(weight_patterns: list[str]) -> pathlib.Path:
        try:
            path = snapshot_download(
                model,
                revision=revision,
                cache_dir=cache_dir,
                allow_patterns=_METADATA_PATTERNS + weight_patterns,
                ignore_patterns=_IGNORE_PATTERNS,
            )
        except HFValidationError as e:
            raise ValueError(
                f"model {model!r} is neither a local directory nor a valid Hub repo id: {e}"
            ) from e
        except OSError as e:
            raise FileNotFoundError(
                f"model {model!r} is not a local directory and could not be fetched from the "
                f"Hugging Face Hub (revision={revision!r}): {e}"
            ) from e
        return pathlib.Path(path)

    path = download(["*.safetensors"])
    if not any(path.glob("*.safetensors")):
        path = download(["pytorch_model*.bin"])
    return path


def resolve_dtype(
    dtype: str | torch.dtype, hf_config: object, device: torch.device | None = None
) -> torch.dtype:
    """The compute dtype: ``auto`` keeps a 16-bit checkpoint's dtype; a float32 (or
    unspecified) checkpoint runs in float32 on CPU and in bfloat16 on CUDA (float16 where
    the GPU has no bfloat16), as vLLM does: GPU inference is memory-bound and 16-bit
    weights and KV halve the bytes. Ask for ``dtype="float32"`` to keep full precision.
    The names are :data:`llmlab.dtypes.DTYPE_NAMES`."""
    resolved = dtype_from_name(dtype)
    if resolved is not None:
        return resolved
    # "auto". Recent transformers write ``dtype``; older configs ``torch_dtype``.
    config_dtype = config_value(hf_config, "dtype", "torch_dtype")
    if isinstance(config_dtype, str):
        config_dtype = DTYPE_NAMES.get(config_dtype.lower().removeprefix("torch."))
    # A missing or exotic (float64, int8) config dtype means "whatever it was saved
    # in", not a request; float32 is the safe reading.
    if config_dtype not in AUTO_DTYPES:
        config_dtype = torch.float32
    if config_dtype == torch.float32 and device is not None and device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return config_dtype


# Config fields that bound the context length, most specific first.
_MAX_LEN_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_ctx",
)


def max_model_len_from_config(hf_config: object) -> int:
    """The longest context the model supports, from whichever field its config uses."""
    for field in _MAX_LEN_FIELDS:
        value = getattr(hf_config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(
        f"cannot tell the maximum context length from {type(hf_config).__name__}: "
        f"none of {', '.join(_MAX_LEN_FIELDS)} is set; pass max_model_len explicitly"
    )


def _indexed_files(path: pathlib.Path, index_name: str) -> list[pathlib.Path] | None:
    index = path / index_name
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    return [path / name for name in sorted(set(weight_map.values()))]


# vLLM's load_format names this loader reads -> the kinds of file each may read, in order of
# preference ("dummy" reads none). EngineConfig.load_format checks the same names.
_FILE_KINDS = {
    "auto": ("safetensors", "bin"),
    "safetensors": ("safetensors",),
    "pt": ("bin",),
    "dummy": (),
}
_KIND_FILES = {
    "safetensors": ("model.safetensors.index.json", "*.safetensors"),
    "bin": ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
}


def _check_load_format(load_format: str) -> None:
    if load_format not in _FILE_KINDS:
        raise ValueError(
            f"load_format must be one of {', '.join(map(repr, _FILE_KINDS))}, "
            f"got {load_format!r}"
        )


def _weight_files(
    path: pathlib.Path, load_format: str = "auto"
) -> tuple[str, list[pathlib.Path]]:
    """Which files hold the weights, preferring safetensors (``load_format="auto"``),
    honouring shard indexes (so stray extra files in the folder are not read)."""
    _check_load_format(load_format)
    if load_format == "dummy":
        raise ValueError("load_format='dummy' reads no weight files")
    kinds = _FILE_KINDS[load_format]
    for kind in kinds:
        index_name, pattern = _KIND_FILES[kind]
        files = _indexed_files(path, index_name)
        if files is None:
            files = sorted(p for p in path.glob(pattern) if not p.name.startswith("consolidated"))
        if files:
            return kind, files
    wanted = " or ".join(_KIND_FILES[kind][1] for kind in kinds)
    if load_format == "auto":
        raise FileNotFoundError(f"no {wanted} weights in {path}")
    raise FileNotFoundError(
        f"load_format={load_format!r} reads {wanted} weights, and {path} has none; "
        "load_format='auto' takes whichever kind the folder has"
    )


def iterate_weights(
    path: str | os.PathLike, lazy: bool = False, load_format: str = "auto"
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Stream ``(name, tensor)`` from a model directory, one tensor at a time (CPU).

    ``lazy``: yield safetensors tensors as :class:`~llmlab.models.weights.LazyTensor`
    handles, valid until the next item, so that a tensor-parallel rank reads only its
    slices (``.bin`` files are read whole either way). ``load_format`` (vLLM's):
    ``"auto"`` reads safetensors, else ``.bin`` files; ``"safetensors"`` and ``"pt"``
    read only that kind (``FileNotFoundError`` when the folder has none).
    """
    kind, files = _weight_files(pathlib.Path(path), load_format)
    if kind == "safetensors":
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if lazy:
                        yield name, LazyTensor(handle.get_slice(name))
                    else:
                        yield name, handle.get_tensor(name)
        return
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


def checkpoint_names(
    path: str | os.PathLike, load_format: str = "auto"
) -> tuple[str, set[str]] | None:
    """``(where, names)``: the tensor names of a safetensors checkpoint, read from its shard
    index or its files' headers (no tensor is read), and the file(s) they come from; None
    for ``.bin`` checkpoints (their names are only known by reading them)."""
    folder = pathlib.Path(path)
    kind, files = _weight_files(folder, load_format)
    if kind != "safetensors":
        return None
    index = folder / _KIND_FILES["safetensors"][0]
    if index.is_file():
        return str(index), set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names.update(handle.keys())
    return ", ".join(map(str, files)), names


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_path: str | os.PathLike,
    hf_config: object,
    dtype: torch.dtype | str,
    device: str | torch.device,
    tp: TensorParallel | None = None,
    *,
    prepare: Callable[[nn.Module], object] | None = None,
    read_weights: Callable[[Iterator], Iterator] | None = None,
    load_format: str = "auto",
) -> nn.Module:
    """Build the model ``hf_config.architectures`` names and fill it from ``model_path``.

    Returns the model in eval mode with gradients off, its parameters in ``dtype`` (a
    torch dtype or any name :func:`resolve_dtype` accepts) on ``device``. With a parallel
    ``tp``, the model holds this rank's shard and reads only its slices of the checkpoint.

    ``prepare(model)`` runs on the model built on the meta device, before it is
    materialised (a quantized checkpoint's loader swaps in modules shaped like its
    tensors there); ``read_weights`` filters the checkpoint's ``(name, tensor)`` stream.
    ``load_format`` (vLLM's) picks the files :func:`iterate_weights` reads; ``"dummy"``
    reads none and fills the parameters with :func:`fill_dummy_weights` instead.
    """
    _check_load_format(load_format)
    cls = get_model_class(config_value(hf_config, "architectures"))
    device = torch.device(device)
    dtype = resolve_dtype(dtype, hf_config, device)
    parallel = tp is not None and tp.is_parallel
    with torch.device("meta"), _default_dtype(dtype):
        try:
            model = build_model_class(cls, hf_config, tp)
        except ValueError as err:  # a config field the model cannot take: say which file
            raise ValueError(f"{pathlib.Path(model_path) / 'config.json'}: {err}") from err
        if prepare is not None:
            prepare(model)
    check = getattr(model, "check_checkpoint", None)
    if check is not None and load_format != "dummy":
        listed = checkpoint_names(model_path, load_format)
        if listed is not None:  # before any weight is read
            check(*listed)
    model = model.to_empty(device=device)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        weights = iterate_weights(model_path, lazy=parallel, load_format=load_format)
        model.load_weights(weights if read_weights is None else read_weights(weights))
    model.eval()
    model.requires_grad_(False)
    return model


def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights in place of a checkpoint's (vLLM's ``load_format="dummy"``, for
    benchmarks): each matrix drawn from N(0, 1/fan_in), so activations keep a realistic
    scale through the layers; vectors are norm scales (1) or biases (0). Drawn on the
    parameters' own device and dtype, the same for the same ``seed``. Parameters that are
    not floating point (a quantized checkpoint's) cannot be drawn: ``ValueError``."""
    generator = None
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters come once
            if not param.is_floating_point():
                raise ValueError(
                    f"load_format='dummy' cannot fill {name} ({param.dtype}): only floating "
                    "point weights can be drawn at random"
                )
            if generator is None:
                generator = torch.Generator(device=param.device).manual_seed(seed)
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


def build_model_class(cls: type, hf_config: object, tp: TensorParallel | None = None):
    """``cls(hf_config)``, or ``cls(hf_config, tp=tp)`` for a parallel ``tp``; a class that
    does not declare ``supports_tensor_parallel`` is refused by name."""
    if tp is None or not tp.is_parallel:
        return cls(hf_config)
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"tensor_parallel_size={tp.size}: the model class {cls.__name__} does not support "
            "tensor parallelism (it does not set supports_tensor_parallel = True); use 1"
        )
    return cls(hf_config, tp=tp)


def load_tokenizer(
    path_or_id: str | os.PathLike,
    revision: str | None = None,
    *,
    use_fast: bool = True,
    cache_dir: str | None = None,
):
    """The model's tokenizer via ``transformers.AutoTokenizer`` (fast when available, unless
    ``use_fast=False``: vLLM's ``tokenizer_mode="slow"``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path_or_id), revision=revision, use_fast=use_fast, cache_dir=cache_dir
    )
