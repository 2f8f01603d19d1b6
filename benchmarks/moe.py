"""Mixture-of-experts layers: llmlab's expert path against a per-expert loop and a dense MLP.

One sparse layer (:class:`llmlab.models.moe.SparseMoeBlock`, random weights, a random
router) at each token count of ``--tokens`` (default 1, 16, 256, 2048: a decode step of one
sequence, of a small batch, a prefill chunk, a full token budget), three ways, on the same
input:

* **llmlab**: the block's forward as the engine runs it (router, softmax, top-k, experts).
  On CUDA the fused Triton kernel on the stacked weights (``llmlab.kernels.triton_moe``,
  after the block's check against its grouped path); on CPU the grouped path, each expert
  that got tokens run once on them, through oneDNN-prepacked linears as the engine packs
  every linear (``llmlab.kernels.cpu_linear``).
* **loop**: the naive baseline, the same router then, per expert, a ``nonzero`` over the
  routing and two ``torch.mm`` on the plain weights (transformers' eager MoE loop).
* **dense**: a gated MLP (oneDNN-prepacked on CPU, as dense models run) whose inner width is
  ``top_k`` experts' (``top_k * expert width``): the same active parameters and FLOPs a
  token, no router, no grouping. What an MoE layer costs over the dense layer it mimics.

Shapes (``--shapes``): ``mixtral`` (Mixtral 8x7B scaled to hidden 1024: 8 experts of 3584,
top-2, probabilities renormalised, weighting in float32) and ``qwen3`` (Qwen3-30B-A3B
scaled to hidden 1024: 64 experts of 384, top-8, renormalised); ``tiny`` (hidden 64, 4
experts of 32, top-2) is for the smoke test.

Method: each repeat times the three in turn (the order rotates from repeat to repeat, as a
shared machine's load drifts); a timing is ``calls`` back-to-back forwards (as many as take
about 50 ms, at least one) divided by ``calls``, wall clock (``time.perf_counter``; on CUDA
after ``torch.cuda.synchronize``). Printed: the median over ``--repeats`` and the spread
(max - min) / median, and both ratios as times: ``llmlab/loop`` and ``llmlab/dense`` (< 1:
llmlab faster). Numerics, once per row: max |llmlab - loop| / max |loop| must stay below
1e-4 (float32) or 5e-2 (16-bit), else FAIL and exit status 1. Threads: ``--threads``
(default 2, the cores of the machine the CPU numbers come from) for every side; the load
average is printed before and after.

Run::

    python -m benchmarks.moe                                  # CPU, float32, both shapes
    python -m benchmarks.moe --device cpu --dtype bfloat16 --shapes qwen3
    python -m benchmarks.moe --device cuda --dtype bfloat16   # the fused Triton kernel
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import attrs
import torch
import torch.nn.functional as F
from torch import nn

SHAPES = {
    # name: (transformers config class, its fields)
    "mixtral": ("MixtralConfig", dict(hidden_size=1024, intermediate_size=3584,
                                       num_local_experts=8, num_experts_per_tok=2)),
    "qwen3": ("Qwen3MoeConfig", dict(hidden_size=1024, moe_intermediate_size=384,
                                     num_experts=64, num_experts_per_tok=8,
                                     norm_topk_prob=True)),
    "tiny": ("MixtralConfig", dict(hidden_size=64, intermediate_size=32,
                                    num_local_experts=4, num_experts_per_tok=2)),
}
METHODS = ("llmlab", "loop", "dense")
TARGET_S = 0.05  # one timing: about this long


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--shapes", default="mixtral,qwen3", help="of " + ",".join(SHAPES))
    parser.add_argument("--tokens", default="1,16,256,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.torch_dtype = getattr(torch, args.dtype)
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    args.tokens = [int(t) for t in args.tokens.split(",")]
    return args


def build_layers(shape: str, dtype: torch.dtype, device: torch.device, seed: int):
    """``(block, loop_weights, dense)``: the sparse block ready to run as the engine runs it
    on ``device``, the plain stacked expert weights for the loop, and the dense MLP."""
    import transformers

    from llmlab.distributed.parallel_state import TensorParallel
    from llmlab.models.llama import GatedMLP
    from llmlab.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM, SparseMoeBlock

    config_class, fields = SHAPES[shape]
    config = getattr(transformers, config_class)(num_hidden_layers=1, **fields)
    model_class = MixtralForCausalLM if config_class == "MixtralConfig" else Qwen3MoeForCausalLM
    spec, moe = model_class.spec_from_config(config), model_class.moe_from_config(config)
    torch.manual_seed(seed)
    block = SparseMoeBlock(spec, moe, TensorParallel()).to(dtype=dtype, device=device)
    dense_spec = attrs.evolve(spec, intermediate_size=moe.top_k * moe.intermediate_size)
    dense = GatedMLP(dense_spec, TensorParallel()).to(dtype=dtype, device=device)
    for module in (block, dense):
        module.requires_grad_(False)
        for param in module.parameters():  # N(0, 1/fan_in): activations keep their scale
            param.normal_(0.0, param.shape[-1] ** -0.5)
    w13 = torch.stack([e.gate_up_proj.weight for e in block.experts])
    w2 = torch.stack([e.down_proj.weight for e in block.experts])
    if device.type == "cuda":
        from llmlab.models.moe import check_fused

        if not block.stack_experts():
            raise SystemExit("the fused MoE kernel does not cover this layer")
        reason = check_fused(block)
        if reason is not None:
            raise SystemExit(f"the fused MoE kernel failed its check: {reason}")
    else:
        _prepack(block)
        _prepack(dense)
    return block, (w13, w2), dense


def _prepack(module: nn.Module) -> None:
    """Every ``nn.Linear`` of ``module`` in oneDNN's layout, as the CPU engine's
    ``prepack_linears`` leaves a model's (that function also packs a model's LM head)."""
    from llmlab.kernels.cpu_linear import PackedLinear, onednn_unavailable_reason

    if onednn_unavailable_reason() is not None:
        return  # the engine runs F.linear then too
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear.from_linear(child))


def loop_moe(block, w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The naive baseline: the block's router, then each expert's tokens found with
    ``nonzero`` and run through two ``torch.mm`` on its plain weights."""
    weights, chosen = block.route(x)
    inner = w2.shape[-1]
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        tokens, slots = (chosen == expert).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = torch.mm(x[tokens], w13[expert].t())
        hidden = F.silu(gate_up[:, :inner]) * gate_up[:, inner:]
        y = torch.mm(hidden, w2[expert].t()) * weights[tokens, slots, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timing_s(fn, calls: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / calls


def measure(fns: dict, repeats: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each of ``fns``, ``repeats`` times, taking turns."""
    calls = {}
    for name, fn in fns.items():
        fn()  # warm up (and compile, on CUDA)
        calls[name] = max(1, int(TARGET_S / max(_timing_s(fn, 1, device), 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            times[name].append(_timing_s(fns[name], calls[name], device))
    return times


def run_shape(args, shape: str, device: torch.device) -> bool:
    """Print one shape's table; False when a row's numerics failed."""
    block, (w13, w2), dense = build_layers(shape, args.torch_dtype, device, args.seed)
    experts, top_k = w13.shape[0], block.top_k
    hidden, inner = w13.shape[2], w2.shape[2]
    path = "fused Triton" if block.stacked is not None else "grouped, oneDNN"
    print(f"\n== {shape}: hidden {hidden}, {experts} experts of {inner}, top-{top_k} "
          f"(dense: inner {top_k * inner}); llmlab = {path}")
    print(f"{'tokens':>6s} | {'llmlab ms':>10s} {'spread':>6s} | {'loop ms':>10s} {'spread':>6s}"
          f" | {'dense ms':>10s} {'spread':>6s} | {'llmlab/loop':>11s} {'llmlab/dense':>12s}"
          f" | rel err")
    tol = 1e-4 if args.torch_dtype == torch.float32 else 5e-2
    ok = True
    gen = torch.Generator().manual_seed(args.seed + 1)
    for tokens in args.tokens:
        x = torch.randn(tokens, hidden, generator=gen).to(args.torch_dtype).to(device)
        with torch.inference_mode():
            fns = {"llmlab": lambda: block(x), "loop": lambda: loop_moe(block, w13, w2, x),
                   "dense": lambda: dense(x)}
            want = fns["loop"]().float()
            err = float((fns["llmlab"]().float() - want).abs().max() / want.abs().max())
            times = measure(fns, args.repeats, device)
        median = {name: statistics.median(ts) for name, ts in times.items()}
        spread = {name: (max(ts) - min(ts)) / median[name] for name, ts in times.items()}
        cells = " | ".join(f"{median[m] * 1e3:10.3f} {spread[m]:6.1%}" for m in METHODS)
        verdict = "" if err <= tol else "  FAIL"
        ok = ok and err <= tol
        print(f"{tokens:6d} | {cells} | {median['llmlab'] / median['loop']:11.2f} "
              f"{median['llmlab'] / median['dense']:12.2f} | {err:.1e}{verdict}")
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, device {args.device}, {args.dtype}, {args.threads} "
          f"threads, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other "
          f"processes skew timings); median of {args.repeats} repeats, spread = (max - min) "
          "/ median; ratios are times (< 1: llmlab faster)")
    ok = all([run_shape(args, shape, device) for shape in args.shapes])
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
