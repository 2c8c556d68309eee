"""`ToyBackend`: a naive paged attention backend in plain torch, for tests of the backend
contract. Tests register it by name ("toy") through `register_attn_backend` and pick it with
`attention_backend="toy"` or `VLLM_ATTENTION_BACKEND=toy`.

Every query token is one row: it gathers its request's cache blocks (`block_table` row,
`[max_blocks * block_size]` keys) and attends to the first `key_limit` of them. Causal
self-attention: position + 1 keys; cross-attention (`causal=False`): every encoder key.

    A decode, then a 3-token prompt: query_start_loc [0, 1, 4], computed [5, 0],
    seq_lens [6, 3]:
        token rows      0  1  2  3
        request         0  1  1  1
        key_limit       6  1  2  3

The shapes depend on the row count only, so the graph hooks are copies into persistent
rows. ENCODER layers attend within each encoder input, densely, without a cache. Hook and
build calls are counted in `ToyBackend.calls`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from vllm.utils import cdiv
from vllm.v1.attention.backends.abstract import (
    AttentionBackend,
    AttentionImpl,
    AttentionType,
    CommonAttentionMetadata,
    EncoderAttentionMetadata,
)


@dataclass(slots=True)
class ToyMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 (empty for cross-attention: read-only)
    block_table: torch.Tensor  # [num_tokens, max_blocks] int64: each token's request row
    key_limit: torch.Tensor  # [num_tokens] int64: the token attends to keys [0, key_limit)
    num_actual_tokens: int


@dataclass(slots=True)
class ToyGraphBuffers:
    slot_mapping: torch.Tensor  # [max_tokens] int64
    block_table: torch.Tensor  # [max_tokens, max_blocks] int64
    key_limit: torch.Tensor  # [max_tokens] int64


class ToyBackend(AttentionBackend):
    name = "toy"
    calls: ClassVar[collections.Counter[str]] = collections.Counter()

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def build_metadata(common: CommonAttentionMetadata, block_size: int,
                       device: torch.device, causal: bool = True) -> ToyMetadata:
        ToyBackend.calls["build_metadata"] += 1
        starts = common.query_start_loc
        n = common.num_actual_tokens
        req = np.repeat(np.arange(starts.shape[0] - 1), np.diff(starts))  # [num_tokens]
        if causal:
            # position = computed + the token's offset in its request; keys 0..position
            key_limit = common.num_computed_tokens[req] + np.arange(n) - starts[req] + 1
        else:
            key_limit = common.seq_lens[req]
        max_blocks = cdiv(int(common.seq_lens.max()), block_size)
        table = common.block_table[req, :max_blocks]
        return ToyMetadata(torch.from_numpy(common.slot_mapping).to(device),
                           torch.from_numpy(table.astype(np.int64)).to(device),
                           torch.from_numpy(key_limit.astype(np.int64)).to(device), n)

    @staticmethod
    def init_graph_buffers(max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                           device: torch.device) -> ToyGraphBuffers:
        ToyBackend.calls["init_graph_buffers"] += 1
        return ToyGraphBuffers(
            torch.zeros(max_num_tokens, dtype=torch.int64, device=device),
            torch.zeros(max_num_tokens, max_blocks_per_seq, dtype=torch.int64, device=device),
            torch.ones(max_num_tokens, dtype=torch.int64, device=device))

    @staticmethod
    def capture_metadata(buffers: object, num_tokens: int) -> ToyMetadata:
        ToyBackend.calls["capture_metadata"] += 1
        assert isinstance(buffers, ToyGraphBuffers)
        return ToyMetadata(buffers.slot_mapping[:num_tokens],
                           buffers.block_table[:num_tokens],
                           buffers.key_limit[:num_tokens], num_tokens)

    @staticmethod
    def prepare_replay(buffers: object, common: CommonAttentionMetadata,
                       num_tokens: int) -> None:
        ToyBackend.calls["prepare_replay"] += 1
        assert isinstance(buffers, ToyGraphBuffers)
        n = common.num_actual_tokens
        width = common.block_table.shape[1]
        buffers.slot_mapping[:n].copy_(torch.from_numpy(common.slot_mapping[:n]))
        buffers.block_table[:n, :width].copy_(torch.from_numpy(common.block_table[:n]))
        buffers.block_table[:n, width:].zero_()
        buffers.key_limit[:n].copy_(torch.from_numpy(common.seq_lens[:n]))  # decodes
        buffers.slot_mapping[n:num_tokens].zero_()  # padding: the null block's slot 0
        buffers.block_table[n:num_tokens].zero_()
        buffers.key_limit[n:num_tokens] = 1

    @staticmethod
    def make_impl(num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                  attn_type: AttentionType = AttentionType.DECODER,
                  sliding_window: int | None = None,
                  logits_soft_cap: float | None = None) -> ToyImpl:
        if sliding_window is not None or logits_soft_cap is not None:
            raise NotImplementedError("The toy backend has no sliding window or soft-cap.")
        return ToyImpl(num_heads, head_size, num_kv_heads, scale, attn_type)


class ToyImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 attn_type: AttentionType) -> None:
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = scale
        self.attn_type = attn_type

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        n = slot_mapping.shape[0]
        for i, rows in enumerate((key, value)):
            kv_cache[i].view(-1, self.num_kv_heads, self.head_size).index_copy_(
                0, slot_mapping, rows[:n])

    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor | None,
                metadata: object) -> torch.Tensor:
        if self.attn_type == AttentionType.ENCODER:
            assert isinstance(metadata, EncoderAttentionMetadata)
            assert key is not None and value is not None
            return self._encoder(query, key, value, metadata.query_start_loc)
        assert isinstance(metadata, ToyMetadata) and kv_cache is not None
        if self.attn_type == AttentionType.DECODER:
            assert key is not None and value is not None
            self.write_kv(key, value, kv_cache, metadata.slot_mapping)
        n = metadata.block_table.shape[0]
        # [n, max_blocks, block_size, kv_heads, d] -> [n, keys, kv_heads, d]
        k = kv_cache[0][metadata.block_table].view(n, -1, self.num_kv_heads, self.head_size)
        v = kv_cache[1][metadata.block_table].view(n, -1, self.num_kv_heads, self.head_size)
        visible = torch.arange(k.shape[1], device=k.device) < metadata.key_limit[:, None]
        return self._attend(query, k, v, visible[:, None, :])

    def _encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 starts: list[int]) -> torch.Tensor:
        out = query.new_empty(query.shape[0], self.num_heads * self.head_size)
        for start, end in zip(starts[:-1], starts[1:]):
            # Every query of the input sees every key of it: one row per query, same keys.
            q = query[start:end]
            k = key[start:end][None].expand(end - start, -1, -1, -1)
            v = value[start:end][None].expand(end - start, -1, -1, -1)
            out[start:end] = self._attend(q, k, v, None)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                visible: torch.Tensor | None) -> torch.Tensor:
        """q [n, heads, d], k/v [n, keys, kv_heads, d], visible [n, 1, keys] bool, in
        float64. Returns [n, heads * d]."""
        group = self.num_heads // self.num_kv_heads
        k = k.double().repeat_interleave(group, dim=2)
        v = v.double().repeat_interleave(group, dim=2)
        scores = torch.einsum("nhd,nkhd->nhk", q.double(), k) * self.scale
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("nhk,nkhd->nhd", scores.softmax(-1), v)
        return out.to(q.dtype).reshape(q.shape[0], -1)
