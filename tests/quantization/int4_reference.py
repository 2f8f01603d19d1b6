"""The 4-bit tests' oracle: checkpoints packed here from a float model, and dequantizers
written from each format's specification, independent of llmlab's loader.

* :func:`quantize_groups` quantizes a ``[out, in]`` float weight to 4-bit integers with a
  scale (rounded to float16, as the formats store it) and an integer zero point per
  (output channel, group); groups follow ``g_idx`` (act-order) or are contiguous.
* :func:`write_checkpoint` writes a real checkpoint directory in one format (safetensors
  with the format's tensor names, dtypes and packing; ``config.json`` with its
  ``quantization_config``; the float model's tokenizer) from a tiny float model: every
  decoder linear is quantized (not the embeddings, the head or an MoE router).
* :func:`dequantize_checkpoint` reads such a directory back with numpy, one bit field at a
  time, as the formats describe their layouts (AutoGPTQ's and GPTQModel's QuantLinear,
  AutoAWQ's WQLinear_GEMM, compressed-tensors' pack_to_int32), and
  :func:`write_float_checkpoint` saves the result as a float checkpoint that transformers
  loads: the reference the tests run in float32.

The packing and the dequantizing are written in opposite directions from the same spec,
so a test that they round-trip (within the quantization error) checks the oracle itself.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import attrs
import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM: nibble i holds output 8c + AWQ_ORDER[i]


@attrs.frozen
class Case:
    """One checkpoint to write: ``method`` ``"gptq"`` / ``"awq"`` / ``"compressed-tensors"``,
    ``group_size`` (None: per channel), ``symmetric``, ``act_order`` (a random g_idx per
    layer, as GPTQ's Hessian order would give), ``gptq_v2`` (zero points stored as they
    are, not minus one)."""

    method: str
    group_size: int | None
    symmetric: bool = False
    act_order: bool = False
    gptq_v2: bool = False
    write_g_idx: bool = True  # GPTQ: some writers leave out a trivial g_idx

    @property
    def name(self) -> str:
        group = f"g{self.group_size}" if self.group_size else "channel"
        parts = [self.method + ("-v2" if self.gptq_v2 else ""), group,
                 "sym" if self.symmetric else "asym"]
        parts += ["actorder"] if self.act_order else []
        return "-".join(parts + ([] if self.write_g_idx else ["no-g_idx"]))


def quantized_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The float checkpoint's linears a 4-bit writer quantizes: every 2-D ``.weight`` in a
    decoder layer except an MoE router (``mlp.gate``, ``block_sparse_moe.gate``)."""
    return sorted(
        name for name, t in tensors.items()
        if re.search(r"(^|\.)(layers|h)\.\d+\.", name) and name.endswith(".weight")
        and t.dim() == 2 and not name.endswith(".gate.weight")
    )


def act_order_g_idx(in_features: int, group_size: int, generator: torch.Generator
                    ) -> torch.Tensor:
    """GPTQ act-order's g_idx: channels taken in a (here random) order, ``group_size`` at a
    time; ``g_idx[c]`` is the group of channel ``c``."""
    order = torch.randperm(in_features, generator=generator)
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[order] = torch.arange(in_features) // group_size
    return g_idx


_SHARED_INPUTS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                  "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up"}


def _input_site(prefix: str) -> str:
    """Linears that read the same input (a fused layer's parts) share one name here."""
    parent, _, leaf = prefix.rpartition(".")
    return f"{parent}.{_SHARED_INPUTS.get(leaf, leaf)}"


def quantize_groups(weight: torch.Tensor, g_idx: torch.Tensor, groups: int, symmetric: bool,
                    min_zero: int = 0, scale_dtype: torch.dtype = torch.float16):
    """``(q [out, in] int64 in 0..15, scales [out, G] in scale_dtype, zeros [out, G]
    int64)`` with ``w ~ (q - zero) * scale``. Asymmetric: the group's range (including 0)
    over 15 steps, GPTQ's quantizer; symmetric: ``2 max|w| / 15`` and zero 8."""
    out = weight.shape[0]
    scales = torch.empty(out, groups, dtype=scale_dtype)
    zeros = torch.empty(out, groups, dtype=torch.int64)
    q = torch.empty(weight.shape, dtype=torch.int64)
    for group in range(groups):
        cols = torch.nonzero(g_idx == group).reshape(-1)
        w = weight[:, cols].double()
        if symmetric:
            scale = (2 * w.abs().amax(dim=1) / 15).clamp(min=1e-8)
            zero = torch.full((out,), 8, dtype=torch.int64)
        else:
            low, high = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
            scale = ((high - low) / 15).clamp(min=1e-8)
            zero = torch.round(-low / scale).to(torch.int64).clamp(min_zero, 15)
        scale16 = scale.to(scale_dtype)
        scales[:, group], zeros[:, group] = scale16, zero
        q[:, cols] = (torch.round(w / scale16.double()[:, None]).to(torch.int64)
                      + zero[:, None]).clamp(0, 15)
    return q, scales, zeros


