"""Paged attention kernels: decode bandwidth and prefill FLOP rate, side by side with SDPA flash.

Everything is measured in one process, against baselines measured in the same run:

* **Copy bandwidth**: a device-to-device ``copy_`` of ``--copy-gib`` GiB (default 1), timed
  with CUDA events, best of ``--reps``; bandwidth = 2 x bytes / time (each byte is read
  once and written once). This is the practical ceiling for a kernel that streams its
  inputs from memory, and decode attention is such a kernel.
* **Decode** (one new token per sequence): every sequence has ``ctx`` tokens of context,
  the new token's K/V already in the cache. The KV pool holds exactly the batch's blocks,
  handed out in a random permutation, so each sequence's blocks are scattered over the
  pool. llmlab is timed through ``TritonPagedAttention.attend_into``: the attention kernel
  plus the split-KV reduction when the backend chooses to split (the split count is
  reported). The metadata is built once, untimed: it is per-step host work shared by all
  layers. ``write_kv`` is not timed at all (it stores ``batch`` tokens, a negligible
  share of the bytes, and SDPA has no counterpart).
* **Prefill**: fresh prompts (query = the whole prompt, causal) and chunks after a cached
  context (query = the last ``new`` of ``cached + new`` tokens, causal, aligned to the
  bottom right as in chunked prefill). Reported as TFLOP/s of the attention matmuls:
  4 x head_dim x query heads per visible (query, key) pair; masked pairs are not counted.

The baseline is ``torch.nn.functional.scaled_dot_product_attention`` restricted to the
flash backend (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``), run on the *same K/V values*
gathered into contiguous ``[batch, kv_heads, ctx, head_dim]`` tensors; queries are the
same values viewed as ``[batch, heads, new, head_dim]``. Grouped-query attention goes
through ``enable_gqa=True``: torch's flash kernel reads the ``kv_heads`` heads directly
(no ``repeat_interleave``), so both sides read the same bytes. Fresh prompts use
``is_causal=True``; chunks use ``torch.nn.attention.bias.causal_lower_right``, which torch
sends to the flash kernel when it can run the shape (checked on CUDA with
``torch.backends.cuda.can_use_flash_attention``; the row says n/a otherwise).

Fairness and method:

* Bytes: decode bandwidth counts the useful bytes only, the same for both sides: K and V
  of every context plus q and the output. Block tables and split partials are llmlab's
  overhead and are not credited. ``%copy`` = achieved GB/s / copy GB/s.
* GPU time: CUDA events around one call, median of ``--reps`` after ``--warmup`` calls.
  Before each rep a 256 MiB buffer is zeroed, so the inputs are not served from L2 (50 MB
  on an H100: small configs would otherwise look faster than memory), and the GPU spins
  briefly (``torch.cuda._sleep``) so the host has queued the whole call before the start
  event fires: the time is the kernels' (and the gap between the two kernels of a split
  call), not Python's launch overhead.
* Host time (``host us``): the wall time to enqueue one llmlab call with the GPU idle.
  It is reported, not mixed into the bandwidth: the engine replays pure decode steps from
  CUDA graphs (``llmlab.engine.cuda_graphs``), which hides it there, but prefill, mixed
  and ``enforce_eager`` steps pay it per layer, and where it exceeds the GPU time such a
  step is launch-bound.
* Numerics, once per config: max |llmlab - SDPA| / max |SDPA| must stay below 2e-2 for
  16-bit inputs (both round the softmax weights to 16 bits for the PV product) or 1e-4 in
  float32. A fast but wrong kernel is marked FAIL and the script exits with status 1.
* Memory: a config needs its paged cache and the contiguous copy (2 x its KV bytes) plus
  small q/out tensors; it is skipped above ``--mem-cap-gib`` or 90% of free memory.

Targets (reported, not enforced): paged decode reaches >= 75% of the copy bandwidth at
context >= 2k with >= 64 sequences, and is no slower than SDPA flash on the contiguous copy.

On a machine without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``
is set below before triton is imported) and times come from ``time.perf_counter``;
``--smoke`` runs tiny float32 shapes (bfloat16 on CUDA, where flash needs 16-bit inputs) to
prove the script works end to end; its numbers mean nothing.

Run::

    python -m benchmarks.attention                        # full sweep (CUDA)
    python -m benchmarks.attention --quick --json attention.json
    python -m benchmarks.attention --only decode --batches 64 256 --contexts 2048 16384
    python -m benchmarks.attention --smoke                # CPU, Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys
import time

import torch

# Triton's interpreter must be chosen before triton is first imported (torch.nn.attention
# imports it), so this comes before the imports below.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from llmlab.attention.backend import AttentionInputs, token_slots
from llmlab.attention.triton_backend import (
    TritonPagedAttention,
    triton_unavailable_reason,
)

DECODE_BATCHES = (1, 4, 16, 64, 128, 256)
DECODE_CONTEXTS = (512, 2048, 8192, 16384)
HEADS = ((32, 8), (16, 8))
# (batch, cached tokens, new tokens): fresh prompts of 16k tokens per batch, then a
# 2048-token chunk after 6k cached and a 512-token chunk after 3.5k cached (prefix hit).
PREFILL_CASES = ((32, 0, 512), (8, 0, 2048), (2, 0, 8192), (4, 6144, 2048), (16, 3584, 512))

QUICK = {
    "batches": (1, 64, 256),
    "contexts": (2048, 16384),
    "heads": ((32, 8),),
    "prefill": ((8, 0, 2048), (4, 6144, 2048)),
}
SMOKE = {
    "batches": (2,),
    "contexts": (64,),
    "heads": ((4, 2),),
    "prefill": ((2, 0, 64), (2, 48, 16)),
    "head_dim": 64,
    "dtype": "float32",  # bfloat16 on CUDA (see parse_args)
    "reps": 2,
    "warmup": 1,
    "copy_gib": 1 / 64,
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FLUSH_BYTES = 256 << 20  # > 4x the L2 of an H100
SLEEP_CYCLES = 100_000  # ~50-60 us at H100 clocks: time for the host to queue a whole call
HOST_REPS = 10
GIB = 1 << 30


# ---------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@attrs.define(eq=False)
class Timer:
    """Median GPU time per call (CUDA events, cold L2) or wall time per call (CPU)."""

    device: torch.device
    reps: int
    warmup: int
    flush: torch.Tensor | None = None

    @classmethod
    def create(cls, device: torch.device, reps: int, warmup: int) -> Timer:
        flush = None
        if device.type == "cuda":
            flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)
        return cls(device, reps, warmup, flush)

    def call_us(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return statistics.median(times) * 1e6
        _sync(self.device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(self.reps)
        ]
        sleep = getattr(torch.cuda, "_sleep", None)
        for start, end in events:
            self.flush.zero_()  # evict the inputs from L2
            if sleep is not None:
                sleep(SLEEP_CYCLES)  # the host gets ahead: no launch gap inside the timing
            start.record()
            fn()
            end.record()
        _sync(self.device)
        return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3

    def host_us(self, fn) -> float | None:
        """Wall time to enqueue one call on an idle GPU (None on CPU: the call is the run)."""
        if self.device.type != "cuda":
            return None
        times = []
        for _ in range(HOST_REPS):
            _sync(self.device)
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        _sync(self.device)
        return statistics.median(times) * 1e6


def measure_copy_gbps(device: torch.device, nbytes: int, reps: int) -> float:
    """Best device-to-device copy rate, counting each byte read and written."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    best_s = float("inf")
    for _ in range(max(reps, 5)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - begin
        best_s = min(best_s, seconds)
    return 2 * nbytes / best_s / 1e9


# ---------------------------------------------------------------------------- batches


@attrs.frozen
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def label(self) -> str:
        return f"{self.heads}/{self.kv_heads}"

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def kv_bytes(self, batch: int, ctx: int) -> int:
        """K and V of ``batch`` contexts of ``ctx`` tokens."""
        return 2 * batch * ctx * self.kv_heads * self.head_dim * self.dtype.itemsize

    def q_bytes(self, tokens: int) -> int:
        return tokens * self.heads * self.head_dim * self.dtype.itemsize

    def needed_bytes(self, batch: int, ctx: int, new: int) -> int:
        """Paged cache + contiguous copy + q and two outputs (+ a float32 error check)."""
        blocks = batch * -(-ctx // self.block_size) * self.block_size
        return self.kv_bytes(1, blocks) + self.kv_bytes(batch, ctx) + 5 * self.q_bytes(batch * new)


@attrs.define(eq=False)
class Batch:
    """``batch`` sequences of ``ctx`` tokens whose last ``new`` tokens are the queries."""

    inputs: AttentionInputs
    cache: torch.Tensor  # paged: [2, kv_heads, num_blocks * block_size, head_dim]
    q: torch.Tensor  # [batch * new, heads, head_dim]
    k: torch.Tensor  # the same keys, contiguous: [batch, kv_heads, ctx, head_dim]
    v: torch.Tensor
    batch: int
    ctx: int
    new: int

    def sdpa_query(self) -> torch.Tensor:
        """The queries as SDPA takes them: ``[batch, heads, new, head_dim]`` (a view)."""
        _, heads, head_dim = self.q.shape
        return self.q.view(self.batch, self.new, heads, head_dim).transpose(1, 2)


def make_batch(shape: Shape, batch: int, ctx: int, new: int, device, seed: int) -> Batch:
    """Random K/V in a pool of scattered blocks, and the same K/V gathered contiguously."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-ctx // shape.block_size)
    table = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq)
    slots = token_slots(
        table, torch.arange(batch)[:, None], torch.arange(ctx)[None, :], shape.block_size
    )  # [batch, ctx]
    dev_gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*size):
        return torch.randn(size, generator=dev_gen, dtype=shape.dtype, device=device)

    num_slots = batch * blocks_per_seq * shape.block_size
    cache = randn(2, shape.kv_heads, num_slots, shape.head_dim)
    k = torch.empty((batch, shape.kv_heads, ctx, shape.head_dim), dtype=shape.dtype, device=device)
    v = torch.empty_like(k)
    dev_slots = slots.to(device)
    for b in range(batch):  # one sequence at a time: no second full-size temporary
        k[b] = cache[0].index_select(1, dev_slots[b])
        v[b] = cache[1].index_select(1, dev_slots[b])
    inputs = AttentionInputs(
        query_lens=[new] * batch,
        seq_lens=[ctx] * batch,
        block_tables=table,
        slot_mapping=slots[:, ctx - new :].reshape(-1),
        block_size=shape.block_size,
        device=device,
    )
    q = randn(batch * new, shape.heads, shape.head_dim)
    return Batch(inputs, cache, q, k, v, batch, ctx, new)


def memory_skip_reason(
    shape: Shape, batch: int, ctx: int, new: int, cap_bytes: float, device
) -> str | None:
    """Why the config is skipped for memory (None when it fits)."""
    needed = shape.needed_bytes(batch, ctx, new)
    limit = cap_bytes
    if device.type == "cuda":
        torch.cuda.empty_cache()
        limit = min(limit, 0.9 * torch.cuda.mem_get_info(device)[0])
    if needed > limit:
        return f"needs {needed / GIB:.3g} GiB > {limit / GIB:.3g} GiB"
    return None


# ---------------------------------------------------------------------------- the two sides


def sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``q_len`` of ``k_len`` positions, flash backend only."""
    q_len, k_len = q.shape[2], k.shape[2]
    mask, causal = None, False
    if q_len == k_len:
        causal = True
    elif q_len > 1:  # a chunk after cached context: causal, aligned bottom right
        mask = causal_lower_right(q_len, k_len)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )


def check_flash_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A lower-right causal bias goes to the flash kernel only when it can run the shape
    (otherwise torch quietly takes another kernel): refuse to time anything else."""
    if q.device.type != "cuda" or q.shape[2] in (1, k.shape[2]):
        return  # sdpa_kernel(FLASH_ATTENTION) itself rejects what flash cannot run
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    if not can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True), False):
        raise RuntimeError("the flash kernel cannot run this lower-right causal shape")


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return float((got - want).abs().max() / want.abs().max())


@attrs.frozen
class Measured:
    llmlab_us: float
    host_us: float | None
    splits: int
    sdpa_us: float | None
    rel_err: float | None
    ok: bool
    note: str = ""


def measure(shape: Shape, data: Batch, timer: Timer, tolerance: float) -> Measured:
    """Time llmlab's ``attend_into`` and SDPA flash on one batch; check they agree."""
    backend = TritonPagedAttention()
    metadata = backend.build_metadata(data.inputs)
    launches = backend.launches(metadata, shape.heads, shape.kv_heads, shape.head_dim)
    splits = max(s for _, s, _ in launches)
    out = torch.empty_like(data.q)

    def llmlab():
        backend.attend_into(out, data.q, data.cache, metadata, scale=shape.scale)

    llmlab()
    got = out.clone()
    llmlab_us = timer.call_us(llmlab)
    host_us = timer.host_us(llmlab)

    q = data.sdpa_query()
    try:
        check_flash_can_run(q, data.k, data.v)
        want = sdpa_flash(q, data.k, data.v, shape.scale)
    except (RuntimeError, TypeError, ValueError) as err:  # flash cannot run this shape here
        note = str(err).strip().splitlines()[0][:120]
        return Measured(llmlab_us, host_us, splits, None, None, True, f"sdpa n/a: {note}")
    sdpa_us = timer.call_us(lambda: sdpa_flash(q, data.k, data.v, shape.scale))
    err = rel_err(got, want.transpose(1, 2).reshape(got.shape))
    ok = math.isfinite(err) and err < tolerance
    return Measured(llmlab_us, host_us, splits, sdpa_us, err, ok)


# ---------------------------------------------------------------------------- sweeps


def _fmt(value, spec: str, width: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:{width}{spec}}"


DECODE_HEADER = (
    f"{'heads':>5} {'batch':>5} {'ctx':>6} {'split':>5} {'llmlab us':>10} {'GB/s':>7} "
    f"{'%copy':>6} {'sdpa us':>9} {'%copy':>6} {'llm/sdpa':>8} {'host us':>8} {'rel err':>8}"
)


def run_decode(args, shapes, timer: Timer, copy_gbps: float, tolerance: float) -> list[dict]:
    print("\n== paged decode (one query token per sequence)")
    print(DECODE_HEADER)
    rows = []
    for shape in shapes:
        for batch in args.batches:
            for ctx in args.contexts:
                row = {"heads": shape.heads, "kv_heads": shape.kv_heads, "batch": batch, "ctx": ctx}
                skip = memory_skip_reason(shape, batch, ctx, 1, args.mem_cap_gib * GIB, args.device)
                if skip:
                    print(f"{shape.label:>5} {batch:5d} {ctx:6d}  skipped: {skip}", flush=True)
                    rows.append(row | {"skipped": skip})
                    continue
                data = make_batch(shape, batch, ctx, 1, args.device, args.seed)
                m = measure(shape, data, timer, tolerance)
                del data
                nbytes = shape.kv_bytes(batch, ctx) + 2 * shape.q_bytes(batch)
                row |= attrs.asdict(m) | decode_rates(nbytes, m, copy_gbps)
                rows.append(row)
                print_decode_row(shape, row)
    return rows


def decode_rates(nbytes: int, m: Measured, copy_gbps: float) -> dict:
    gbps = nbytes / m.llmlab_us / 1e3
    sdpa_gbps = None if m.sdpa_us is None else nbytes / m.sdpa_us / 1e3
    return {
        "bytes": nbytes,
        "llmlab_gbps": gbps,
        "llmlab_pct_copy": 100 * gbps / copy_gbps,
        "sdpa_gbps": sdpa_gbps,
        "sdpa_pct_copy": None if sdpa_gbps is None else 100 * sdpa_gbps / copy_gbps,
        "ratio": None if m.sdpa_us is None else m.llmlab_us / m.sdpa_us,
    }


def print_decode_row(shape: Shape, row: dict) -> None:
    line = (
        f"{shape.label:>5} {row['batch']:5d} {row['ctx']:6d} {row['splits']:5d} "
        f"{row['llmlab_us']:10.1f} {row['llmlab_gbps']:7.0f} {row['llmlab_pct_copy']:5.1f}% "
        f"{_fmt(row['sdpa_us'], '.1f', 9)} {_fmt(row['sdpa_pct_copy'], '.1f', 5)}% "
        f"{_fmt(row['ratio'], '.2f', 8)} {_fmt(row['host_us'], '.1f', 8)} "
        f"{_fmt(row['rel_err'], '.1e', 8)}{'' if row['ok'] else '  FAIL'} {row['note']}"
    )
    print(line.rstrip(), flush=True)


PREFILL_HEADER = (
    f"{'heads':>5} {'batch':>5} {'cached':>6} {'new':>5} {'llmlab us':>10} {'TFLOP/s':>8} "
    f"{'sdpa us':>9} {'TFLOP/s':>8} {'llm/sdpa':>8} {'host us':>8} {'rel err':>8}"
)


def causal_flops(shape: Shape, batch: int, cached: int, new: int) -> int:
    """QK^T and PV over the visible (query, key) pairs: query i sees cached + i + 1 keys."""
    pairs = new * cached + new * (new + 1) // 2
    return 4 * shape.head_dim * shape.heads * pairs * batch


def run_prefill(args, shapes, timer: Timer, tolerance: float) -> list[dict]:
    print("\n== prefill (causal; fresh prompts, then chunks after cached context)")
    print(PREFILL_HEADER)
    rows = []
    for shape in shapes:
        for batch, cached, new in args.prefill:
            ctx = cached + new
            row = {
                "heads": shape.heads,
                "kv_heads": shape.kv_heads,
                "batch": batch,
                "cached": cached,
                "new": new,
            }
            skip = memory_skip_reason(shape, batch, ctx, new, args.mem_cap_gib * GIB, args.device)
            if skip:
                print(f"{shape.label:>5} {batch:5d} {cached:6d} {new:5d}  skipped: {skip}")
                rows.append(row | {"skipped": skip})
                continue
            data = make_batch(shape, batch, ctx, new, args.device, args.seed)
            m = measure(shape, data, timer, tolerance)
            del data
            flops = causal_flops(shape, batch, cached, new)
            row |= attrs.asdict(m) | {
                "flops": flops,
                "llmlab_tflops": flops / m.llmlab_us / 1e6,
                "sdpa_tflops": None if m.sdpa_us is None else flops / m.sdpa_us / 1e6,
                "ratio": None if m.sdpa_us is None else m.llmlab_us / m.sdpa_us,
            }
            rows.append(row)
            line = (
                f"{shape.label:>5} {batch:5d} {cached:6d} {new:5d} {m.llmlab_us:10.1f} "
                f"{row['llmlab_tflops']:8.2f} {_fmt(m.sdpa_us, '.1f', 9)} "
                f"{_fmt(row['sdpa_tflops'], '.2f', 8)} {_fmt(row['ratio'], '.2f', 8)} "
                f"{_fmt(m.host_us, '.1f', 8)} {_fmt(m.rel_err, '.1e', 8)}"
                f"{'' if m.ok else '  FAIL'} {m.note}"
            )
            print(line.rstrip(), flush=True)
    return rows


def report_targets(decode_rows: list[dict]) -> None:
    rows = [r for r in decode_rows if "skipped" not in r and r["ctx"] >= 2048 and r["batch"] >= 64]
    print("\n== targets (paged decode, context >= 2k, >= 64 sequences)")
    if not rows:
        print("no measured row qualifies (run the full sweep on a GPU)")
        return

    def where(r):
        return f"heads {r['heads']}/{r['kv_heads']} batch {r['batch']} ctx {r['ctx']}"

    worst = min(rows, key=lambda r: r["llmlab_pct_copy"])
    verdict = "met" if worst["llmlab_pct_copy"] >= 75 else "NOT met"
    print(
        f">= 75% of copy bandwidth: lowest {worst['llmlab_pct_copy']:.1f}% ({where(worst)})"
        f" -> {verdict}"
    )
    compared = [r for r in rows if r["ratio"] is not None]
    if not compared:
        print("no slower than SDPA flash: no SDPA measurement")
        return
    slowest = max(compared, key=lambda r: r["ratio"])
    verdict = "met" if slowest["ratio"] <= 1.0 else "NOT met"
    print(
        f"no slower than SDPA flash: worst llmlab/sdpa time {slowest['ratio']:.2f} "
        f"({where(slowest)}) -> {verdict}"
    )


# ---------------------------------------------------------------------------- main


def _heads(text: str) -> tuple[int, int]:
    heads, kv_heads = text.split("/")
    return int(heads), int(kv_heads)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes")
    parser.add_argument("--contexts", type=int, nargs="+", help="decode context lengths")
    parser.add_argument("--heads", type=_heads, nargs="+", help="e.g. 32/8 16/8")
    parser.add_argument("--only", choices=("decode", "prefill", "both"), default="both")
    parser.add_argument("--reps", type=int, default=30, help="timed calls (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--copy-gib", type=float, default=1.0)
    parser.add_argument("--mem-cap-gib", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a small subset of the sweep")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes (float32 on CPU): proves the script runs; numbers meaningless",
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write the results here")
    args = parser.parse_args(argv)

    preset = SMOKE if args.smoke else QUICK if args.quick else {}
    args.batches = args.batches or preset.get("batches", DECODE_BATCHES)
    args.contexts = args.contexts or preset.get("contexts", DECODE_CONTEXTS)
    args.heads = args.heads or preset.get("heads", HEADS)
    args.prefill = preset.get("prefill", PREFILL_CASES)
    if args.smoke:
        for name in ("head_dim", "dtype", "reps", "warmup", "copy_gib"):
            setattr(args, name, preset[name])
    args.device = torch.device(args.device)
    if args.smoke and args.device.type == "cuda":
        args.dtype = "bfloat16"
    reason = triton_unavailable_reason(args.device)
    if reason is not None:
        parser.error(f"the Triton kernels cannot run on {args.device}: {reason}")
    return args


def describe(args, copy_gbps: float) -> dict:
    name = "cpu"
    if args.device.type == "cuda":
        name = torch.cuda.get_device_name(args.device)
    import triton

    meta = {
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "head_dim": args.head_dim,
        "block_size": args.block_size,
        "reps": args.reps,
        "warmup": args.warmup,
        "copy_gib": args.copy_gib,
        "copy_gbps": copy_gbps,
    }
    print(
        f"device {name}, torch {meta['torch']}, triton {meta['triton']}; {args.dtype}, "
        f"head_dim {args.head_dim}, block_size {args.block_size}; median of {args.reps} "
        f"after {args.warmup} warmup calls"
        + (", L2 flushed before each" if args.device.type == "cuda" else "")
    )
    print(
        f"copy bandwidth: {copy_gbps:.0f} GB/s ({args.copy_gib:g} GiB copy_, read + write, "
        "best of reps)"
    )
    if args.device.type != "cuda":
        print(
            "no GPU: Triton's interpreter on CPU, perf_counter timings. The numbers are "
            "meaningless; this run only proves the script works."
        )
    return meta


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    copy_gbps = measure_copy_gbps(args.device, int(args.copy_gib * GIB), args.reps)
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    meta = describe(args, copy_gbps)
    timer = Timer.create(args.device, args.reps, args.warmup)
    shapes = [Shape(h, kv, args.head_dim, dtype, args.block_size) for h, kv in args.heads]

    decode_rows, prefill_rows = [], []
    if args.only in ("decode", "both"):
        decode_rows = run_decode(args, shapes, timer, copy_gbps, tolerance)
    if args.only in ("prefill", "both"):
        prefill_rows = run_prefill(args, shapes, timer, tolerance)
    print(
        "\nllm/sdpa: llmlab time / SDPA flash time (< 1: llmlab faster); rel err: "
        "max |llmlab - sdpa| / max |sdpa|"
    )
    if decode_rows:
        report_targets(decode_rows)

    if args.json:
        payload = {"meta": meta, "decode": decode_rows, "prefill": prefill_rows}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    failed = [r for r in decode_rows + prefill_rows if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} config(s) FAILED the numerics check (tolerance {tolerance:g})")
        sys.exit(1)


if __name__ == "__main__":
    main()
