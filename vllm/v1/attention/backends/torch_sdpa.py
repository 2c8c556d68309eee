"""Paged attention on `torch.nn.functional.scaled_dot_product_attention` (CPU and CUDA).

KV cache per layer: `[2, num_blocks, block_size, num_kv_heads, head_size]`; K and V of
token t live at flat slot `slot_mapping[t]` of `kv_cache[0]` / `kv_cache[1]`.

Decode requests (one query token) are computed together: on CPU by the native paged
kernel (`csrc/cpu/paged_attention.cpp`, reading blocks in place), otherwise by gathering
their blocks into a padded `[num_decodes, max_blocks * block_size]` key range masked by
sequence length.
Prefill chunks (prompts, chunked prefill, prompts after a prefix hit) are computed on CPU
all at once by the native prefill kernel (`csrc/cpu/prefill_attention.cpp`), which reads
every key from the cache (the step's own keys are written first); otherwise one request
at a time by torch SDPA, where a chunk with nothing computed before it attends to its own
keys with a causal mask and never reads the cache.

Media positions attending bidirectionally (Gemma 3's images; `key_ends` in the common
metadata) widen a prefill query's causal limit to the end of its span: the native kernel takes
each query's key end, the torch path builds its mask from them. Decode rows stay causal.

Encoder/decoder models add two kinds (`AttentionType`): ENCODER attention is bidirectional
within each encoder input and touches no cache; ENCODER_DECODER (cross) attention is built
with `causal=False`: its "sequence" is the request's cross-attention blocks, which every
decoder query reads whole (decode queries through the same paged decode path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm._custom_ops import native_ops as _native_ops  # a module seam tests patch
from vllm.utils import cdiv
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionType,
    CommonAttentionMetadata,
    DecodeRows,
    EncoderAttentionMetadata,
    FusedAttention,
)

# Longest cross-attention query span computed by the paged decode path (see build_metadata).
_MAX_PAGED_CROSS_QUERY = 16


@dataclass(slots=True)
class PrefillSpan:
    """One prompt chunk, for the portable path (torch SDPA, one call per chunk)."""
    start: int  # first token of the chunk in the batch
    end: int
    computed: int  # tokens before the chunk (chunked prefill, prefix hit)
    seq_len: int
    # The cache blocks it reads: None for a causal chunk with nothing before it, which
    # attends to its own keys only.
    block_ids: np.ndarray | None  # [num_blocks]
    # Built by the first layer that computes the chunk, reused by the others.
    block_ids_tensor: torch.Tensor | None = None
    # [query_len, keys] bool, True = attend, per sliding window (None: causal only).
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    # [query_len]: each query's key end (exclusive) where the chunk holds a bidirectional
    # span (`CommonAttentionMetadata.key_ends`); None: causal, position + 1.
    key_ends: np.ndarray | None = None


@dataclass(slots=True)
class NativePrefill:
    """Every prompt chunk of the step, for the native kernel (one call per layer), which
    reads all keys from the cache: rows of the block table, where each chunk's queries
    start in the batch, how many there are, and the keys its sequence holds."""
    block_table: torch.Tensor  # [num_chunks, max_blocks] int32
    query_start: torch.Tensor  # [num_chunks] int32
    query_len: torch.Tensor  # [num_chunks] int32
    seq_lens: torch.Tensor  # [num_chunks] int32
    # [num_tokens] int32 key end of each query (bidirectional spans); empty: causal.
    key_ends: torch.Tensor


@dataclass(slots=True)
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_actual_tokens: int
    decode_token_idx: torch.Tensor | None  # [num_decodes] int64
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int32 (native kernel)
    decode_block_table_i32: torch.Tensor | None  # [num_decodes, max_blocks] int32 (native)
    prefills: list[PrefillSpan]
    prefill_native: NativePrefill | None  # the same chunks, where the native kernel runs
    decode_only: bool  # every token is a decode, in order: no scatter of results needed
    # Layers with a sliding window or soft-capping (on the torch path): each decode row's
    # sequence length, and the masks built from it by the first such layer, per window.
    decode_seq_lens_np: np.ndarray | None = None  # [num_decodes]
    window_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class TorchSDPAGraphBuffers:
    """The persistent metadata of captured decode steps; row r is request r's one token."""
    slot_mapping: torch.Tensor  # [max_tokens] int64
    block_table: torch.Tensor  # [max_tokens, max_blocks] int64
    key_positions: torch.Tensor  # [max_blocks * block_size] int64: 0, 1, 2, ...
    decode_mask: torch.Tensor  # [max_tokens, 1, 1, max_blocks * block_size] bool


