"""The paged attention backend against a dense reference, on every path: batched decode
(native kernel and torch fallback), prefill from scratch and prefill continuing a cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention, bind_attention_layers
from vllm.v1.attention.backends import torch_sdpa
from vllm.v1.attention.backends.abstract import (
    AttentionType,
    CommonAttentionMetadata,
    EncoderAttentionMetadata,
)
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def _reference(q_all, k_all, v_all, scale):
    """Dense causal attention of one sequence: q/k/v [len, heads or kv_heads, d]."""
    group = HEADS // KV_HEADS
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q_all.double(), k) * scale
    n = q_all.shape[0]
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native", ["all", "decode", "none"])
def test_backend_matches_dense_reference(dtype, native, monkeypatch):
    """native: every native kernel; the decode kernel only (the prefill kernel declining,
    as for shapes it has no instantiation for); none (torch only)."""
    if native == "none":
        monkeypatch.setattr(torch_sdpa, "_native_ops", lambda device: None)
    elif torch_sdpa._native_ops(torch.device("cpu")) is None:
        pytest.skip("no compiler for the native kernel")
    if native == "decode":
        monkeypatch.setattr(torch_sdpa.TorchSDPAImpl, "_native_prefill", lambda *a: False)
    gen = torch.Generator().manual_seed(0)
    # (already computed, scheduled now): two decodes, a fresh prefill, a continued chunk.
    plan = [(9, 1), (30, 1), (0, 7), (8, 5)]
    scale = HEAD_SIZE**-0.5
    seqs = [(torch.randn(c + s, HEADS, HEAD_SIZE, generator=gen),
             torch.randn(c + s, KV_HEADS, HEAD_SIZE, generator=gen),
             torch.randn(c + s, KV_HEADS, HEAD_SIZE, generator=gen)) for c, s in plan]
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, dtype=dtype)
    # Scattered, non-contiguous block ids for every sequence.
    free = list(np.random.default_rng(0).permutation(np.arange(1, NUM_BLOCKS)))
    max_blocks = 16
    block_table = np.zeros((len(plan), max_blocks), dtype=np.int32)
    for i, (c, s) in enumerate(plan):
        n = -(-(c + s) // BLOCK_SIZE)
        block_table[i, :n] = [free.pop() for _ in range(n)]
        for pos in range(c):  # what earlier steps wrote
            slot = block_table[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_cache[0].view(-1, KV_HEADS, HEAD_SIZE)[slot] = seqs[i][1][pos].to(dtype)
            kv_cache[1].view(-1, KV_HEADS, HEAD_SIZE)[slot] = seqs[i][2][pos].to(dtype)
    q = torch.cat([qq[c:] for (qq, _, _), (c, _) in zip(seqs, plan)]).to(dtype)
    k = torch.cat([kk[c:] for (_, kk, _), (c, _) in zip(seqs, plan)]).to(dtype)
    v = torch.cat([vv[c:] for (_, _, vv), (c, _) in zip(seqs, plan)]).to(dtype)
    computed = np.array([c for c, _ in plan], dtype=np.int32)
    scheduled = np.array([s for _, s in plan], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + s) for c, s in plan])
    req = np.repeat(np.arange(len(plan)), scheduled)
    slots = (block_table[req, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
             + positions % BLOCK_SIZE)
    common = CommonAttentionMetadata(qsl, computed + scheduled, computed, block_table, slots,
                                     int(qsl[-1]))
    metadata = TorchSDPABackend.build_metadata(common, BLOCK_SIZE, torch.device("cpu"))
    impl = TorchSDPABackend.make_impl(HEADS, HEAD_SIZE, KV_HEADS, scale)
    out = impl.forward(q, k, v, kv_cache, metadata).view(-1, HEADS, HEAD_SIZE)
    # A second layer on the same metadata (the torch path reuses its per-chunk tensors).
    assert torch.equal(impl.forward(q, k, v, kv_cache, metadata).view(-1, HEADS, HEAD_SIZE),
                       out)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (c, _) in enumerate(plan):
        qq, kk, vv = (t.to(dtype) for t in seqs[i])
        expected = _reference(qq, kk, vv, scale)[c:]
        got = out[qsl[i]:qsl[i + 1]].double()
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    # The new keys and values landed in their slots.
    flat_k = kv_cache[0].view(-1, KV_HEADS, HEAD_SIZE)
    assert torch.equal(flat_k[torch.from_numpy(slots)], k)


def _check_native_decode(dtype, lens, heads, kv_heads, head_size, block=16, window=0,
                         soft_cap=0.0):
    """`window` > 0: blocks before each row's window are the null block (0), as a window
    group's table gives them, and must not be read."""
    ops = torch_sdpa._native_ops(torch.device("cpu"))
    if ops is None:
        pytest.skip("no compiler for the native kernel")
    gen = torch.Generator().manual_seed(0)
    group = heads // kv_heads
    max_blocks = -(-max(lens) // block)
    num_blocks = sum(-(-n // block) for n in lens) + 1
    kv = torch.randn(2, num_blocks, block, kv_heads, head_size, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = np.zeros((len(lens), max_blocks), dtype=np.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block)
        table[i, :nb] = order[used:used + nb].numpy()
        used += nb
    q = torch.randn(len(lens), heads, head_size, generator=gen).to(dtype)
    scale = head_size ** -0.5
    kernel_table = table.copy()
    if window:
        kv[:, 0] = float("nan")  # the null block: a read would poison the row
        for i, n in enumerate(lens):
            kernel_table[i, :max(0, n - window) // block] = 0
    out = ops.paged_decode_attention(q, kv, torch.from_numpy(kernel_table),
                                     torch.tensor(lens, dtype=torch.int32), scale, window,
                                     soft_cap)
    for i, n in enumerate(lens):
        ids = torch.from_numpy(table[i, :-(-n // block)].astype(np.int64))
        k = kv[0][ids].reshape(-1, kv_heads, head_size)[:n].float()
        v = kv[1][ids].reshape(-1, kv_heads, head_size)[:n].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].float(), k) * scale
        if soft_cap:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        if window:
            scores[:, :max(0, n - window)] = float("-inf")
        p = torch.softmax(scores, dim=-1)
        ref = torch.einsum("ht,thd->hd", p, v)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(out[i].float(), ref, atol=tol, rtol=tol), (n, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_kernel_long_and_odd_lengths(dtype):
    """The kernel alone against a dense softmax: lengths across its 512-key partitions and
    with 4-key and block tails (1, 5, 16, 17, 511, 512, 513, 1300), GQA group 3, blocks in
    a shuffled order."""
    _check_native_decode(dtype, [1, 5, 16, 17, 511, 512, 513, 1300], 6, 2, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_size", [
    (4, 4, 64),    # no GQA: tiles of one head
    (8, 2, 64),    # group 4: one tile of 4 (AVX-512), two of 2 (AVX2)
    (14, 2, 64),   # group 7: seven tiles of one
    (16, 2, 128),  # group 8, head 128: tiles of 2, 2 keys per reduction (AVX-512)
    (6, 3, 32),    # group 2, head 32
    (4, 1, 16),    # one kv head, head 16
    (4, 1, 256),   # Gemma 3 270M: head 256, group 4 (AVX2: 8 column passes of values)
    (4, 2, 80),    # a head size without an instantiation: the portable loop
])
def test_native_decode_kernel_head_shapes(dtype, heads, kv_heads, head_size):
    """Every (head size, group) shape the kernel specialises, and one it does not, against
    a dense softmax."""
    _check_native_decode(dtype, [1, 3, 7, 37, 600], heads, kv_heads, head_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_size, ranges", [
    (16, 4, 64, [(0, 8), (8, 16), (4, 12)]),   # whole kv heads (the fused decoder, 2 threads)
    (4, 1, 256, [(0, 2), (2, 4), (1, 3)]),     # Gemma 3: query heads of one kv head
    (6, 2, 64, [(0, 1), (1, 6), (3, 5)]),      # ranges that cut a group: tiles of one
    (4, 2, 80, [(1, 3), (0, 2)]),              # the portable loop
])
def test_native_decode_head_ranges_equal_all_heads(dtype, heads, kv_heads, head_size, ranges):
    """A range of query heads (how the fused decoder splits one request's attention over
    its threads) computes exactly what the whole call computes for those heads, bit for
    bit, across 512-key partitions, a window and a soft-cap; the other heads' rows are
    left alone (zeros)."""
    ops = torch_sdpa._native_ops(torch.device("cpu"))
    if ops is None:
        pytest.skip("no compiler for the native kernel")
    gen = torch.Generator().manual_seed(1)
    block, lens = 16, [1, 37, 700]
    max_blocks = -(-max(lens) // block)
    kv = torch.randn(2, len(lens) * max_blocks + 1, block, kv_heads, head_size,
                     generator=gen).to(dtype)
    table = (torch.randperm(len(lens) * max_blocks, generator=gen) + 1).to(torch.int32)
    table = table.view(len(lens), max_blocks).contiguous()
    q = torch.randn(len(lens), heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for window, soft_cap in [(0, 0.0), (300, 30.0)]:
        args = (q, kv, table, seq_lens, head_size ** -0.5, window, soft_cap)
        full = ops.paged_decode_attention(*args)
        for begin, end in ranges:
            part = ops.paged_decode_attention(*args, head_begin=begin, head_end=end)
            assert torch.equal(part[:, begin:end], full[:, begin:end]), (begin, end, window)
            assert not part[:, :begin].any() and not part[:, end:].any()
    with pytest.raises(RuntimeError, match=r"heads \[3, 2\)"):
        ops.paged_decode_attention(q, kv, table, seq_lens, 1.0, head_begin=3, head_end=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_kv_matches_index_copy(dtype):
    """Rows of strided key/value views (as a fused qkv output gives them) land at their
    slots, exactly as index_copy_ puts them; rows past the slot mapping are ignored."""
    ops = torch_sdpa._native_ops(torch.device("cpu"))
    if ops is None:
        pytest.skip("no compiler for the native kernel")
    kv_heads, head_size, n = 2, 8, 5
    qkv = torch.randn(n + 2, 3 * kv_heads * head_size, dtype=dtype)
    key = qkv[:, kv_heads * head_size:2 * kv_heads * head_size].view(n + 2, kv_heads, head_size)
    value = qkv[:, 2 * kv_heads * head_size:].view(n + 2, kv_heads, head_size)
    slots = torch.tensor([17, 3, 40, 0, 63], dtype=torch.int64)
    cache = torch.zeros(2, 4, 16, kv_heads, head_size, dtype=dtype)
    ops.write_kv(key, value, cache, slots)
    expected = torch.zeros_like(cache)
    expected[0].view(-1, kv_heads, head_size).index_copy_(0, slots, key[:n])
    expected[1].view(-1, kv_heads, head_size).index_copy_(0, slots, value[:n])
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="slot 64 out of range"):
        ops.write_kv(key, value, cache, torch.tensor([64]))


def _build_has(ops, flag: str) -> bool:
    """Whether the native build was compiled with `flag` (its target's, not necessarily this
    processor's: `VLLM_CPU_MARCH`)."""
    return flag in ops.isa()


def _check_prefill(path, dtype, plan, heads, kv_heads, head_size, block, causal=True,
                   window=0, soft_cap=0.0, spans=None):
    """`plan`: (queries, keys) per chunk, the queries being the last of the keys' positions.
    `path`: "native" calls the prefill kernel (AVX-512, or AVX2 with FMA and F16C: it
    declines elsewhere); "portable" runs the backend with that kernel declining:
    torch SDPA per chunk (a causal layer's one-token chunks and cross-attention chunks of
    up to 16 queries take the paged decode path, as the backend sends them).
    Either against a dense softmax in float64, with q a strided view of a fused qkv
    output, blocks shuffled, and (native) rows outside the chunks left as they were.
    `window`: blocks before the chunk's first window are the null block (native: NaN,
    never read; portable: large values the torch paths gather and must mask).
    `spans`: per chunk, bidirectional spans [start, end) of its positions (inside its
    queries): a query in one sees keys up to the span's end (`key_ends`)."""
    ops = torch_sdpa._native_ops(torch.device("cpu"))
    if path == "native" and ops is None:
        pytest.skip("no compiler for the native kernel")
    gen = torch.Generator().manual_seed(0)
    group = heads // kv_heads
    num_blocks = sum(-(-keys // block) for _, keys in plan) + 1
    kv = torch.randn(2, num_blocks, block, kv_heads, head_size, generator=gen).to(dtype)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1
    max_blocks = max(-(-keys // block) for _, keys in plan) + 1  # one spare column
    table = torch.zeros(len(plan), max_blocks, dtype=torch.int32)
    used = 0
    for i, (_, keys) in enumerate(plan):
        nb = -(-keys // block)
        table[i, :nb] = order[used:used + nb]
        used += nb
    # Chunk i's queries start at 2 + its offset: rows 0-1 and the last stay untouched.
    lens = [n for n, _ in plan]
    starts = [2 + sum(lens[:i]) for i in range(len(plan))]
    total = 3 + sum(lens)
    qkv = torch.randn(total, heads + 2 * kv_heads, head_size, generator=gen).to(dtype)
    q = qkv[:, :heads]
    out = torch.full((total, heads, head_size), 7.0, dtype=dtype)
    scale = head_size ** -0.5
    kernel_table = table.clone()
    # Each query row's key end: position + 1, or its span's end.
    key_ends = torch.zeros(total, dtype=torch.int32)
    for i, (n, keys) in enumerate(plan):
        positions = torch.arange(keys - n, keys)
        ends = positions + 1
        for start, end in (spans or [[]] * len(plan))[i]:
            ends[(positions >= start) & (positions < end)] = end
        key_ends[starts[i]:starts[i] + n] = ends.int()
    if window:
        kv[:, 0] = float("nan") if path == "native" else 1e4
        for i, (n, keys) in enumerate(plan):
            kernel_table[i, :max(0, keys - n - window + 1) // block] = 0
    if path == "native":
        ran = ops.paged_prefill_attention(
            q, kv, kernel_table, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(lens, dtype=torch.int32),
            torch.tensor([keys for _, keys in plan], dtype=torch.int32), out, scale, causal,
            window, soft_cap, key_ends if spans else torch.empty(0, dtype=torch.int32))
        if not ran:  # a build without AVX2: the backend takes torch SDPA
            assert not _build_has(ops, "avx2")
            pytest.skip("no AVX2 (avx2): the native prefill kernel declines; "
                        "[portable] checks the path the backend takes")
    else:
        out[2:-1] = _prefill_through_backend(q[2:-1], kv, kernel_table, plan, heads,
                                             kv_heads, head_size, block, causal, window,
                                             soft_cap, key_ends[2:-1].numpy() if spans else None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (n, keys) in enumerate(plan):
        ids = table[i, :-(-keys // block)].long()
        k = kv[0][ids].reshape(-1, kv_heads, head_size)[:keys].double()
        v = kv[1][ids].reshape(-1, kv_heads, head_size)[:keys].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[starts[i]:starts[i] + n].double(), k) * scale
        if soft_cap:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        if causal:
            q_pos = torch.arange(keys - n, keys)[:, None]
            k_pos = torch.arange(keys)[None, :]
            hidden = k_pos >= key_ends[starts[i]:starts[i] + n, None]
            if window:
                hidden |= k_pos <= q_pos - window
            scores = scores.masked_fill(hidden, float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        torch.testing.assert_close(out[starts[i]:starts[i] + n].double(), ref, atol=tol,
                                   rtol=tol)
    if path == "native":
        untouched = torch.cat([out[:2], out[-1:]])
        assert torch.equal(untouched, torch.full_like(untouched, 7.0))


def _prefill_through_backend(q, kv, table, plan, heads, kv_heads, head_size, block, causal,
                             window, soft_cap, key_ends=None):
    """The backend's forward over `plan`'s chunks (q [tokens, heads, d]) with the native
    prefill kernel declining. A causal layer writes each chunk's keys and values (here the
    cache's own, so the cache is unchanged); a cross-attention layer reads the cache only.
    e.g. plan [(5, 30)], block 16: the chunk's positions 25..29 -> slots of block
    table[0, 1] at offsets 9..13."""
    n = np.array([q_len for q_len, _ in plan])
    keys = np.array([k_len for _, k_len in plan])
    computed = keys - n if causal else np.zeros_like(keys)
    positions = np.concatenate([np.arange(c, c + q_len) for c, q_len in zip(computed, n)])
    req = np.repeat(np.arange(len(plan)), n)
    table_np = table.numpy()
    slots = (table_np[req, positions // block].astype(np.int64) * block + positions % block)
    common = CommonAttentionMetadata(
        np.concatenate([[0], np.cumsum(n)]).astype(np.int32), keys.astype(np.int32),
        computed.astype(np.int32), table_np, slots, int(n.sum()), key_ends=key_ends)
    metadata = TorchSDPABackend.build_metadata(common, block, torch.device("cpu"), causal)
    attn_type = AttentionType.DECODER if causal else AttentionType.ENCODER_DECODER
    impl = TorchSDPABackend.make_impl(heads, head_size, kv_heads, head_size ** -0.5,
                                      attn_type, window or None, soft_cap or None)
    key = value = None
    if causal:
        flat = torch.from_numpy(slots)
        key = kv[0].reshape(-1, kv_heads, head_size)[flat]
        value = kv[1].reshape(-1, kv_heads, head_size)[flat]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_sdpa.TorchSDPAImpl, "_native_prefill", lambda *a: False)
        before = kv.clone()
        out = impl.forward(q, key, value, kv, metadata).view(-1, heads, head_size)
    assert torch.equal(kv, before)
    return out


PREFILL_PATHS = ["native", "portable"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_size", [
    (9, 3, 64),    # the default model: group 3
    (8, 2, 64),    # group 4 (Llama-3-8B's ratio)
    (10, 2, 32),   # group 5
    (4, 4, 64),    # no GQA
    (8, 1, 128),   # group 8, head 128
    (6, 3, 32),
    (14, 2, 16),   # group 7, head 16
    (4, 2, 80),    # a head size of 5 vectors
])
@pytest.mark.parametrize("block", [16, 8, 32])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_paths(path, dtype, heads, kv_heads, head_size, block):
    """Fresh prompts (7, 40 tokens), chunks continuing a cache (5 after 25, 33 after 67),
    a one-token chunk; tiles of 16 queries with tails, key chunks of 16 with tails."""
    _check_prefill(path, dtype, [(7, 7), (40, 40), (5, 30), (1, 17), (33, 100)], heads,
                   kv_heads, head_size, block)


@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_paths_float16(path):
    _check_prefill(path, torch.float16, [(7, 7), (40, 40), (5, 30)], 9, 3, 64, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_paths_with_bidirectional_spans(path, dtype, window):
    """Media spans whose positions see each other both ways (Gemma 3's images): a fresh
    prompt with two spans (one across a tile of 16 queries), a chunk continuing a cache
    whose span ends at its last query, a chunk without one; with a window, a query in a
    span still sees nothing before its own window."""
    plan = [(40, 40), (12, 30), (5, 5)]
    spans = [[(3, 9), (12, 33)], [(20, 30)], []]
    _check_prefill(path, dtype, plan, 8, 2, 64, 16, window=window, spans=spans)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_paths_non_causal(path, dtype):
    """Cross-attention chunks: every query sees all of its sequence's keys."""
    _check_prefill(path, dtype, [(20, 20), (3, 50), (17, 6)], 6, 2, 64, 16, causal=False)


def test_native_prefill_kernel_declines_unsupported_shapes():
    """Head sizes that are not a multiple of 16 and groups past 8 are left to the
    portable path: the kernel returns False and writes nothing."""
    ops = torch_sdpa._native_ops(torch.device("cpu"))
    if ops is None:
        pytest.skip("no compiler for the native kernel")
    one = torch.ones(1, dtype=torch.int32)
    for heads, kv_heads, head_size in [(4, 2, 24), (9, 1, 64)]:
        q = torch.randn(4, heads, head_size)
        kv = torch.randn(2, 2, 4, kv_heads, head_size)
        out = torch.zeros_like(q)
        assert not ops.paged_prefill_attention(q, kv, torch.ones(1, 1, dtype=torch.int32),
                                               torch.zeros(1, dtype=torch.int32), one * 4,
                                               one * 4, out, 1.0, True)
        assert not out.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, soft_cap", [(20, 0.0), (0, 5.0), (600, 3.0), (1, 0.0)])
@pytest.mark.parametrize("head_size", [64, 80])
def test_native_decode_kernel_window_and_soft_cap(dtype, window, soft_cap, head_size):
    """Windows shorter and longer than the sequences, across partitions (600 > 512 keys)
    and inside one block; soft-capped scores; the vectorised kernel (head 64) and the
    portable loop (head 80). Blocks before the window are NaN null blocks: never read."""
    _check_native_decode(dtype, [1, 5, 17, 40, 513, 1300], 6, 2, head_size, window=window,
                         soft_cap=soft_cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, soft_cap", [(20, 0.0), (0, 5.0), (7, 2.0), (1, 0.0)])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_paths_window_and_soft_cap(path, dtype, window, soft_cap):
    """Fresh prompts and continued chunks longer than the window (key chunks skipped),
    windows inside one key chunk, soft-capped scores."""
    _check_prefill(path, dtype, [(7, 7), (40, 40), (5, 30), (1, 17), (33, 100)], 6, 2, 64,
                   16, window=window, soft_cap=soft_cap)


@pytest.mark.parametrize("native", [True, False])
def test_backend_window_and_soft_cap_match_dense_reference(native, monkeypatch):
    """The backend's windowed, soft-capped layer (native kernels or torch paths) on two
    decodes, a fresh prefill and a continued chunk, blocks before each window nulled."""
    if not native:
        monkeypatch.setattr(torch_sdpa, "_native_ops", lambda device: None)
    elif torch_sdpa._native_ops(torch.device("cpu")) is None:
        pytest.skip("no compiler for the native kernel")
    window, cap = 6, 4.0
    gen = torch.Generator().manual_seed(1)
    plan = [(9, 1), (30, 1), (0, 11), (8, 5)]
    scale = HEAD_SIZE**-0.5
    seqs = [(torch.randn(c + s, HEADS, HEAD_SIZE, generator=gen) * 2,
             torch.randn(c + s, KV_HEADS, HEAD_SIZE, generator=gen) * 2,
             torch.randn(c + s, KV_HEADS, HEAD_SIZE, generator=gen)) for c, s in plan]
    kv_cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE)
    # The null block: the native kernels never read it (NaN would show); the torch paths
    # gather it masked (its garbage must not leak).
    kv_cache[:, 0] = float("nan") if native else 1e4
    free = list(np.random.default_rng(1).permutation(np.arange(1, NUM_BLOCKS)))
    block_table = np.zeros((len(plan), 16), dtype=np.int32)
    for i, (c, s) in enumerate(plan):
        first = max(0, c - window + 1) // BLOCK_SIZE
        for b in range(first, -(-(c + s) // BLOCK_SIZE)):
            block_table[i, b] = free.pop()
        for pos in range(first * BLOCK_SIZE, c):
            slot = block_table[i, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            kv_cache[0].view(-1, KV_HEADS, HEAD_SIZE)[slot] = seqs[i][1][pos]
            kv_cache[1].view(-1, KV_HEADS, HEAD_SIZE)[slot] = seqs[i][2][pos]
    q, k, v = (torch.cat([t[c:] for t, (c, _) in zip(parts, plan)])
               for parts in zip(*seqs))
    computed = np.array([c for c, _ in plan], dtype=np.int32)
    scheduled = np.array([s for _, s in plan], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + s) for c, s in plan])
    req = np.repeat(np.arange(len(plan)), scheduled)
    slots = (block_table[req, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE
             + positions % BLOCK_SIZE)
    common = CommonAttentionMetadata(qsl, computed + scheduled, computed, block_table, slots,
                                     int(qsl[-1]))
    metadata = TorchSDPABackend.build_metadata(common, BLOCK_SIZE, torch.device("cpu"))
    impl = TorchSDPABackend.make_impl(HEADS, HEAD_SIZE, KV_HEADS, scale,
                                      sliding_window=window, logits_soft_cap=cap)
    out = impl.forward(q, k, v, kv_cache, metadata).view(-1, HEADS, HEAD_SIZE)
    group = HEADS // KV_HEADS
    for i, (c, s) in enumerate(plan):
        qq, kk, vv = (t.double() for t in seqs[i])
        scores = torch.einsum("qhd,khd->hqk", qq, kk.repeat_interleave(group, dim=1)) * scale
        scores = torch.tanh(scores / cap) * cap
        n = c + s
        q_pos, k_pos = torch.arange(n)[:, None], torch.arange(n)[None, :]
        scores = scores.masked_fill((k_pos > q_pos) | (k_pos <= q_pos - window),
                                    float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1),
                           vv.repeat_interleave(group, dim=1))[c:]
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), ref, atol=1e-5, rtol=1e-5)


def _encoder_reference(q, k, v, starts, scale):
    """Bidirectional attention within each input, in float64: [tokens, heads, d]."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, e in zip(starts[:-1], starts[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k[s:e].double()) * scale
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e].double())
    return out


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("path", ["native", "portable"])
def test_encoder_attention(path, head_size):
    """Inputs of uneven lengths (one token; not multiples of the 12-query block or the
    32-key block; a longer one before shorter ones, so scratch rows are reused) as views of
    a fused qkv projection, through the backend (ENCODER) as Whisper's encoder calls it,
    within bfloat16 rounding of the exact answer. native: the kernel (AVX512-BF16), as
    close as SDPA's bfloat16 path; portable: SDPA, what the backend runs where the kernel
    declines, one call per input and, for equal lengths, one batched call."""
    native = torch_sdpa._native_ops(torch.device("cpu"))
    if path == "native" and native is None:
        pytest.skip("no compiler for the native kernel")
    gen = torch.Generator().manual_seed(0)
    heads, lens = 3, [301, 1, 45, 77, 300]
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    qkv = torch.randn(starts[-1], 3, heads, head_size, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.unbind(1)
    scale = head_size**-0.5
    expected = _encoder_reference(q, k, v, starts, scale).view(starts[-1], -1)
    impl = TorchSDPABackend.make_impl(heads, head_size, heads, scale, AttentionType.ENCODER)
    metadata = EncoderAttentionMetadata.from_lens(lens)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_sdpa, "_native_ops", lambda device: None)
        sdpa = impl.forward(q, k, v, None, metadata)
        sdpa_error = (sdpa.double() - expected).abs()
        if path == "portable":
            # SDPA in bfloat16 rounds its probabilities as well as its output: on average
            # about 1.5x the error of the exact answer rounded once (1.49x, 1.47x here).
            rounding = (expected.to(torch.bfloat16).double() - expected).abs()
            assert sdpa_error.max() < 1e-2
            assert sdpa_error.mean() < 2 * rounding.mean()
            # Equal lengths: one batched call ([inputs, heads, len, d]).
            even = EncoderAttentionMetadata.from_lens([45, 45, 45])
            assert even.uniform_len == 45
            rows = slice(starts[2], starts[2] + 135)
            batched = impl.forward(q[rows], k[rows], v[rows], None, even)
            even_ref = _encoder_reference(q[rows], k[rows], v[rows], [0, 45, 90, 135],
                                          scale).view(135, -1)
            assert (batched.double() - even_ref).abs().max() < 1e-2
            return
    out = torch.full((starts[-1], heads * head_size), 7.0, dtype=torch.bfloat16)
    if not native.encoder_attention(q, k, v, starts, out, scale):
        assert not _build_has(native, "avx512_bf16")
        pytest.skip("no AVX512-BF16 (avx512_bf16): the encoder kernel declines; [portable] "
                    "checks the SDPA path the backend takes")
    assert torch.equal(impl.forward(q, k, v, None, metadata), out)
    error = (out.double() - expected).abs()
    assert error.max() < 1e-2
    assert error.mean() < 1.2 * sdpa_error.mean()


def test_native_encoder_attention_declines():
    """float32, float16 and head sizes without an instantiation are left to SDPA: the
    kernel returns False and writes nothing."""
    native = torch_sdpa._native_ops(torch.device("cpu"))
    if native is None:
        pytest.skip("no compiler for the native kernel")
    for dtype, head_size in [(torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 80)]:
        qkv = torch.randn(10, 3, 2, head_size).to(dtype)
        out = torch.zeros(10, 2 * head_size, dtype=dtype)
        assert not native.encoder_attention(*qkv.unbind(1), [0, 4, 10], out, 1.0)
        assert not out.any()
    qkv = torch.randn(10, 3, 2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="starts"):
        native.encoder_attention(*qkv.unbind(1), [0, 4, 9], torch.zeros(10, 128), 1.0)


def _encoder_model(scales: list[float]) -> nn.ModuleList:
    """A "model" of ENCODER attention layers (no cache), one per scale."""
    return nn.ModuleList(Attention(TorchSDPABackend, i, HEADS, HEAD_SIZE, HEADS, scale,
                                   AttentionType.ENCODER) for i, scale in enumerate(scales))


def test_compiled_op_finds_the_running_models_layer():
    """Two models in one process bind their layers to the same op indices (0, 1); the op
    (what a compiled graph calls) resolves an index in the forward context's list of the
    model that runs, never the other model's layer (each layer here has its own scale, so
    another layer's output differs)."""
    first, second = _encoder_model([0.1, 0.2]), _encoder_model([0.3, 0.4])
    first_layers, second_layers = bind_attention_layers(first), bind_attention_layers(second)
    assert first_layers == list(first) and second_layers == list(second)
    assert [int(layer.op_id_tensor) for layer in (*first, *second)] == [0, 1, 0, 1]
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 5, HEADS, HEAD_SIZE, generator=gen).unbind(0)
    metadata = EncoderAttentionMetadata.from_lens([2, 3])
    for model, layers in ((first, first_layers), (second, second_layers)):
        with set_forward_context(None, [], encoder_attn_metadata=metadata,
                                 attn_layers=layers):
            for layer in model:
                assert isinstance(layer, Attention)
                out = torch.ops.vllm.attention(q, k, v, layer.op_id_tensor)
                assert torch.equal(out, layer.run(q, k, v))
    with set_forward_context(None, [], encoder_attn_metadata=metadata,
                             attn_layers=first_layers):
        assert not torch.allclose(first[0].run(q, k, v), second[0].run(q, k, v))


def test_compiled_op_without_bound_layers_is_refused():
    model = _encoder_model([0.1])
    layer = model[0]
    assert isinstance(layer, Attention)
    q = torch.randn(2, HEADS, HEAD_SIZE)
    metadata = EncoderAttentionMetadata.from_lens([2])
    with set_forward_context(None, [], encoder_attn_metadata=metadata):
        with pytest.raises(RuntimeError, match="bind_attention_layers"):
            torch.ops.vllm.attention(q, q, q, layer.op_id_tensor)  # never bound
        bound = bind_attention_layers(model)
        with pytest.raises(RuntimeError, match="attn_layers"):
            torch.ops.vllm.attention(q, q, q, layer.op_id_tensor)  # bound, not in the context
    with set_forward_context(None, [], encoder_attn_metadata=metadata, attn_layers=bound):
        assert torch.equal(torch.ops.vllm.attention(q, q, q, layer.op_id_tensor),
                           layer.run(q, q, q))
