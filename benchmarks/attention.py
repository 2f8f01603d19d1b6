"""Paged attention kernels: decode bandwidth and prefill FLOP rate, side by side with a baseline.

Two modes (``--kernels``): on CUDA (the default there) the Triton kernels against SDPA
flash, described first; on a CPU device (the default without CUDA) llmlab's C++ CPU
kernels against the torch backend, described under "CPU mode" below.

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
  CUDA graphs (``llmlab.runner.cuda_graphs``), which hides it there, but prefill, mixed
  and ``enforce_eager`` steps pay it per layer, and where it exceeds the GPU time such a
  step is launch-bound.
* Numerics, once per config: max |llmlab - SDPA| / max |SDPA| must stay below 2e-2 for
  16-bit inputs (both round the softmax weights to 16 bits for the PV product) or 1e-4 in
  float32. A fast but wrong kernel is marked FAIL and the script exits with status 1.
* Memory: a config needs its paged cache and the contiguous copy (2 x its KV bytes) plus
  small q/out tensors; it is skipped above ``--mem-cap-gib`` or 90% of free memory.

Targets (reported, not enforced): paged decode reaches >= 75% of the copy bandwidth at
context >= 2k with >= 64 sequences, and is no slower than SDPA flash on the contiguous copy.

On a machine without CUDA, ``--smoke`` (or ``--kernels triton``) runs the Triton kernels in
Triton's interpreter (``TRITON_INTERPRET=1`` is set below before triton is imported) and
times come from ``time.perf_counter``; ``--smoke`` runs tiny float32 shapes (bfloat16 on
CUDA, where flash needs 16-bit inputs) to prove the script works end to end; its numbers
mean nothing.

CPU mode (``--kernels cpu``, the default on a CPU device): ``CpuPagedAttention.forward``
(:mod:`llmlab.attention.cpu_backend`, C++ with OpenMP, reading K/V through the block
tables) against the plain-torch reference ``TorchPagedAttention(decode_mirror=False)
.forward``, which gathers each sequence's context out of the paged cache with
``index_select`` and runs ``scaled_dot_product_attention`` (torch picks its CPU kernel)
with the causal mask. Both are timed whole, as a model layer calls them: each writes the
step's new K/V at ``slot_mapping`` and then attends.

* Same values, same block tables: one random cache in the torch layout ``[2, kv_heads,
  slots, head_dim]`` is converted with ``cpu_backend.from_slot_rows`` into the C++
  backend's layout (keys transposed within each block); the pool holds exactly the
  batch's blocks, handed out in a random permutation (scattered blocks). The new tokens'
  K/V are the values already at their slots, so every call sees the same cache.
* Streaming from DRAM, not cache: each config keeps ``copies`` identical caches per side,
  enough that together they exceed ``--stream-mib`` (64 MiB, twice the 32 MiB L3 of the
  machine the published numbers come from; a config whose one cache is larger has one),
  and each call reads the next copy, as consecutive layers of a model do.
* Time: ``time.perf_counter`` around one call (Python wrapper included: the engine pays
  it per layer), median of ``--reps`` (10) after ``--warmup`` (3) calls, on torch's
  intra-op threads (``torch.get_num_threads()``) for both sides. Each side's metadata is
  built once, untimed: it is per-step host work shared by every layer, as on CUDA. The
  torch backend's decode mirror is off: it is a dense per-row copy kept across steps (an
  engine-state cache with its own memory and upkeep), not a way of reading a paged cache.
* Decode: batches 16, 64 x contexts 256, 1024 x heads 8/4, 32/8 x head_dim 64, 128.
  GB/s counts the useful bytes, the same for both sides: K/V of every context plus q and
  the output (block tables, the torch side's gathered copy and the new tokens' writes are
  not credited). ``%read`` = GB/s / the CPU read bandwidth, measured first
  (``benchmarks.common.measure_cpu_read_bytes_per_s``: best time to sum a ``--copy-gib``
  GiB (0.5) float32 tensor on all threads), the practical ceiling for a kernel that
  streams its inputs. ``speedup`` = torch time / llmlab time (> 1: llmlab faster).
* Prefill: fresh prompts (1 x 512, 8 x 128 tokens) and chunks after a cached prefix
  (512 after 1536, 16 x 16 after 1008); GFLOP/s of the attention matmuls counted as on
  CUDA (visible pairs only), llmlab and torch, and the speedup.
* Numerics, once per config on the first copy: max |llmlab - torch| / max |torch| below
  1e-4 in float32 or 2e-2 in bfloat16, else FAIL and exit status 1.
* dtype: ``--dtype`` float32 (default: what llmlab runs a float32 checkpoint in on CPU) or
  bfloat16 (half the bytes; the C++ kernel widens to float32 in registers).
* The header prints the load average (1 minute): other processes on the machine skew the
  timings, and it is printed again at the end. ``--quick`` (about 20 s on 2 cores): heads
  32/8 x 128, batches 16, 64 at context 1024, and two prefill cases; the full sweep takes
  30-45 s per dtype on 2 cores.

Run::

    python -m benchmarks.attention                        # full sweep (CUDA)
    python -m benchmarks.attention --quick --json attention.json
    python -m benchmarks.attention --only decode --batches 64 256 --contexts 2048 16384
    python -m benchmarks.attention --smoke                # CPU, Triton's interpreter
    python -m benchmarks.attention --device cpu           # C++ CPU kernels vs torch
    python -m benchmarks.attention --device cpu --dtype bfloat16 --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
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

from benchmarks.common import measure_cpu_read_bytes_per_s
from llmlab.attention.backend import AttentionInputs, token_slots
from llmlab.attention.cpu_backend import (
    CpuPagedAttention,
    cpu_kernels_unavailable_reason,
    from_slot_rows,
)
from llmlab.attention.torch_backend import TorchPagedAttention
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

# The C++ CPU kernels (--kernels cpu): a 2-core machine runs the full sweep of one dtype in
# 30-45 s and --quick in about 20 s. Heads 8/4 x 64 is a small model's attention
# (Qwen2.5-0.5B has 14/2 x 64), 32/8 x 128 Llama-3-8B's.
CPU_BATCHES = (16, 64)
CPU_CONTEXTS = (256, 1024)
CPU_HEADS = ((8, 4), (32, 8))
CPU_HEAD_DIMS = (64, 128)
# (batch, cached tokens, new tokens): fresh prompts of 512 and 8 x 128 tokens, a 512-token
# chunk after 1.5k cached, and 16 short suffixes after a 1k cached prefix (prefix hits).
CPU_PREFILL = ((1, 0, 512), (8, 0, 128), (1, 1536, 512), (16, 1008, 16))
CPU_QUICK = {
    "batches": (16, 64),
    "contexts": (1024,),
    "heads": ((32, 8),),
    "head_dims": (128,),
    "prefill": ((1, 0, 512), (1, 1536, 512)),
}
CPU_REPS = 10
CPU_READ_GIB = 0.5
CPU_STREAM_MIB = 64.0  # 2x the 32 MiB L3 of the machine these numbers were taken on
CPU_MAX_COPIES = 1024

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


# ---------------------------------------------------------------------------- CPU kernels


@attrs.define(eq=False)
class CpuCase:
    """One config for the CPU kernels: the same K/V in both layouts, ``copies`` times.

    ``torch_caches[i]`` (the torch backend's layout) and ``cpu_caches[i]`` (the C++
    backend's, converted by ``from_slot_rows``) hold the same values; so do all ``i``.
    ``k``/``v`` are the new tokens' K/V as already stored at their slots, so the write
    each forward does leaves every cache as it was: every call sees the same values.
    """

    inputs: AttentionInputs
    q: torch.Tensor  # [batch * new, heads, head_dim]
    k: torch.Tensor  # [batch * new, kv_heads, head_dim]
    v: torch.Tensor
    torch_caches: list[torch.Tensor]
    cpu_caches: list[torch.Tensor]


def cpu_pool_bytes(shape: Shape, batch: int, ctx: int) -> int:
    """One layer's paged KV pool: exactly the batch's blocks (whole blocks)."""
    return shape.kv_bytes(batch, -(-ctx // shape.block_size) * shape.block_size)


def cpu_copies(shape: Shape, batch: int, ctx: int, stream_bytes: float) -> int:
    """Caches to cycle through so that together they exceed ``stream_bytes``."""
    return max(1, min(CPU_MAX_COPIES, math.ceil(stream_bytes / cpu_pool_bytes(shape, batch, ctx))))


def cpu_skip_reason(shape: Shape, batch: int, ctx: int, new: int, copies: int, cap_bytes: float):
    """Why the config is skipped for memory (None when it fits): both layouts' copies, the
    torch backend's gathered K/V and its attention temporaries, q and outputs."""
    needed = (
        2 * copies * cpu_pool_bytes(shape, batch, ctx)
        + 2 * shape.kv_bytes(batch, ctx)
        + 4 * batch * shape.heads * new * ctx * 4  # scores / mask, float32
        + 5 * shape.q_bytes(batch * new)
    )
    limit = cap_bytes
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limit = min(limit, 0.9 * int(line.split()[1]) * 1024)
    except OSError:
        pass
    if needed > limit:
        return f"needs {needed / GIB:.3g} GiB > {limit / GIB:.3g} GiB"
    return None


def make_cpu_case(shape: Shape, batch: int, ctx: int, new: int, copies: int, seed: int):
    """``batch`` sequences of ``ctx`` tokens (the last ``new`` are this step's) over a pool
    of exactly their blocks, handed out in a random permutation (scattered blocks)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-ctx // shape.block_size)
    table = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq)
    slots = token_slots(
        table, torch.arange(batch)[:, None], torch.arange(ctx)[None, :], shape.block_size
    )  # [batch, ctx]
    num_slots = batch * blocks_per_seq * shape.block_size
    cache = torch.randn(
        (2, shape.kv_heads, num_slots, shape.head_dim), generator=gen, dtype=shape.dtype
    )
    new_slots = slots[:, ctx - new :].reshape(-1)
    inputs = AttentionInputs(
        query_lens=[new] * batch,
        seq_lens=[ctx] * batch,
        block_tables=table,
        slot_mapping=new_slots,
        block_size=shape.block_size,
        device=torch.device("cpu"),
    )
    q = torch.randn((batch * new, shape.heads, shape.head_dim), generator=gen, dtype=shape.dtype)
    k = cache[0][:, new_slots].transpose(0, 1).contiguous()
    v = cache[1][:, new_slots].transpose(0, 1).contiguous()
    own = from_slot_rows(cache, shape.block_size)
    torch_caches = [cache] + [cache.clone() for _ in range(copies - 1)]
    cpu_caches = [own] + [own.clone() for _ in range(copies - 1)]
    return CpuCase(inputs, q, k, v, torch_caches, cpu_caches)


def cycle_us(fn, caches: list[torch.Tensor], reps: int, warmup: int) -> float:
    """Median wall time of ``fn(cache)``, each call on the next of ``caches`` (like the
    layers of a model: the previous call's K/V are not what this one reads)."""
    times = []
    for i in range(warmup + reps):
        cache = caches[i % len(caches)]
        start = time.perf_counter()
        fn(cache)
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times) * 1e6


@attrs.frozen
class CpuMeasured:
    llmlab_us: float
    torch_us: float
    rel_err: float
    ok: bool

    @property
    def speedup(self) -> float:
        """Torch backend time / llmlab time (> 1: llmlab faster)."""
        return self.torch_us / self.llmlab_us


def measure_cpu(shape: Shape, case: CpuCase, args, tolerance: float) -> CpuMeasured:
    """Time ``CpuPagedAttention.forward`` and ``TorchPagedAttention.forward`` (gather +
    SDPA) on the same values and block tables; check they agree. Both metadata are built
    once, untimed: per-step host work shared by every layer."""
    llmlab, reference = CpuPagedAttention(), TorchPagedAttention(decode_mirror=False)
    llmlab_md = llmlab.build_metadata(case.inputs)
    reference_md = reference.build_metadata(case.inputs)

    def run_llmlab(cache):
        return llmlab.forward(
            0, case.q, case.k, case.v, cache, llmlab_md, scale=shape.scale, sliding_window=None
        )

    def run_reference(cache):
        return reference.forward(
            0, case.q, case.k, case.v, cache, reference_md, scale=shape.scale, sliding_window=None
        )

    err = rel_err(run_llmlab(case.cpu_caches[0]), run_reference(case.torch_caches[0]))
    llmlab_us = cycle_us(run_llmlab, case.cpu_caches, args.reps, args.warmup)
    torch_us = cycle_us(run_reference, case.torch_caches, args.reps, args.warmup)
    ok = math.isfinite(err) and err < tolerance
    return CpuMeasured(llmlab_us, torch_us, err, ok)


CPU_DECODE_HEADER = (
    f"{'heads':>5} {'hd':>4} {'batch':>5} {'ctx':>5} {'copies':>6} {'llmlab us':>10} "
    f"{'GB/s':>6} {'%read':>6} {'torch us':>10} {'GB/s':>6} {'%read':>6} {'speedup':>7} "
    f"{'rel err':>8}"
)
CPU_PREFILL_HEADER = (
    f"{'heads':>5} {'hd':>4} {'batch':>5} {'cached':>6} {'new':>5} {'copies':>6} "
    f"{'llmlab us':>10} {'GFLOP/s':>8} {'torch us':>10} {'GFLOP/s':>8} {'speedup':>7} "
    f"{'rel err':>8}"
)


def _skip_row(args, shape: Shape, batch: int, ctx: int, new: int, row: dict, label: str):
    """``(copies, None)``, or ``(copies, row)`` marked skipped (and printed)."""
    copies = cpu_copies(shape, batch, ctx, args.stream_mib * (1 << 20))
    skip = cpu_skip_reason(shape, batch, ctx, new, copies, args.mem_cap_gib * GIB)
    if skip is None:
        return copies, None
    print(f"{label}  skipped: {skip}", flush=True)
    return copies, row | {"skipped": skip}


def run_cpu_decode(args, shapes, read_gbps: float, tolerance: float) -> list[dict]:
    print("\n== paged decode (one query token per sequence)")
    print(CPU_DECODE_HEADER)
    rows = []
    for shape in shapes:
        for batch in args.batches:
            for ctx in args.contexts:
                row = {
                    "heads": shape.heads,
                    "kv_heads": shape.kv_heads,
                    "head_dim": shape.head_dim,
                    "batch": batch,
                    "ctx": ctx,
                }
                label = f"{shape.label:>5} {shape.head_dim:4d} {batch:5d} {ctx:5d}"
                copies, skipped = _skip_row(args, shape, batch, ctx, 1, row, label)
                if skipped:
                    rows.append(skipped)
                    continue
                case = make_cpu_case(shape, batch, ctx, 1, copies, args.seed)
                m = measure_cpu(shape, case, args, tolerance)
                del case
                nbytes = shape.kv_bytes(batch, ctx) + 2 * shape.q_bytes(batch)
                gbps, torch_gbps = nbytes / m.llmlab_us / 1e3, nbytes / m.torch_us / 1e3
                row |= attrs.asdict(m) | {
                    "copies": copies,
                    "bytes": nbytes,
                    "llmlab_gbps": gbps,
                    "llmlab_pct_read": 100 * gbps / read_gbps,
                    "torch_gbps": torch_gbps,
                    "torch_pct_read": 100 * torch_gbps / read_gbps,
                    "speedup": m.speedup,
                    "ratio": m.llmlab_us / m.torch_us,
                }
                rows.append(row)
                print(
                    f"{label} {copies:6d} {m.llmlab_us:10.1f} {gbps:6.1f} "
                    f"{row['llmlab_pct_read']:5.1f}% {m.torch_us:10.1f} {torch_gbps:6.1f} "
                    f"{row['torch_pct_read']:5.1f}% {m.speedup:7.2f} {m.rel_err:8.1e}"
                    f"{'' if m.ok else '  FAIL'}",
                    flush=True,
                )
    return rows


def run_cpu_prefill(args, shapes, tolerance: float) -> list[dict]:
    print("\n== prefill (causal; fresh prompts, then chunks after cached context)")
    print(CPU_PREFILL_HEADER)
    rows = []
    for shape in shapes:
        for batch, cached, new in args.prefill:
            ctx = cached + new
            row = {
                "heads": shape.heads,
                "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "batch": batch,
                "cached": cached,
                "new": new,
            }
            label = f"{shape.label:>5} {shape.head_dim:4d} {batch:5d} {cached:6d} {new:5d}"
            copies, skipped = _skip_row(args, shape, batch, ctx, new, row, label)
            if skipped:
                rows.append(skipped)
                continue
            case = make_cpu_case(shape, batch, ctx, new, copies, args.seed)
            m = measure_cpu(shape, case, args, tolerance)
            del case
            flops = causal_flops(shape, batch, cached, new)
            gflops, torch_gflops = flops / m.llmlab_us / 1e3, flops / m.torch_us / 1e3
            row |= attrs.asdict(m) | {
                "copies": copies,
                "flops": flops,
                "llmlab_gflops": gflops,
                "torch_gflops": torch_gflops,
                "speedup": m.speedup,
                "ratio": m.llmlab_us / m.torch_us,
            }
            rows.append(row)
            print(
                f"{label} {copies:6d} {m.llmlab_us:10.1f} {gflops:8.1f} {m.torch_us:10.1f} "
                f"{torch_gflops:8.1f} {m.speedup:7.2f} {m.rel_err:8.1e}"
                f"{'' if m.ok else '  FAIL'}",
                flush=True,
            )
    return rows


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_cpu(args, read_gbps: float) -> dict:
    meta = {
        "kernels": "cpu",
        "device": _cpu_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0],
        "dtype": args.dtype,
        "head_dims": list(args.head_dims),
        "block_size": args.block_size,
        "reps": args.reps,
        "warmup": args.warmup,
        "stream_mib": args.stream_mib,
        "read_gib": args.copy_gib,
        "read_gbps": read_gbps,
    }
    print(
        f"device {meta['device']} (CPU), torch {meta['torch']}, {meta['threads']} threads, "
        f"{meta['cpus']} CPUs, load average {meta['load_average']:.2f} (other processes "
        "skew timings)"
    )
    print(
        f"{args.dtype}, block_size {args.block_size}; wall time per forward call, median of "
        f"{args.reps} after {args.warmup} warmup calls, each call on the next of `copies` "
        f"KV caches (>= {args.stream_mib:g} MiB together); metadata built once, untimed"
    )
    print(
        f"CPU read bandwidth: {read_gbps:.1f} GB/s (sum of a {args.copy_gib:g} GiB float32 "
        "tensor, all threads, best of 7)"
    )
    return meta


