"""The torch paged backend against dense per-sequence attention."""

import math

import pytest
import torch

from llmlab.attention import (
    AttentionContext,
    AttentionInputs,
    TorchPagedAttention,
    block_table_tensor,
)


def dense_reference(q, k_all, v_all, num_cached, scale, window=None):
    """Causal attention of new queries over [cached + new] keys for one sequence."""
    n_new, heads, _ = q.shape
    n_ctx = k_all.shape[0]
    group = heads // k_all.shape[1]
    k = k_all.repeat_interleave(group, dim=1)
    v = v_all.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(n_new)[:, None] + num_cached
    kpos = torch.arange(n_ctx)[None, :]
    visible = kpos <= qpos
    if window is not None:
        visible &= (qpos - kpos) < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_batch_matches_dense_attention(block_size, window):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    # (cached tokens, new tokens): a fresh prefill, a decode, a later prefill chunk, a decode.
    shapes = [(0, 9), (13, 1), (7, 6), (30, 1)]
    num_blocks = 80
    backend = TorchPagedAttention()
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, block_size, kv_heads, dim))
    free = list(range(num_blocks))[::-1]  # hand out blocks in reverse: tables are not contiguous
    tables, slots, q_parts, k_parts, v_parts, history = [], [], [], [], [], []
    for cached, new in shapes:
        total = cached + new
        blocks = [free.pop() for _ in range(math.ceil(total / block_size))][::-1]
        tables.append(blocks)
        k_hist = torch.randn(cached, kv_heads, dim)
        v_hist = torch.randn(cached, kv_heads, dim)
        for p in range(cached):  # pretend earlier steps wrote these
            slot = blocks[p // block_size] * block_size + p % block_size
            cache[0, :, slot] = k_hist[p]
            cache[1, :, slot] = v_hist[p]
        history.append((k_hist, v_hist))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        q_parts.append(torch.randn(new, heads, dim))
        k_parts.append(torch.randn(new, kv_heads, dim))
        v_parts.append(torch.randn(new, kv_heads, dim))

    inputs = AttentionInputs(
        query_lens=[n for _, n in shapes],
        seq_lens=[c + n for c, n in shapes],
        block_tables=block_table_tensor(tables),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
        device=torch.device("cpu"),
    )
    ctx = AttentionContext(backend, backend.build_metadata(inputs), [cache])
    scale = dim**-0.5
    out = ctx.attend(
        0, torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), scale=scale,
        sliding_window=window,
    )

    start = 0
    for (cached, new), q, k, v, (kh, vh) in zip(shapes, q_parts, k_parts, v_parts, history):
        ref = dense_reference(q, torch.cat([kh, k]), torch.cat([vh, v]), cached, scale, window)
        torch.testing.assert_close(out[start : start + new], ref, atol=1e-5, rtol=1e-5)
        start += new


def test_new_kv_is_written_at_slot_mapping():
    backend = TorchPagedAttention()
    cache = torch.zeros(backend.kv_cache_shape(4, 2, 1, 3))  # 4 blocks of 2 slots
    inputs = AttentionInputs(
        query_lens=[3], seq_lens=[3], block_tables=block_table_tensor([[2, 0]]),
        slot_mapping=torch.tensor([4, 5, 0]), block_size=2, device=torch.device("cpu"),
    )
    k = torch.arange(9.0).view(3, 1, 3)
    v = -k
    AttentionContext(backend, backend.build_metadata(inputs), [cache]).attend(
        0, torch.randn(3, 1, 3), k, v, scale=1.0
    )
    torch.testing.assert_close(cache[0, 0, 4], k[0, 0])
    torch.testing.assert_close(cache[0, 0, 5], k[1, 0])
    torch.testing.assert_close(cache[1, 0, 0], v[2, 0])
    untouched = [1, 2, 3, 6, 7]
    assert cache[:, :, untouched].abs().sum() == 0