class TorchSDPABackend(AttentionBackend):
    name = "TORCH_SDPA"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, block_size: int,
                       device: torch.device, causal: bool = True) -> TorchSDPAMetadata:
        starts, seq_lens = common.query_start_loc, common.seq_lens
        query_lens = np.diff(starts)
        # Tokens computed as paged decode queries, one per kernel row: single-token rows,
        # and for cross-attention (where every query of a row sees the same keys) rows of
        # up to _MAX_PAGED_CROSS_QUERY tokens, such as Whisper's decoder prompts, so that
        # the cross blocks are read in place rather than gathered.
        # e.g. non-causal, query_lens [1, 3, 40], starts [0, 1, 4, 44]: rows 0 and 1 ->
        # token_rows [0, 1, 1, 1], token_idx [0, 1, 2, 3]; row 2 is a prefill span.
        max_paged = 1 if causal else _MAX_PAGED_CROSS_QUERY
        paged_rows = np.flatnonzero(query_lens <= max_paged)
        row_lens = query_lens[paged_rows]
        token_rows = np.repeat(paged_rows, row_lens)
        token_idx = starts[token_rows] + np.arange(token_rows.size) - np.repeat(
            np.cumsum(row_lens) - row_lens, row_lens)
        decode_idx = decode_table = decode_mask = decode_seq_lens = decode_table_i32 = None
        if token_rows.size:
            decode_idx = torch.from_numpy(token_idx.astype(np.int64)).to(device)
            max_blocks = cdiv(int(seq_lens[token_rows].max()), block_size)
            if _native_ops(device) is not None:
                decode_table_i32 = torch.from_numpy(np.ascontiguousarray(
                    common.block_table[token_rows, :max_blocks])).to(device)
                decode_seq_lens = torch.from_numpy(
                    seq_lens[token_rows].astype(np.int32)).to(device)
            else:
                # e.g. seq_lens [55, 146] with block size 16 -> 10 blocks each; the mask
                # keeps keys 0..54 of row 0 and 0..145 of row 1.
                decode_table = torch.from_numpy(
                    common.block_table[token_rows, :max_blocks].astype(np.int64)).to(device)
                key_pos = np.arange(max_blocks * block_size)
                decode_mask = torch.from_numpy(
                    key_pos[None, :] < seq_lens[token_rows][:, None])[:, None, None, :].to(
                    device)
        prefill_rows = np.flatnonzero(query_lens > max_paged)
        prefills = []
        for i in prefill_rows:
            computed, seq_len = int(common.num_computed_tokens[i]), int(seq_lens[i])
            block_ids = (common.block_table[i, :cdiv(seq_len, block_size)].copy()
                         if computed > 0 or not causal else None)
            span = PrefillSpan(int(starts[i]), int(starts[i + 1]), computed, seq_len, block_ids)
            if common.key_ends is not None and causal:
                span.key_ends = common.key_ends[span.start:span.end]
            prefills.append(span)
        prefill_native = None
        if prefill_rows.size and _native_ops(device) is not None:
            max_blocks = cdiv(int(seq_lens[prefill_rows].max()), block_size)
            prefill_native = NativePrefill(
                torch.from_numpy(np.ascontiguousarray(
                    common.block_table[prefill_rows, :max_blocks], dtype=np.int32)),
                torch.from_numpy(starts[prefill_rows].astype(np.int32)),
                torch.from_numpy(query_lens[prefill_rows].astype(np.int32)),
                torch.from_numpy(seq_lens[prefill_rows].astype(np.int32)),
                torch.from_numpy(common.key_ends) if common.key_ends is not None and causal
                else torch.empty(0, dtype=torch.int32))
        slot_mapping = torch.from_numpy(common.slot_mapping).to(device)
        return TorchSDPAMetadata(slot_mapping, common.num_actual_tokens, decode_idx,
                                 decode_table, decode_mask, decode_seq_lens, decode_table_i32,
                                 prefills, prefill_native,
                                 decode_only=token_rows.size == common.num_actual_tokens,
                                 decode_seq_lens_np=seq_lens[token_rows].copy())

    @staticmethod
    def decode_rows(metadata: object) -> DecodeRows | None:
        m = metadata
        if (not isinstance(m, TorchSDPAMetadata) or not m.decode_only
                or m.decode_seq_lens is None or m.decode_block_table_i32 is None):
            return None
        return DecodeRows(m.decode_block_table_i32, m.decode_seq_lens, m.slot_mapping)

    @staticmethod
    def build_decode_metadata(common: CommonAttentionMetadata, block_size: int,
                              device: torch.device) -> TorchSDPAMetadata | None:
        """The native kernel's decode metadata as tensors sharing the runner's persistent
        arrays (CPU only: elsewhere `.to(device)` copies). The kernel takes the block table
        at its full width (a row's stride) and reads `cdiv(seq_len, block_size)` blocks of
        each row."""
        assert common.uniform_decode
        if device.type != "cpu" or _native_ops(device) is None:
            return None
        seq_lens = common.seq_lens
        return TorchSDPAMetadata(
            slot_mapping=torch.from_numpy(common.slot_mapping),
            num_actual_tokens=common.num_actual_tokens, decode_token_idx=None,
            decode_block_table=None, decode_mask=None,
            decode_seq_lens=torch.from_numpy(seq_lens),
            decode_block_table_i32=torch.from_numpy(common.block_table),
            prefills=[], prefill_native=None, decode_only=True, decode_seq_lens_np=seq_lens)

    # ---- graph hooks: decode rows on the masked gather path (the native kernels are
    # CPU-only, CUDA graphs CUDA's), the block table padded to the buffers' width.

    @staticmethod
    def init_graph_buffers(max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                           device: torch.device) -> TorchSDPAGraphBuffers:
        num_keys = max_blocks_per_seq * block_size
        key_positions = torch.arange(num_keys, device=device)
        return TorchSDPAGraphBuffers(
            slot_mapping=torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
            block_table=torch.zeros(max_num_tokens, max_blocks_per_seq, dtype=torch.int64,
                                    device=device),
            key_positions=key_positions,
            decode_mask=(key_positions < 1).expand(max_num_tokens, 1, 1, num_keys).clone())

    @staticmethod
    def capture_metadata(buffers: object, num_tokens: int) -> TorchSDPAMetadata:
        assert isinstance(buffers, TorchSDPAGraphBuffers)
        return TorchSDPAMetadata(
            slot_mapping=buffers.slot_mapping[:num_tokens], num_actual_tokens=num_tokens,
            decode_token_idx=None, decode_block_table=buffers.block_table[:num_tokens],
            decode_mask=buffers.decode_mask[:num_tokens], decode_seq_lens=None,
            decode_block_table_i32=None, prefills=[], prefill_native=None, decode_only=True)

    @staticmethod
    def prepare_replay(buffers: object, common: CommonAttentionMetadata,
                       num_tokens: int) -> None:
        """Rows [:n] from the step, [n:num_tokens] padding (slot 0, block 0, one key).

        e.g. seq_lens [3, 18], block size 16, 4 blocks a row, num_tokens 4: mask rows
        keys 0..2, 0..17, 0, 0; block table rows [b0, 0, 0, 0], [b1, b2, 0, 0], 0s, 0s."""
        assert isinstance(buffers, TorchSDPAGraphBuffers)
        n = common.num_actual_tokens
        width = common.block_table.shape[1]
        # copy_ converts: int32 numpy rows into the int64 (device) buffers.
        buffers.slot_mapping[:n].copy_(torch.from_numpy(common.slot_mapping[:n]))
        buffers.block_table[:n, :width].copy_(torch.from_numpy(common.block_table[:n]))
        buffers.block_table[:n, width:].zero_()
        seq_lens = torch.from_numpy(common.seq_lens[:n]).to(buffers.key_positions.device)
        buffers.decode_mask[:n] = (buffers.key_positions < seq_lens[:, None])[:, None, None]
        buffers.slot_mapping[n:num_tokens].zero_()
        buffers.block_table[n:num_tokens].zero_()
        buffers.decode_mask[n:num_tokens] = buffers.key_positions < 1

    @staticmethod
    def make_impl(num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                  attn_type: AttentionType = AttentionType.DECODER,
                  sliding_window: int | None = None,
                  logits_soft_cap: float | None = None) -> TorchSDPAImpl:
        return TorchSDPAImpl(num_heads, head_size, num_kv_heads, scale, attn_type,
                             sliding_window, logits_soft_cap)


