"""Every Triton kernel compiles ahead of time for sm_90 (H100), without a GPU.

The interpreter accepts things the GPU compiler rejects (shapes, dtypes of ``tl.dot``
operands, scalar/tensor mixes), so CI also lowers each kernel through Triton's CUDA
backend to a cubin (``triton.compile`` with a CUDA ``GPUTarget``). This runs in a child
process: the test session imports triton in interpreter mode, whose library functions
cannot be compiled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import subprocess_env

SCRIPT = textwrap.dedent(
    """
    import json, sys
    from llmlab.kernels.triton_kernels import compile_for_target

    def attention_sig(dt):
        ptrs = ["q_ptr", "out_ptr", "cache_ptr"]
        ints = ["block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "prog_seq_ptr",
                "prog_q_ptr"]
        sig = {p: "*" + dt for p in ptrs}
        sig.update({p: "*i32" for p in ints})
        sig.update({"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32"})
        for name in ["sliding_window", "stride_q_tok", "stride_q_head", "stride_o_tok",
                     "stride_o_head", "stride_c_kv", "stride_c_head", "stride_c_slot",
                     "stride_bt"]:
            sig[name] = "i64" if name.startswith("stride_c") else "i32"
        return sig

    done = []
    for dt in ("bf16", "fp16", "fp32"):
        sig = {"k_ptr": "*" + dt, "v_ptr": "*" + dt, "cache_ptr": "*" + dt, "slot_ptr": "*i64"}
        sig.update({n: "i64" if "_c_" in n else "i32" for n in [
            "stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head",
            "stride_c_kv", "stride_c_head", "stride_c_slot"]})
        const = dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, D_PAD=128)
        sig.update({k: "constexpr" for k in const})
        compile_for_target("write_kv", sig, const)
        done.append(("write_kv", dt))
        # (group, block_q, head_dim, splits, window, f32 products): decode and prefill,
        # GQA 4 (32/8) and 2 (16/8), split-KV, sliding window, both product paths.
        for group, block_q, head_dim, splits, window, f32 in [
            (4, 1, 128, 1, False, dt == "fp32"),
            (4, 1, 128, 8, False, dt == "fp32"),
            (2, 32, 128, 1, True, dt == "fp32"),
            (4, 16, 64, 1, False, True),
            (1, 64, 128, 16, True, dt == "fp32"),
        ]:
            gp = 1 << (group - 1).bit_length()
            const = dict(NUM_HEADS=8 * group, GROUP=group, GROUP_PAD=gp, BLOCK_Q=block_q,
                         BLOCK_M=max(16, block_q * gp), HEAD_DIM=head_dim, D_PAD=head_dim,
                         BLOCK_SIZE=16, TILE_N=32, NUM_SPLITS=splits, USE_WINDOW=window,
                         DOT_F32=f32)
            sig = attention_sig(dt)
            sig.update({k: "constexpr" for k in const})
            compile_for_target("paged_attention", sig, const)
            done.append(("paged_attention", dt, group, block_q, splits, window, f32))
            if splits > 1:
                const = dict(NUM_HEADS=8 * group, BLOCK_Q=block_q, HEAD_DIM=head_dim,
                             D_PAD=head_dim, NUM_SPLITS=splits)
                sig = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*" + dt,
                       "prog_seq_ptr": "*i32", "prog_q_ptr": "*i32",
                       "query_start_ptr": "*i32", "stride_o_tok": "i32",
                       "stride_o_head": "i32"}
                sig.update({k: "constexpr" for k in const})
                compile_for_target("reduce_splits", sig, const)
                done.append(("reduce_splits", dt, splits))
    from llmlab.kernels.triton_fused import KERNELS as FUSED
    for dt in ("bf16", "fp16", "fp32"):
        for has_res in (True, False):
            sig = {"x_ptr": "*" + dt, "res_ptr": "*" + dt, "w_ptr": "*" + dt,
                   "out_ptr": "*" + dt, "stride_x": "i32", "stride_res": "i32",
                   "stride_out": "i32", "dim": "i32", "eps": "fp32",
                   "HAS_RES": "constexpr", "BLOCK": "constexpr"}
            compile_for_target(FUSED["add_rms_norm"], sig, dict(HAS_RES=has_res, BLOCK=1024))
            done.append(("add_rms_norm", dt, has_res))
        sig = {"gate_up_ptr": "*" + dt, "out_ptr": "*" + dt, "stride_in": "i32",
               "stride_out": "i32", "half": "i32", "BLOCK": "constexpr"}
        compile_for_target(FUSED["silu_and_mul"], sig, dict(BLOCK=1024))
        done.append(("silu_and_mul", dt))
        sig = {"x_ptr": "*" + dt, "cos_ptr": "*" + dt, "sin_ptr": "*" + dt,
               "stride_tok": "i32", "stride_head": "i32", "rot": "i32",
               "HALF_BLOCK": "constexpr"}
        compile_for_target(FUSED["rotary"], sig, dict(HALF_BLOCK=64))
        done.append(("rotary", dt))
    from llmlab.kernels.triton_moe import KERNELS as MOE
    for dt in ("bf16", "fp16", "fp32"):
        for block_m in (16, 64):  # decode-sized and prefill-sized blocks of sorted pairs
            tiles = dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32 if dt == "fp32" else 64,
                         DOT_F32=dt == "fp32")
            sig = {"x_ptr": "*" + dt, "w_ptr": "*" + dt, "h_ptr": "*" + dt,
                   "pair_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                   "num_pairs": "i32", "hidden": "i32", "inner": "i32", "stride_x": "i32",
                   "stride_we": "i32", "stride_wn": "i32", "stride_h": "i32"}
            sig.update({k: "constexpr" for k in ("TOP_K", *tiles)})
            compile_for_target(MOE["moe_gate_up"], sig, dict(TOP_K=2, **tiles))
            done.append(("moe_gate_up", dt, block_m))
            sig = {"h_ptr": "*" + dt, "w_ptr": "*" + dt, "out_ptr": "*" + dt,
                   "pair_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
                   # Routing weights: float32 (Mixtral's) or the model dtype (the others').
                   "route_w_ptr": "*fp32" if block_m == 64 else "*" + dt,
                   "num_pairs": "i32", "hidden": "i32",
                   "inner": "i32", "stride_h": "i32", "stride_we": "i32",
                   "stride_wn": "i32", "stride_out": "i32"}
            sig.update({k: "constexpr" for k in tiles})
            compile_for_target(MOE["moe_down"], sig, tiles)
            done.append(("moe_down", dt, block_m))
    from llmlab.kernels.triton_int4 import KERNELS as INT4
    for dt in ("bf16", "fp16", "fp32"):
        # Decode (split-K: float32 partial sums) and prefill tiles of the W4A16 GEMM.
        for out, bm, bn, bk in (("fp32", 16, 64, 64), (dt, 128, 128, 32)):
            sig = {"x_ptr": "*" + dt, "w_ptr": "*i32", "s_ptr": "*fp32", "z_ptr": "*u8",
                   "y_ptr": "*" + out, "M": "i32", "N": "i32", "K": "i32",
                   "stride_xm": "i32", "stride_ym": "i32", "stride_ys": "i32",
                   "group_size": "i32", "k_per_split": "i32"}
            const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dt == "fp32")
            sig.update({k: "constexpr" for k in const})
            compile_for_target(INT4["w4a16"], sig, const)
            done.append(("w4a16", dt, bm))
    print(json.dumps(done))
    """
)


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = subprocess_env(drop=("TRITON_INTERPRET",))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences triton 3.9's notice
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert {c[0] for c in compiled} == {"write_kv", "paged_attention", "reduce_splits",
                                        "add_rms_norm", "silu_and_mul", "rotary",
                                        "moe_gate_up", "moe_down", "w4a16"}
    assert len(compiled) == 3 * (1 + 5 + 2) + 3 * (2 + 1 + 1) + 3 * 2 * 2 + 3 * 2