def _cpu_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Defaults of the CPU-kernel mode (see the module docstring)."""
    args.device = torch.device(args.device)
    if args.device.type != "cpu":
        parser.error(f"--kernels cpu runs on the CPU, not {args.device}")
    if args.smoke:
        parser.error("--smoke runs the Triton kernels; for small CPU runs use --quick")
    reason = cpu_kernels_unavailable_reason(args.device)
    if reason is not None:
        parser.error(f"llmlab's CPU kernels cannot run: {reason}")
    preset = CPU_QUICK if args.quick else {}
    args.dtype = args.dtype or "float32"
    if DTYPES[args.dtype] not in (torch.float32, torch.bfloat16):
        parser.error(f"the CPU kernels take float32 or bfloat16, not {args.dtype}")
    args.head_dims = (args.head_dim,) if args.head_dim else preset.get("head_dims", CPU_HEAD_DIMS)
    args.batches = args.batches or preset.get("batches", CPU_BATCHES)
    args.contexts = args.contexts or preset.get("contexts", CPU_CONTEXTS)
    args.heads = args.heads or preset.get("heads", CPU_HEADS)
    args.prefill = args.prefill or preset.get("prefill", CPU_PREFILL)
    args.reps = args.reps or CPU_REPS
    args.copy_gib = args.copy_gib or CPU_READ_GIB
    return args


def main_cpu(args) -> None:
    dtype = DTYPES[args.dtype]
    # Both sides round to the dtype; float32 differs only in summation order and exp().
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    read_gbps = measure_cpu_read_bytes_per_s(int(args.copy_gib * GIB)) / 1e9
    meta = describe_cpu(args, read_gbps)
    shapes = [
        Shape(h, kv, head_dim, dtype, args.block_size)
        for h, kv in args.heads
        for head_dim in args.head_dims
    ]
    decode_rows, prefill_rows = [], []
    if args.only in ("decode", "both"):
        decode_rows = run_cpu_decode(args, shapes, read_gbps, tolerance)
    if args.only in ("prefill", "both"):
        prefill_rows = run_cpu_prefill(args, shapes, tolerance)
    meta["load_average_end"] = os.getloadavg()[0]
    print(
        "\nllmlab: CpuPagedAttention.forward (C++); torch: TorchPagedAttention(decode_mirror="
        "False).forward (gather + SDPA); both write the new K/V, then attend.\n"
        "GB/s: K/V of every context + q + output / time; %read: of the CPU read bandwidth; "
        "speedup: torch time / llmlab time (> 1: llmlab faster); rel err: "
        "max |llmlab - torch| / max |torch|"
    )
    print(f"load average at the end: {meta['load_average_end']:.2f}")
    if args.json:
        payload = {"meta": meta, "decode": decode_rows, "prefill": prefill_rows}
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    failed = [r for r in decode_rows + prefill_rows if r.get("ok") is False]
    if failed:
        print(f"{len(failed)} config(s) FAILED the numerics check (tolerance {tolerance:g})")
        sys.exit(1)


# ---------------------------------------------------------------------------- main


def _heads(text: str) -> tuple[int, int]:
    heads, kv_heads = text.split("/")
    return int(heads), int(kv_heads)


def _prefill_case(text: str) -> tuple[int, int, int]:
    batch, cached, new = (int(part) for part in text.split(":"))
    return batch, cached, new


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--kernels",
        choices=("triton", "cpu"),
        help="what to benchmark: the Triton kernels (default on CUDA, and with --smoke) or "
        "the C++ CPU kernels against the torch backend (default on a CPU device)",
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="default: bfloat16 (triton), float32 (cpu)"
    )
    parser.add_argument(
        "--head-dim", type=int, help="default: 128 (triton); cpu sweeps 64 and 128 unless given"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", help="decode batch sizes")
    parser.add_argument("--contexts", type=int, nargs="+", help="decode context lengths")
    parser.add_argument("--heads", type=_heads, nargs="+", help="e.g. 32/8 16/8")
    parser.add_argument(
        "--prefill", type=_prefill_case, nargs="+", help="prefill cases, batch:cached:new"
    )
    parser.add_argument("--only", choices=("decode", "prefill", "both"), default="both")
    parser.add_argument(
        "--reps", type=int, help="timed calls (median); default 30 (triton), 10 (cpu)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--copy-gib",
        type=float,
        help="triton: the copy_ baseline's size (default 1); cpu: the read baseline's "
        "buffer (default 0.5)",
    )
    parser.add_argument(
        "--stream-mib",
        type=float,
        default=CPU_STREAM_MIB,
        help="cpu: copies of each config's KV cache, cycled call to call, total at least "
        "this much (several times the last-level cache), so K/V stream from DRAM",
    )
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
    if args.kernels is None:
        on_cpu = torch.device(args.device).type == "cpu"
        args.kernels = "cpu" if on_cpu and not args.smoke else "triton"
    if args.kernels == "cpu":
        return _cpu_args(parser, args)
    args.dtype = args.dtype or "bfloat16"
    args.head_dim = args.head_dim or 128
    args.reps = args.reps or 30
    args.copy_gib = args.copy_gib or 1.0

    preset = SMOKE if args.smoke else QUICK if args.quick else {}
    args.batches = args.batches or preset.get("batches", DECODE_BATCHES)
    args.contexts = args.contexts or preset.get("contexts", DECODE_CONTEXTS)
    args.heads = args.heads or preset.get("heads", HEADS)
    args.prefill = args.prefill or preset.get("prefill", PREFILL_CASES)
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
    if args.kernels == "cpu":
        main_cpu(args)
        return
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