def test_decode_mirror_matches_gathering_across_joins_leaves_and_compaction():
    """Many steps of a changing decode batch: the mirror path equals the gather path."""
    torch.manual_seed(3)
    heads, kv_heads, dim, bs, num_blocks = 4, 2, 8, 4, 2000  # blocks are never reused here
    backends = [
        (b, torch.zeros(b.kv_cache_shape(num_blocks, bs, kv_heads, dim)))
        for b in (TorchPagedAttention(decode_mirror=True), TorchPagedAttention(decode_mirror=False))
    ]
    cpu = torch.device("cpu")
    states = [b.create_state(num_rows=64, num_slots=num_blocks * bs, device=cpu) for b, _ in backends]
    assert states[1] is None
    free = list(range(num_blocks))
    free_rows = list(range(64))
    seqs: dict[str, dict] = {}  # request id -> {"len", "blocks", "row"}
    rng = torch.Generator().manual_seed(0)
    next_id = 0
    for step in range(40):
        # Requests join (prefill) and leave at random; at times most leave (compaction).
        leaving = []
        if step in (10, 25):
            leaving += list(seqs)[: len(seqs) * 3 // 4]
        leaving += [r for r in seqs if r not in leaving and torch.rand(1, generator=rng).item() < 0.1]
        for rid in leaving:
            row = seqs.pop(rid)["row"]
            states[0].release([row])  # the scheduler says the row is free
            free_rows.append(row)
        for _ in range(int(torch.randint(0, 4, (1,), generator=rng))):
            seqs[f"r{next_id}"] = {"len": 0, "blocks": [], "row": free_rows.pop(0),
                                   "new": int(torch.randint(2, 9, (1,), generator=rng))}
            next_id += 1
        if not seqs:
            continue
        ids, q_lens, seq_lens, tables, slots = [], [], [], [], []
        for rid, s in seqs.items():
            new = s.pop("new", 1)
            total = s["len"] + new
            while len(s["blocks"]) * bs < total:
                s["blocks"].append(free.pop(int(torch.randint(0, len(free), (1,), generator=rng))))
            ids.append(s["row"])
            q_lens.append(new)
            seq_lens.append(total)
            tables.append(list(s["blocks"]))
            slots += [s["blocks"][p // bs] * bs + p % bs for p in range(s["len"], total)]
            s["len"] = total
        n = len(slots)
        q, k, v = torch.randn(n, heads, dim), torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
        outs = []
        for (backend, cache), state in zip(backends, states):
            inputs = AttentionInputs(
                query_lens=q_lens, seq_lens=seq_lens, block_tables=block_table_tensor(tables),
                slot_mapping=torch.tensor(slots), block_size=bs, device=cpu,
                rows=tuple(ids), state=state,
            )
            ctx = AttentionContext(backend, backend.build_metadata(inputs), [cache])
            outs.append(ctx.attend(0, q, k, v, scale=dim**-0.5, sliding_window=6 if step % 2 else None))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    mirror = states[0]
    assert next_id > 20 and mirror.num_compactions > 0 and mirror.num_fills > 20


def test_decode_mirror_falls_back_to_gathering_when_it_would_outgrow_the_cache():
    heads, kv_heads, dim, bs = 2, 1, 4, 4
    backend = TorchPagedAttention(decode_mirror=True)
    cache = torch.randn(backend.kv_cache_shape(101, bs, kv_heads, dim))  # 404 slots
    # Two decodes at 200 tokens would need 2 rows x 256 columns = 512 cells > 404.
    tables = block_table_tensor([list(range(50)), list(range(50, 100))])
    state = backend.create_state(num_rows=2, num_slots=cache.shape[2], device=torch.device("cpu"))
    inputs = AttentionInputs(
        query_lens=[1, 1], seq_lens=[200, 200], block_tables=tables,
        slot_mapping=torch.tensor([199, 399]), block_size=bs, device=torch.device("cpu"),
        rows=(0, 1), state=state,
    )
    q, k, v = torch.randn(2, heads, dim), torch.randn(2, kv_heads, dim), torch.randn(2, kv_heads, dim)
    reference = TorchPagedAttention(decode_mirror=False)
    expected = AttentionContext(reference, reference.build_metadata(inputs), [cache.clone()]).attend(
        0, q, k, v, scale=0.5)
    metadata = backend.build_metadata(inputs)
    assert metadata.mirror_plan is None
    got = AttentionContext(backend, metadata, [cache]).attend(0, q, k, v, scale=0.5)
    torch.testing.assert_close(got, expected)


def test_copy_blocks_copies_every_slot_of_every_layer():
    backend = TorchPagedAttention()
    caches = [torch.randn(backend.kv_cache_shape(6, 4, 2, 3)) for _ in range(2)]
    before = [c.clone() for c in caches]
    backend.copy_blocks(caches, [(1, 4), (5, 0)], block_size=4)
    for c, b in zip(caches, before):
        torch.testing.assert_close(c[:, :, 16:20], b[:, :, 4:8])
        torch.testing.assert_close(c[:, :, 0:4], b[:, :, 20:24])
        torch.testing.assert_close(c[:, :, 4:16], b[:, :, 4:16])


def test_mirror_state_is_per_engine_and_keyed_by_row():
    """One backend instance, two engines' states: rows never collide across them."""
    backend = TorchPagedAttention()
    cpu = torch.device("cpu")
    a = backend.create_state(num_rows=4, num_slots=400, device=cpu)
    b = backend.create_state(num_rows=4, num_slots=400, device=cpu)
    assert a is not b
    tables = block_table_tensor([[0, 1]])
    a.plan([0], [5], tables, 4, cpu)
    assert b.plan([0], [5], tables, 4, cpu).fresh_rows is not None  # b knows nothing of a
    assert a.plan([0], [6], tables, 4, cpu).fresh_rows is None  # a continues row 0
    a.release([0])
    assert a.plan([0], [7], tables, 4, cpu).fresh_rows is not None  # a freed row starts fresh