def _pack(values: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values per int32 along ``dim``: value ``order[i]`` of each run of eight
    in bits ``4i``, as the format writers do with ``|=`` and shifts."""
    v = values.to(torch.int64)
    if dim == 0:
        v = v.t()
    rows, cols = v.shape
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for i in range(8):
        words |= v[:, order[i]::8] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.t().contiguous() if dim == 0 else words.contiguous()


def _gptq_tensors(prefix, q, scales, zeros, g_idx, case):
    offset = 0 if case.gptq_v2 else 1  # v1 stores every zero point minus one
    return {
        f"{prefix}.qweight": _pack(q.t(), dim=0),            # [in / 8, out]
        f"{prefix}.qzeros": _pack((zeros - offset).t(), dim=1),  # [G, out / 8]
        f"{prefix}.scales": scales.t().contiguous(),           # [G, out] float16
        f"{prefix}.g_idx": g_idx.to(torch.int32),
    }


def _awq_tensors(prefix, q, scales, zeros, g_idx, case):
    return {
        f"{prefix}.qweight": _pack(q.t(), dim=1, order=AWQ_ORDER),      # [in, out / 8]
        f"{prefix}.qzeros": _pack(zeros.t(), dim=1, order=AWQ_ORDER),   # [G, out / 8]
        f"{prefix}.scales": scales.t().contiguous(),                     # [G, out]
    }


def _compressed_tensors(prefix, q, scales, zeros, g_idx, case):
    out, in_features = q.shape
    tensors = {
        # Signed values plus 8 (pack_to_int32's offset) are the unsigned q themselves.
        f"{prefix}.weight_packed": _pack(q, dim=1),                      # [out, in / 8]
        f"{prefix}.weight_scale": scales,                                 # [out, G] bf16
        f"{prefix}.weight_shape": torch.tensor([out, in_features], dtype=torch.int64),
    }
    if not case.symmetric:
        tensors[f"{prefix}.weight_zero_point"] = _pack(zeros, dim=0)     # [out / 8, G]
    if case.act_order:
        tensors[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
    return tensors


WRITERS = {"gptq": _gptq_tensors, "awq": _awq_tensors, "compressed-tensors": _compressed_tensors}


def quantization_config(case: Case) -> dict:
    group = case.group_size or -1
    if case.method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": case.act_order,
                "sym": case.symmetric, "static_groups": False, "true_sequential": True,
                "damp_percent": 0.01,
                "checkpoint_format": "gptq_v2" if case.gptq_v2 else "gptq"}
    if case.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": not case.symmetric, "modules_to_not_convert": None}
    weights = {"num_bits": 4, "type": "int", "symmetric": case.symmetric, "dynamic": False,
               "strategy": "group" if case.group_size else "channel",
               "group_size": case.group_size,
               "actorder": "group" if case.act_order else None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}},
            "ignore": ["lm_head"]}


def _conv1d_layout(path: pathlib.Path) -> bool:
    """GPT-2's checkpoints store each linear as ``[in, out]`` (its Conv1D)."""
    return json.loads((path / "config.json").read_text()).get("model_type") == "gpt2"


def write_checkpoint(float_dir, out_dir, case: Case, seed: int = 0) -> pathlib.Path:
    """``float_dir`` (a tiny float model) written to ``out_dir`` in ``case``'s format."""
    source, out = pathlib.Path(float_dir), pathlib.Path(out_dir)
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    written: dict[str, torch.Tensor] = {}
    quantized = set(quantized_names(tensors))
    conv1d = _conv1d_layout(source)
    orders: dict[str, torch.Tensor] = {}
    for name, tensor in sorted(tensors.items()):
        if name not in quantized:
            written[name] = tensor.contiguous()
            continue
        if conv1d:  # GPT-2 stores [in, out]; the 4-bit writers quantize [out, in]
            tensor = tensor.t()
        prefix = name.removesuffix(".weight")
        in_features = tensor.shape[1]
        group = case.group_size or in_features
        if case.act_order:
            # Layers reading one input (q/k/v, gate/up) share its Hessian, so its order.
            site = _input_site(prefix)
            if site not in orders:
                orders[site] = act_order_g_idx(in_features, group, generator)
            g_idx = orders[site]
        else:
            g_idx = torch.arange(in_features) // group
        # GPTQ v1 cannot store a zero point of 0 (it writes zero - 1 unsigned).
        min_zero = 1 if case.method == "gptq" and not case.gptq_v2 else 0
        scale_dtype = torch.bfloat16 if case.method == "compressed-tensors" else torch.float16
        q, scales, zeros = quantize_groups(tensor.float(), g_idx, in_features // group,
                                           case.symmetric, min_zero, scale_dtype)
        parts = WRITERS[case.method](prefix, q, scales, zeros, g_idx, case)
        if not case.write_g_idx:
            parts.pop(f"{prefix}.g_idx", None)
        written.update(parts)
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy2(item, out / item.name)
    save_file(written, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(case)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


# -- the reference dequantizers: numpy, one 4-bit field at a time ------------------------

def _fields(words: np.ndarray) -> list[np.ndarray]:
    """The eight 4-bit fields of each int32 word, field i = bits 4i..4i+3."""
    unsigned = words.astype(np.int64) & 0xFFFFFFFF
    return [(unsigned >> (4 * i)) & 0xF for i in range(8)]


def _gptq_weight(t: dict[str, np.ndarray], config: dict) -> np.ndarray:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"].astype(np.float32)
    rows, out = qweight.shape
    q = np.zeros((rows * 8, out), dtype=np.int64)            # [in, out]
    for i, field in enumerate(_fields(qweight)):
        q[i::8, :] = field                                    # input 8r + i
    z = np.zeros((qzeros.shape[0], out), dtype=np.int64)     # [G, out]
    for i, field in enumerate(_fields(qzeros)):
        z[:, i::8] = field                                    # output 8c + i
    if config.get("checkpoint_format", "gptq") == "gptq":
        z = z + 1
    group = config["group_size"] if config["group_size"] != -1 else rows * 8
    g_idx = t["g_idx"].astype(np.int64) if "g_idx" in t else np.arange(rows * 8) // group
    w = (q - z[g_idx, :]).astype(np.float32) * scales[g_idx, :]
    return w.T                                                # [out, in]


def _awq_weight(t: dict[str, np.ndarray], config: dict) -> np.ndarray:
    qweight, qzeros, scales = t["qweight"], t["qzeros"], t["scales"].astype(np.float32)
    in_features, words = qweight.shape
    group = config["group_size"] if config["group_size"] != -1 else in_features
    q = np.zeros((in_features, words * 8), dtype=np.int64)
    z = np.zeros((qzeros.shape[0], words * 8), dtype=np.int64)
    for i, (qf, zf) in enumerate(zip(_fields(qweight), _fields(qzeros))):
        q[:, AWQ_ORDER[i]::8] = qf
        z[:, AWQ_ORDER[i]::8] = zf
    groups = np.arange(in_features) // group
    w = (q - z[groups, :]).astype(np.float32) * scales[groups, :]
    return w.T


def _compressed_weight(t: dict[str, np.ndarray], config: dict) -> np.ndarray:
    out, in_features = (int(v) for v in t["weight_shape"])
    weights = config["config_groups"]["group_0"]["weights"]
    q = np.zeros((out, t["weight_packed"].shape[1] * 8), dtype=np.int64)
    for i, field in enumerate(_fields(t["weight_packed"])):
        q[:, i::8] = field
    q = q[:, :in_features] - 8                                 # signed
    scales = t["weight_scale"].astype(np.float32)              # [out, G]
    if "weight_zero_point" in t:
        packed = t["weight_zero_point"]
        zp = np.zeros((packed.shape[0] * 8, packed.shape[1]), dtype=np.int64)
        for i, field in enumerate(_fields(packed)):
            zp[i::8, :] = field
        zp = zp[:out] - 8
    else:
        zp = np.zeros_like(scales, dtype=np.int64)
    group = weights["group_size"] or in_features
    groups = t["weight_g_idx"].astype(np.int64) if "weight_g_idx" in t else (
        np.arange(in_features) // group)
    return (q - zp[:, groups]).astype(np.float32) * scales[:, groups]


_DEQUANTIZERS = {"gptq": (_gptq_weight, "qweight"), "awq": (_awq_weight, "qweight"),
                 "compressed-tensors": (_compressed_weight, "weight_packed")}


def dequantize_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of a 4-bit checkpoint as a float one: the 4-bit linears dequantized to
    float32 ``X.weight`` by the format's spec, the rest as stored."""
    path = pathlib.Path(path)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    dequantize, marker = _DEQUANTIZERS[config["quant_method"]]
    tensors = load_file(path / "model.safetensors")
    prefixes = {n.removesuffix("." + marker) for n in tensors if n.endswith("." + marker)}
    result = {}
    for name, tensor in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix not in prefixes or suffix == "bias":
            result[name] = tensor
        elif suffix == marker:
            parts = {n.rpartition(".")[2]: t.float().numpy() if t.is_floating_point()
                     else t.numpy() for n, t in tensors.items()
                     if n.rpartition(".")[0] == prefix and not n.endswith(".bias")}
            result[f"{prefix}.weight"] = torch.from_numpy(
                np.ascontiguousarray(dequantize(parts, config)))
    return result


def write_float_checkpoint(quantized_dir, out_dir) -> pathlib.Path:
    """The reference: ``quantized_dir`` dequantized by the spec, as a float32 checkpoint
    (no ``quantization_config``) that transformers and llmlab load as any other."""
    source, out = pathlib.Path(quantized_dir), pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy2(item, out / item.name)
    quantized = set(load_file(source / "model.safetensors"))
    tensors = {}
    for name, tensor in dequantize_checkpoint(source).items():
        if name not in quantized and _conv1d_layout(source):
            tensor = tensor.t()  # back to GPT-2's [in, out]
        tensors[name] = tensor.float().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