class TorchSDPAImpl(AttentionImpl):
    """One layer's attention. `sliding_window`: a query at position p sees keys
    (p - window, p]; `logits_soft_cap`: scores become cap * tanh(score / cap) before the
    softmax (Gemma 2). The native kernels take both (skipping blocks before the window);
    the torch paths mask with the window and compute soft-capped scores explicitly."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 attn_type: AttentionType = AttentionType.DECODER,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.scale = scale
        self.attn_type = attn_type
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}.")
        if logits_soft_cap is not None and logits_soft_cap <= 0:
            raise ValueError(f"logits_soft_cap must be positive, got {logits_soft_cap}.")
        if (sliding_window or logits_soft_cap) and attn_type != AttentionType.DECODER:
            raise NotImplementedError("sliding_window / logits_soft_cap are for decoder "
                                      "self-attention layers only.")
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.plain = sliding_window is None and logits_soft_cap is None  # torch paths

    def fused_decode_attention(self) -> FusedAttention | None:
        # Decoder self-attention: the native decode kernel its decode rows take.
        if self.attn_type != AttentionType.DECODER:
            return None
        return FusedAttention(self.scale, self.sliding_window or 0, self.logits_soft_cap or 0.0)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        native = _native_ops(kv_cache.device)
        if native is not None and key.dtype == kv_cache.dtype:
            native.write_kv(key, value, kv_cache, slot_mapping)
            return
        n = slot_mapping.shape[0]
        kv_cache[0].view(-1, self.num_kv_heads, self.head_size).index_copy_(
            0, slot_mapping, key[:n])
        kv_cache[1].view(-1, self.num_kv_heads, self.head_size).index_copy_(
            0, slot_mapping, value[:n])

    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor | None,
                metadata: object) -> torch.Tensor:
        if self.attn_type == AttentionType.ENCODER:
            # Encoder attention: the step's own keys, no cache.
            assert isinstance(metadata, EncoderAttentionMetadata)
            assert key is not None and value is not None
            return self._encoder(query, key, value, metadata)
        assert isinstance(metadata, TorchSDPAMetadata) and kv_cache is not None
        num_tokens = query.shape[0]
        if self.attn_type == AttentionType.DECODER:
            assert key is not None and value is not None  # cross-attention alone has none
            self.write_kv(key, value, kv_cache, metadata.slot_mapping)

        if metadata.decode_only:
            return self._decode(query, kv_cache, metadata).view(num_tokens, -1)
        out = torch.empty(num_tokens, self.num_heads, self.head_size, dtype=query.dtype,
                          device=query.device)
        if metadata.decode_token_idx is not None:
            out[metadata.decode_token_idx] = self._decode(query, kv_cache, metadata)
        if metadata.prefills and not self._native_prefill(query, kv_cache, metadata, out):
            for span in metadata.prefills:
                out[span.start:span.end] = self._prefill(query, key, value, kv_cache, span)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _native_prefill(self, query: torch.Tensor, kv_cache: torch.Tensor,
                        metadata: TorchSDPAMetadata, out: torch.Tensor) -> bool:
        """Every prompt chunk in one native call, keys and values read from the cache
        (this step's were written first); False where the kernel does not run."""
        spans = metadata.prefill_native
        native = _native_ops(query.device)
        if spans is None or native is None or query.dtype != kv_cache.dtype:
            return False
        if query.stride(-1) != 1 or query.stride(1) != self.head_size:
            query = query.contiguous()
        return native.paged_prefill_attention(
            query, kv_cache, spans.block_table, spans.query_start, spans.query_len,
            spans.seq_lens, out, self.scale, self.attn_type == AttentionType.DECODER,
            self.sliding_window or 0, self.logits_soft_cap or 0.0, spans.key_ends)

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchSDPAMetadata) -> torch.Tensor:
        q = query if metadata.decode_only else query[metadata.decode_token_idx]
        if not self.plain and metadata.decode_seq_lens is None:
            return self._decode_windowed(q, kv_cache, metadata)
        if metadata.decode_seq_lens is not None:
            # Built only where the native kernels load (build_metadata).
            native = _native_ops(q.device)
            assert native is not None
            return native.paged_decode_attention(
                q.contiguous(), kv_cache, metadata.decode_block_table_i32,
                metadata.decode_seq_lens, self.scale, self.sliding_window or 0,
                self.logits_soft_cap or 0.0)
        table = metadata.decode_block_table
        assert table is not None  # the masked gather path's table
        n = table.shape[0]
        # Queries of one KV head's group share every key, so the group folds into the
        # query-length axis: q [n, kv_heads, group, d] against k [n, kv_heads, len, d].
        q = q.view(n, self.num_kv_heads, self.group, self.head_size)
        gathered = kv_cache.index_select(1, table.view(-1)).view(
            2, n, -1, self.num_kv_heads, self.head_size)
        k, v = gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_mask,
                                           scale=self.scale)
        return o.reshape(n, self.num_heads, self.head_size)

    def _decode_windowed(self, q: torch.Tensor, kv_cache: torch.Tensor,
                         metadata: TorchSDPAMetadata) -> torch.Tensor:
        """Decode rows of a windowed or soft-capped layer: their blocks gathered, keys
        outside [seq_len - window, seq_len) masked (blocks before the window are the null
        block in a window group's table: never another request's).
        e.g. window 3, seq_lens [5, 2]: row 0 sees keys 2..4, row 1 keys 0..1."""
        table = metadata.decode_block_table
        if table is None:
            assert metadata.decode_block_table_i32 is not None
            table = metadata.decode_block_table_i32.long()
        n, max_blocks = table.shape
        mask = metadata.window_masks.get(self.sliding_window)
        if mask is None:
            assert metadata.decode_seq_lens_np is not None
            seq_lens = metadata.decode_seq_lens_np[:, None]
            keys = np.arange(max_blocks * kv_cache.shape[2])[None, :]
            allowed = keys < seq_lens
            if self.sliding_window is not None:
                allowed &= keys >= seq_lens - self.sliding_window
            mask = torch.from_numpy(allowed)[:, None, None, :].to(q.device)
            metadata.window_masks[self.sliding_window] = mask
        q = q.view(n, self.num_kv_heads, self.group, self.head_size)
        gathered = kv_cache.index_select(1, table.reshape(-1)).view(
            2, n, -1, self.num_kv_heads, self.head_size)
        k, v = gathered[0].transpose(1, 2), gathered[1].transpose(1, 2)
        return self._attend(q, k, v, mask).reshape(n, self.num_heads, self.head_size)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """softmax(q k^T scale [soft-capped], masked) v; q [b, kv_heads, m, d] or
        [b, heads, m, d] with k/v [b, kv_heads, n, d]; mask broadcast to the scores (None:
        every key, as cross-attention)."""
        if self.logits_soft_cap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                  enable_gqa=q.shape[1] != k.shape[1])
        if q.shape[1] != k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.scale
        cap = self.logits_soft_cap
        scores = torch.tanh(scores / cap) * cap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)

    def _encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 metadata: EncoderAttentionMetadata) -> torch.Tensor:
        """Bidirectional attention within each input: bfloat16 on CPU by the native kernel
        (`csrc/cpu/encoder_attention.cpp`, about 2.5x SDPA's flash kernel on Whisper's
        [8, 6, 1500, 64]); else equal lengths in one batched SDPA call
        ([num_inputs, heads, len, d]), otherwise one call per input."""
        num_tokens = query.shape[0]
        native = _native_ops(query.device)
        if native is not None and query.dtype == torch.bfloat16 and self.group == 1:
            out = torch.empty(num_tokens, self.num_heads * self.head_size, dtype=query.dtype,
                              device=query.device)
            if native.encoder_attention(query, key, value, metadata.query_start_loc, out,
                                        self.scale):
                return out
        length = metadata.uniform_len
        if length is not None:
            q, k, v = (t.view(-1, length, t.shape[1], self.head_size).transpose(1, 2)
                       for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, scale=self.scale,
                                               enable_gqa=self.group > 1)
            return o.transpose(1, 2).reshape(num_tokens, self.num_heads * self.head_size)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc
        for start, end in zip(starts[:-1], starts[1:]):
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, scale=self.scale,
                                               enable_gqa=self.group > 1)
            out[start:end] = o[0].transpose(0, 1)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _prefill(self, query: torch.Tensor, key: torch.Tensor | None,
                 value: torch.Tensor | None, kv_cache: torch.Tensor,
                 span: PrefillSpan) -> torch.Tensor:
        # 4-D [1, heads, len, d] inputs: the 3-D form takes a slower kernel on CPU.
        q = query[span.start:span.end].transpose(0, 1)[None]
        if span.block_ids is None and self.plain and span.key_ends is None:
            # A causal chunk with nothing before it: its own keys (cross-attention spans,
            # which have no keys of their own, always read blocks).
            assert key is not None and value is not None
            k = key[span.start:span.end].transpose(0, 1)[None]
            v = value[span.start:span.end].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1)
            return o[0].transpose(0, 1)
        if span.block_ids is None:
            # Windowed, soft-capped or with bidirectional spans, nothing before it: its own
            # keys, masked.
            assert key is not None and value is not None
            k = key[span.start:span.end].transpose(0, 1)[None]
            v = value[span.start:span.end].transpose(0, 1)[None]
        else:
            if span.block_ids_tensor is None:
                span.block_ids_tensor = torch.from_numpy(
                    span.block_ids.astype(np.int64)).to(query.device)
            ids = span.block_ids_tensor
            k = kv_cache[0][ids].view(-1, self.num_kv_heads, self.head_size)
            v = kv_cache[1][ids].view(-1, self.num_kv_heads, self.head_size)
            k = k[:span.seq_len].transpose(0, 1)[None]
            v = v[:span.seq_len].transpose(0, 1)[None]
        mask = None
        if self.attn_type == AttentionType.DECODER:
            mask = span.window_masks.get(self.sliding_window)
            if mask is None:
                # Query row r sits at position computed + r and sees keys
                # (computed + r - window, key_end), key_end = computed + r + 1 unless it is
                # in a bidirectional span; keys start at position seq_len - k_len (0 when
                # read from blocks, `computed` for its own keys).
                # e.g. computed 4, 2 queries, window 3, blocks: rows keys 2..4, 3..5; with
                # the two in the span [4, 6): keys 2..5, 3..5.
                q_pos = span.computed + np.arange(span.end - span.start)[:, None]
                k_pos = span.seq_len - k.shape[2] + np.arange(k.shape[2])[None, :]
                key_ends = q_pos + 1 if span.key_ends is None else span.key_ends[:, None]
                allowed = k_pos < key_ends
                if self.sliding_window is not None:
                    allowed &= k_pos > q_pos - self.sliding_window
                mask = torch.from_numpy(allowed).to(query.device)
                span.window_masks[self.sliding_window] = mask
        return self._attend(q, k, v, mask)[0].transpose(0, 1)
