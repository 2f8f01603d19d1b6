"""Mixture-of-experts members of the Llama family: Mixtral, Qwen3-MoE and OLMoE.

The attention is the family's. In the layers the config names, the gated MLP gives way to
a sparse block: a router (a bias-free linear, one logit per expert) scores each token, the
softmax of those logits (in float32) picks the token's ``top_k`` experts, and the token's
output is their gated MLPs weighted by the picked probabilities, renormalised over the
``top_k`` where the checkpoint says so (Mixtral always, Qwen3-MoE and OLMoE with
``norm_topk_prob``): as transformers computes it, Mixtral weighting in float32, the others
in the activations' dtype. One difference in 16-bit: a token's ``top_k`` weighted outputs
are summed in float32 and rounded once (transformers adds them one at a time in the
activations' dtype); in float32 the results are the same.

Each expert is a :class:`~llmlab.models.llama.GatedMLP` (gate and up fused at load time,
split like the dense MLP under tensor parallelism, the experts' sum reduced once). Two ways
to run them:

* **Grouped** (CPU, quantized experts, anything the kernel does not cover): each expert
  that received tokens runs once, on those tokens gathered, through its own linears
  (oneDNN-prepacked on CPU like the dense models'; the engine's ``prepack_linears`` packs
  every ``nn.Linear``, the experts' included). Which experts got tokens is read on the host.
* **Fused** (CUDA): after loading, :meth:`_MoEMixin.stack_experts` moves each layer's
  expert weights into two stacked tensors (``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``;
  each expert's parameters become views into them, so there is one copy) and the layer
  runs :func:`llmlab.kernels.triton_moe.fused_moe`: sorted pairs, two grouped GEMMs, no
  host read.
"""

from __future__ import annotations

import logging
import re

import attrs
import torch
from torch import nn

from llmlab.distributed.parallel_state import TensorParallel
from llmlab.kernels import fused
from llmlab.models.layers import config_value
from llmlab.models.llama import (
    GatedMLP,
    LlamaFamilySpec,
    LlamaForCausalLM,
    Qwen3ForCausalLM,
    _base_spec,
)
from llmlab.models.weights import WeightTarget

logger = logging.getLogger(__name__)


@attrs.frozen
class MoESpec:
    """A checkpoint's experts: how many, how many per token, each one's inner width, whether
    the picked probabilities are renormalised and weigh in float32, and per layer whether
    it is sparse (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize: bool
    float32_weights: bool
    sparse_layers: tuple[bool, ...]

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and the number of "
                f"experts ({self.num_experts})"
            )


@attrs.frozen
class StackedExperts:
    """One layer's expert weights as the fused kernel reads them: ``w13`` ``[E, 2I, H]``
    (each expert's ``gate_up_proj`` weight) and ``w2`` ``[E, H, I]`` (its ``down_proj``
    weight). The experts' own parameters are views into these."""

    w13: torch.Tensor
    w2: torch.Tensor


