"""No adapter reaches another request. A slot holding inf, NaN or +-1e38 (written straight
into the slot tensors, past the load check) leaves every other row of the same batched
call bit for bit as it is without it: in the torch op, in the Triton kernels, and in the
engine, for a healthy adapter's request and a base-model one batched beside it. And the
load check refuses such adapters, naming the field."""

from __future__ import annotations

import itertools
import math
import random
import shutil

import numpy as np
import pytest
import torch

from llmlab import LLM, LoRARequest, SamplingParams
from llmlab.lora.bounds import MAX_UPDATE_RATIO, base_norms, update_norm
from llmlab.lora.slots import group_tokens
from llmlab.lora.targets import LoRATarget
from tests.lora.conftest import edit_config
from tests.lora.test_ops import DEVICE, QKV, case, torch_op

BROKEN_SLOT = 1


def _signs(t: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.where(torch.randn(t.shape, generator=gen) > 0, 1.0, -1.0).to(t)


# How the broken slot's A and B are spoiled; each reaches its own rows as inf or NaN.
BREAKS = {
    "A=inf": lambda a, b: a.fill_(math.inf),
    "A=nan": lambda a, b: a.fill_(math.nan),
    "A=+-1e38": lambda a, b: a.copy_(_signs(a) * 1e38),
    "B=inf": lambda a, b: b.fill_(math.inf),
    "B=nan-one": lambda a, b: b[0, 0].fill_(math.nan),
}
STEPS = {
    # pure decode, slots interleaved with a row without an adapter: rows gathered by slot
    "decode": ([1, 1, 1, 1, 1, 1], [0, 1, 2, 1, -1, 0]),
    # pure decode already in slot order: every run in place
    "decode-in-place": ([1, 1, 1, 1, 1], [0, 0, 1, 1, 2]),
    # prefill chunks (in place) beside short spans (gathered), the broken slot in both
    "mixed": ([20, 1, 3, 17, 1, 2, 16], [1, 0, -1, 2, 1, -1, 0]),
}


def _broken(a, b, break_name):
    a, b = a.clone(), b.clone()
    BREAKS[break_name](a[BROKEN_SLOT], b[BROKEN_SLOT])
    return a, b


def _check_rows(clean, got, y, token_slots):
    healthy = token_slots != BROKEN_SLOT
    assert torch.equal(got[healthy], clean[healthy])  # bit for bit
    base = token_slots < 0
    assert torch.equal(got[base], y[base])  # rows without an adapter are never touched
    # The broken slot did reach its own rows (else this test would prove nothing).
    assert not torch.isfinite(got[~healthy]).all() or (got[~healthy].abs() > 1e30).any()


@pytest.mark.parametrize("slices", [((0, 72),), QKV], ids=["one-slice", "qkv"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("break_name", list(BREAKS))
def test_a_broken_slot_leaves_other_rows_of_the_torch_op_bit_for_bit(break_name, step, slices):
    lens, entry_slots = STEPS[step]
    x, y, a, b, token_slots = case(lens, entry_slots, slices=slices)
    clean = torch_op(x, y.clone(), a, b, entry_slots, lens, slices)
    got = torch_op(x, y.clone(), *_broken(a, b, break_name), entry_slots, lens, slices)
    _check_rows(clean, got, y, token_slots)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("break_name", ["A=inf", "A=+-1e38", "B=nan-one"])
def test_a_broken_slot_leaves_other_rows_of_the_triton_kernels_bit_for_bit(break_name, step):
    pytest.importorskip("triton")
    from llmlab.lora.triton_ops import sgmv_lora

    lens, entry_slots = STEPS[step]
    x, y, a, b, token_slots = case(lens, entry_slots, rank=16, slices=QKV)
    grouped = group_tokens(np.asarray(entry_slots), np.asarray(lens), DEVICE, kernel="triton")

    def run(a, b):
        return sgmv_lora(x, y.clone(), a, b, QKV, grouped.perm, grouped.seg_starts,
                         grouped.seg_slots, grouped.max_segment_len, grouped.num_lora_tokens)

    _check_rows(run(a, b), run(*_broken(a, b, break_name)), y, token_slots.to(DEVICE))


def _greedy(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_broken_adapter_in_the_batch_changes_no_other_request(tiny_llama, adapter_factory):
    """A healthy adapter's requests and base-model ones, batched beside a broken adapter's
    (weights of +-1e38 and NaN put into its host copy after the load check passed it),
    get exactly their solo greedy tokens: in the mixed prefill step (prefill chunks in
    place, short prompts gathered) and in every decode step after it."""
    llm = LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8,
              enable_prefix_caching=False)
    healthy = LoRARequest("healthy", 1, adapter_factory(tiny_llama, "iso-healthy", seed=41))
    broken = LoRARequest("broken", 2, adapter_factory(tiny_llama, "iso-broken", seed=42))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (20, 5, 18, 3, 9, 4)]
    loras = [healthy, None, broken, healthy, None, broken]
    victims = [i for i, lora in enumerate(loras) if lora is not broken]
    solo = {i: _greedy(llm, [prompts[i]], loras[i])[0] for i in victims}

    adapter = llm.llm_engine.lora.get(broken)  # loaded and checked: healthy on disk
    for module_slices in adapter.weights.values():
        for a, b in filter(None, module_slices):
            a.copy_(_signs(a) * 1e38)
            b[0, 0] = math.nan
    mixed = _greedy(llm, prompts, loras)
    slots = llm.llm_engine.executor.plugin("lora")
    module = next(iter(slots.modules.values()))
    assert module.lora_a[slots.slots[broken.lora_int_id]].abs().max() == 1e38  # it ran
    assert {i: mixed[i] for i in victims} == solo
    # Its freed KV blocks (NaN) serve other requests next: still their own tokens.
    assert {i: _greedy(llm, [prompts[i]], loras[i])[0] for i in victims} == solo


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)


@pytest.fixture
def adapter_copy(tiny_llama, adapter_factory, tmp_path):
    return str(shutil.copytree(adapter_factory(tiny_llama, "iso-check", seed=43),
                               tmp_path / "copy"))


def _edit_weights(adapter_dir: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = f"{adapter_dir}/adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


_IDS = itertools.count(100)  # one lora_int_id per load: an id names one path


def _refused(llm: LLM, path: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.llm_engine.lora.get(LoRARequest("x", next(_IDS), path))


@pytest.mark.parametrize("alpha", [1e308, 10**400, -1e300], ids=["1e308", "10^400", "-1e300"])
def test_an_absurd_lora_alpha_is_refused_naming_it(llm, adapter_copy, alpha):
    edit_config(adapter_copy, lora_alpha=alpha)
    _refused(llm, adapter_copy, r"lora_alpha=.*MAX_LORA_SCALE=10000")


def test_a_huge_update_is_refused_naming_the_module_and_the_bound(llm, adapter_copy):
    def a_1e38(tensors):
        key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
        tensors[key] = _signs(tensors[key]) * 1e38

    _edit_weights(adapter_copy, a_1e38)
    _refused(llm, adapter_copy, r"'layers\.1\.self_attn\.v_proj'.*lora_B @ lora_A.*Frobenius "
             r"norm [0-9.]+e\+3[89].*MAX_UPDATE_RATIO=100 x the base weight's norm")


def test_an_update_past_the_bound_is_refused_and_one_inside_it_loads(llm, adapter_copy):
    """The bound is MAX_UPDATE_RATIO times the measured base norm: an update scaled to 0.9
    of it loads, one scaled to 1.1 of it does not."""
    store = llm.llm_engine.lora
    key = "base_model.model.model.layers.0.mlp.down_proj"
    bound = MAX_UPDATE_RATIO * store.base_norms["layers.0.mlp.down_proj"][0]
    scale = 16 / 8  # the adapter's lora_alpha / r

    def to(fraction):
        def edit(tensors):
            a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
            tensors[f"{key}.lora_B.weight"] = b * (fraction * bound / update_norm(a, b, scale))
        return edit

    _edit_weights(adapter_copy, to(0.9))
    store.get(LoRARequest("inside", next(_IDS), adapter_copy))
    _edit_weights(adapter_copy, to(1.1 / 0.9))
    _refused(llm, adapter_copy, r"'layers\.0\.mlp\.down_proj'.*MAX_UPDATE_RATIO")


def test_a_factor_that_overflows_the_model_dtype_is_refused(llm, adapter_copy):
    """lora_B of 6e4 times the scale 2 is beyond float16 even when A is small enough for
    the update to be harmless; the stored factors must be finite in the model's dtype."""

    def edit(tensors):
        key = "base_model.model.model.layers.0.self_attn.o_proj"
        tensors[f"{key}.lora_A.weight"] = torch.full_like(tensors[f"{key}.lora_A.weight"], 1e-9)
        tensors[f"{key}.lora_B.weight"] = torch.full_like(tensors[f"{key}.lora_B.weight"], 6e4)

    _edit_weights(adapter_copy, edit)
    store = llm.llm_engine.lora
    store.dtype = torch.float16  # how a float16 engine stores adapters
    try:
        with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.o_proj'.*overflows.*float16"):
            store.get(LoRARequest("half", next(_IDS), adapter_copy))
    finally:
        store.dtype = torch.float32


def test_the_update_norm_is_exact_and_cannot_overflow():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(8, 40, generator=gen) - 0.5, torch.rand(72, 8, generator=gen) - 0.5
    dense = float((3.0 * b.double() @ a.double()).norm())
    assert update_norm(a, b, 3.0) == pytest.approx(dense, rel=1e-12)
    # Factors of 1e38, beyond float32 once multiplied: exact all the same.
    a_big, b_big = a * 1e38, b * 1e38
    dense = float((3.0 * b_big.double() @ a_big.double()).norm())
    assert update_norm(a_big, b_big, 3.0) == pytest.approx(dense, rel=1e-12)
    assert update_norm(a_big, b_big, 1e300) == math.inf  # beyond float64: inf, not NaN
    assert update_norm(torch.zeros(8, 40), b, 1e4) == 0.0


def test_base_norms_measure_each_slice_through_forward():
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(96, 64, generator=gen))
        linear.weight[64:] *= 10  # the third slice is ten times the others
        linear.bias.fill_(1e3)  # taken off
    target = LoRATarget("m", 64, (("q_proj", 0, 32), ("k_proj", 32, 32), ("v_proj", 64, 32)))
    got = base_norms(linear, target, torch.float32, torch.device("cpu"))
    want = [float(linear.weight[i : i + 32].norm()) for i in (0, 32, 64)]
    assert got == pytest.approx(want, rel=0.1)