class SparseMoeBlock(nn.Module):
    """The router and the experts of one layer (see the module docstring)."""

    def __init__(self, spec: LlamaFamilySpec, moe: MoESpec, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = moe.top_k
        self.normalize = moe.normalize
        self.float32_weights = moe.float32_weights
        self.num_experts = moe.num_experts
        # Replicated: every rank routes every token the same way.
        self.gate = nn.Linear(spec.hidden_size, moe.num_experts, bias=False)
        expert = attrs.evolve(spec, intermediate_size=moe.intermediate_size, mlp_bias=False)
        # The experts this rank holds: all of them, each split over the ranks (tensor
        # parallelism), or a run of whole ones (expert parallelism); either way the ranks'
        # partial sums add up in forward's all-reduce.
        within = tp
        self.expert_range = range(moe.num_experts)
        if tp.is_parallel and tp.expert_parallel:
            self.expert_range, within = tp.expert_range(moe.num_experts), TensorParallel()
        self.experts = nn.ModuleList(GatedMLP(expert, within) for _ in self.expert_range)
        # Set by stack_experts: the experts then run through the fused kernel.
        self.stacked: StackedExperts | None = None
        # Set only while a step's forward runs with record_expert_load on: this layer's
        # per-expert token counts for the step (llmlab.models.expert_load). None: no work.
        self.count_into: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)``, each ``[tokens, top_k]``: the picked experts and what
        their outputs weigh. Adds the picks to ``count_into`` when it is set (expert
        load recording); called exactly once per forward of the block."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.count_into is not None:
            # bincount(chosen) added on the device: index_add_, since CUDA's bincount
            # reads the largest id back to size its output (a host sync per layer).
            flat = chosen.reshape(-1)
            self.count_into.index_add_(0, flat, torch.ones_like(flat))
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), chosen

    def forward(self, x: torch.Tensor, fuse: bool = False) -> torch.Tensor:
        weights, chosen = self.route(x)
        if self.stacked is not None:
            out = self.run_fused(x, weights, chosen)
        else:
            out = self.run_grouped(x, weights, chosen, fuse)
        return self.tp.all_reduce(out)

    def run_grouped(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                    fuse: bool = False) -> torch.Tensor:
        """This rank's experts' weighted sum, each expert that got tokens run once on its
        tokens gathered (before the tensor-parallel reduction)."""
        # Token-expert pairs sorted by expert: one gather, then each expert runs once on a
        # contiguous slice; one weighting and one scatter-add at the end, so per expert only
        # its own matmuls and activation run (small ops dominate at decode sizes).
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        held = self.expert_range
        if len(held) != self.num_experts:  # expert parallel: this rank's run of the pairs
            first = sum(counts[:held.start])
            counts = counts[held.start:held.stop]
            order = order[first:first + sum(counts)]
            if not len(order):
                return torch.zeros_like(x)
        tokens = order // self.top_k
        gathered = x[tokens]
        outputs = []
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if not count:
                continue
            gate_up = expert.gate_up_proj(gathered[start:start + count])
            start += count
            if fuse and expert.silu:
                hidden = fused.silu_and_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                hidden = expert.act(gate) * up
            outputs.append(expert.down_proj(hidden))
        # Float32 routing weights (Mixtral's) weigh in float32, rounded once after.
        y = torch.cat(outputs) * weights.reshape(-1)[order, None]
        # index_add_ adds each token's outputs in expert order, as the old loop did.
        return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))

    def run_fused(self, x: torch.Tensor, weights: torch.Tensor,
                  chosen: torch.Tensor) -> torch.Tensor:
        """:meth:`run_grouped` through the fused kernel on the stacked weights (nothing is
        read on the host)."""
        from llmlab.kernels.triton_moe import fused_moe

        return fused_moe(x, self.stacked.w13, self.stacked.w2, weights, chosen,
                         first_expert=self.expert_range.start)

    def fusable(self) -> bool:
        """Whether the fused kernel covers these experts: plain bias-free ``nn.Linear``
        projections (not quantized, not prepacked) with SiLU, in one dtype and on one
        device the kernel takes (CUDA, or any under Triton's interpreter)."""
        try:
            from llmlab.kernels import triton_moe
        except ImportError:  # no triton for this platform
            return False
        linears = [m for e in self.experts for m in (e.gate_up_proj, e.down_proj)]
        if not (all(e.silu for e in self.experts)
                and all(type(m) is nn.Linear and m.bias is None for m in linears)):
            return False
        first = linears[0].weight
        return triton_moe.supports(first) and all(
            m.weight.dtype == first.dtype and m.weight.device == first.device for m in linears
        )

    def stack_experts(self) -> bool:
        """Move the experts' weights into one :class:`StackedExperts` and run the fused
        kernel from now on; False (nothing changed) where :meth:`fusable` says no.

        Each expert's weight is copied into its slice and its parameter replaced by a view
        of that slice, so the old tensor is freed: one copy of the weights at the end, one
        layer's experts more at the peak. Call once the weights are loaded, on the model's
        final device."""
        if self.stacked is not None:
            return True
        if not self.fusable():
            return False
        gate_up = self.experts[0].gate_up_proj.weight
        down = self.experts[0].down_proj.weight
        count = len(self.experts)
        w13 = torch.empty((count, *gate_up.shape), dtype=gate_up.dtype, device=gate_up.device)
        w2 = torch.empty((count, *down.shape), dtype=down.dtype, device=down.device)
        with torch.no_grad():
            for index, expert in enumerate(self.experts):
                for linear, stacked in ((expert.gate_up_proj, w13), (expert.down_proj, w2)):
                    stacked[index].copy_(linear.weight)
                    linear.weight = nn.Parameter(stacked[index], requires_grad=False)
        self.stacked = StackedExperts(w13, w2)
        return True


def check_fused(block: SparseMoeBlock) -> str | None:
    """Run ``block``'s fused path against its grouped path on random tokens and routing
    (not through :meth:`SparseMoeBlock.route`, whose observers must not see them), at a
    decode-sized and a prefill-sized count so both tile shapes compile: None when they
    agree to within the dtype's rounding, else why not."""
    w13 = block.stacked.w13
    num_experts, hidden = block.num_experts, w13.shape[2]  # routing over all experts
    tol = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}[w13.dtype]
    gen = torch.Generator().manual_seed(0)
    try:
        for tokens in (3, max(4, -(-32 * num_experts // block.top_k))):
            x = torch.randn(tokens, hidden, generator=gen).to(w13.dtype).to(w13.device)
            probs = torch.rand(tokens, num_experts, generator=gen).softmax(-1)
            weights, chosen = (t.to(w13.device) for t in probs.topk(block.top_k, dim=-1))
            if not block.float32_weights:
                weights = weights.to(w13.dtype)
            want = block.run_grouped(x, weights, chosen).float()
            got = block.run_fused(x, weights, chosen).float()
            err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if not err <= tol:  # NaN fails too
                return f"{tokens} tokens: differs from the grouped path by {err:.2e} (> {tol:g})"
    except Exception as err:  # noqa: BLE001 - a compile or launch failure is the reason
        return f"{type(err).__name__}: {err}"
    return None


_EXPERT = re.compile(r"^experts\.(\d+)\.(\w+)$")


class _MoEMixin:
    """What both MoE classes share: the sparse layers, and checkpoint names of the experts
    mapped onto :class:`GatedMLP`'s fused parameters. Subclasses say where the block lives
    in the checkpoint (``_BLOCK``) and what each expert's projections are called
    (``_PROJECTIONS``: gate, up, down)."""

    _BLOCK = "mlp"
    _PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    # The grouped path reads which experts run, and on how many tokens, on the host each
    # step: a captured CUDA graph would replay one step's routing. The fused path reads
    # nothing on the host and its buffers are sized by the token count alone, so it could be
    # captured, but capture is unverified on a GPU: decode runs eagerly either way.
    cuda_graphs = False

    def __init__(self, hf_config: object, tp: TensorParallel | None = None) -> None:
        super().__init__(hf_config, tp)
        self.moe = moe = self.moe_from_config(hf_config)
        if len(moe.sparse_layers) != self.spec.num_layers:
            raise ValueError(
                f"{len(moe.sparse_layers)} layer flags for {self.spec.num_layers} layers"
            )
        for layer, sparse in zip(self.layers, moe.sparse_layers, strict=True):
            if sparse:
                layer.mlp = SparseMoeBlock(self.spec, moe, self.tp)

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        raise NotImplementedError

    def check_checkpoint(self, where: str, names: set[str]) -> None:
        """Refuse, before any weight is read, a checkpoint whose tensor ``names`` (from
        ``where``) lack an expert or a router of a sparse layer the config declares. Any
        tensor under a projection's name counts (``.weight``, or a quantized format's
        ``.qweight`` / ``.weight_packed`` ...)."""
        present = set()
        for name in names:
            module = name.rsplit(".", 1)[0]
            start = module.find("layers.")
            if start >= 0 and (start == 0 or module[start - 1] == "."):
                present.add(module[start:])
        missing = []
        for i, sparse in enumerate(self.moe.sparse_layers):
            if not sparse:
                continue
            block = f"layers.{i}.{self._BLOCK}"
            wanted = [f"{block}.gate"] + [
                f"{block}.experts.{e}.{p}"
                for e in range(self.moe.num_experts) for p in self._PROJECTIONS
            ]
            missing += [m for m in wanted if m not in present]
        if missing:
            more = len(missing) - 6
            shown = ", ".join(missing[:6]) + (f" and {more} more" if more > 0 else "")
            raise ValueError(
                f"{where}: the checkpoint has no tensors for {shown}; its config.json "
                f"declares {self.moe.num_experts} experts in each sparse layer (is a shard "
                "missing, or the config for another model?)"
            )

    def fused_sizes(self) -> dict[str, int]:
        sizes = super().fused_sizes()
        whole = self.tp.expert_parallel  # experts kept whole on each rank
        sizes["inner"] = self.moe.intermediate_size // (1 if whole else self.tp.size)
        return sizes

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The sparse blocks, first layer first."""
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def stack_experts(self) -> int:
        """Switch every sparse block the fused kernel covers to it
        (:meth:`SparseMoeBlock.stack_experts`), after checking it once against the grouped
        path on the first block's weights (which also compiles the kernels): on a mismatch
        or a compile error, a warning and the grouped path everywhere (a kernel the GPU's
        compiler gets wrong costs speed, not tokens). Returns how many blocks run fused.
        The engine builder calls it on CUDA once the weights are loaded."""
        stacked = []
        for block in self.moe_blocks():
            if block.stack_experts():
                stacked.append(block)
                if block.stacked.w13.is_cuda:
                    # Hand the experts' old tensors back, so the next layer's stack can
                    # take their memory: the peak stays one layer's experts above the model.
                    torch.cuda.empty_cache()
        reason = check_fused(stacked[0]) if stacked else None
        if reason is not None:
            logger.warning("fused MoE: the Triton kernel failed its check at this model's "
                           "sizes, so the experts run one by one: %s", reason)
            for block in stacked:  # the experts' weights stay views: still one copy
                block.stacked = None
            return 0
        return len(stacked)

    def _layer_target(self, layer: str, module: str, leaf: str,
                      intermediate_size: int | None = None) -> WeightTarget | None:
        prefix = f"{self._BLOCK}."
        if module.startswith(prefix):
            inner = module[len(prefix):]
            expert = _EXPERT.match(inner)
            if expert is not None:
                index, projection = expert.groups()
                names = dict(zip(self._PROJECTIONS, ("gate_proj", "up_proj", "down_proj"),
                                 strict=True))
                if projection not in names:
                    return None
                if self.tp.is_parallel and self.tp.expert_parallel:
                    return self._whole_expert_target(layer, int(index), names[projection], leaf)
                # An expert is a GatedMLP of the expert width: the dense MLP's mapping,
                # under the expert's name.
                dense = f"mlp.{names[projection]}"
                target = super()._layer_target(
                    layer, dense, leaf, self.moe.intermediate_size,
                ) or WeightTarget(f"{layer}{dense}.{leaf}")
                param = target.param.replace(f"{layer}mlp.", f"{layer}mlp.experts.{index}.", 1)
                return attrs.evolve(target, param=param)
            if inner == "gate":
                return WeightTarget(f"{layer}mlp.gate.{leaf}")
        return super()._layer_target(layer, module, leaf, intermediate_size)


    def _whole_expert_target(self, layer: str, index: int, projection: str,
                             leaf: str) -> WeightTarget | list:
        """Expert parallelism: an expert this rank holds is read whole into its local slot
        (gate rows, then up rows, of ``gate_up_proj``); another rank's is not read (no
        targets)."""
        held = self.tp.expert_range(self.moe.num_experts)
        if index not in held:
            return []
        expert = f"{layer}mlp.experts.{index - held.start}"
        if projection == "down_proj":
            return WeightTarget(f"{expert}.down_proj.{leaf}")
        offset = self.moe.intermediate_size if projection == "up_proj" else 0
        return WeightTarget(f"{expert}.gate_up_proj.{leaf}", row_offset=offset)


class MixtralForCausalLM(_MoEMixin, LlamaForCausalLM):
    """Mixtral 8x7B / 8x22B (Jiang et al., 2024): every layer sparse, the picked
    probabilities always renormalised; experts ``w1`` (gate), ``w3`` (up), ``w2`` (down)
    under ``block_sparse_moe``; Mistral's optional sliding window."""

    _BLOCK = "block_sparse_moe"
    _PROJECTIONS = ("w1", "w3", "w2")

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        window = config_value(hf_config, "sliding_window")
        return _base_spec(hf_config, layer_windows=(window,) * hf_config.num_hidden_layers)

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        return MoESpec(
            num_experts=hf_config.num_local_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            normalize=True,
            float32_weights=True,
            sparse_layers=(True,) * hf_config.num_hidden_layers,
        )


class Qwen3MoeForCausalLM(_MoEMixin, Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen team, 2025): Qwen3's attention; sparse layers every
    ``decoder_sparse_step`` layers except ``mlp_only_layers`` (those keep a dense MLP of
    ``intermediate_size``), experts of ``moe_intermediate_size``; the picked probabilities
    renormalised when ``norm_topk_prob``."""

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        num_layers = hf_config.num_hidden_layers
        num_experts = hf_config.num_experts
        step = config_value(hf_config, "decoder_sparse_step", default=1) or 1
        dense = set(config_value(hf_config, "mlp_only_layers", default=()) or ())
        return MoESpec(
            num_experts=num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.moe_intermediate_size,
            normalize=bool(config_value(hf_config, "norm_topk_prob", default=False)),
            float32_weights=False,
            sparse_layers=tuple(
                i not in dense and num_experts > 0 and (i + 1) % step == 0
                for i in range(num_layers)
            ),
        )


class OlmoeForCausalLM(_MoEMixin, LlamaForCausalLM):
    """OLMoE (Muennighoff et al., 2024): every layer sparse; q and k each normalised over
    all heads at once, q, k and v optionally clamped (``clip_qkv``), the picked
    probabilities renormalised when ``norm_topk_prob``."""

    @classmethod
    def spec_from_config(cls, hf_config: object) -> LlamaFamilySpec:
        return _base_spec(hf_config, qk_norm_full=True,
                          clip_qkv=config_value(hf_config, "clip_qkv", default=None))

    @classmethod
    def moe_from_config(cls, hf_config: object) -> MoESpec:
        return MoESpec(
            num_experts=hf_config.num_experts,
            top_k=hf_config.num_experts_per_tok,
            intermediate_size=hf_config.intermediate_size,
            normalize=bool(config_value(hf_config, "norm_topk_prob", default=False)),
            float32_weights=False,
            sparse_layers=(True,) * hf_config.num_hidden_layers,
        )
