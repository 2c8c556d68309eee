"""The attention backend interface: metadata built once per step, one impl per layer."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


class AttentionType(enum.Enum):
    """What an attention layer attends to.

    DECODER: causal self-attention over the request's paged KV cache (written as it goes).
    ENCODER: bidirectional self-attention within each request's encoder input; no cache.
    ENCODER_DECODER: decoder queries over all of the request's cross-attention blocks
        (written once by the encoder pass, read-only here).
    """

    DECODER = "decoder"
    ENCODER = "encoder"
    ENCODER_DECODER = "encoder_decoder"


@dataclass(slots=True)
class EncoderAttentionMetadata:
    """The encoder inputs of one encoder pass, concatenated: input i is tokens
    `query_start_loc[i]:query_start_loc[i + 1]`."""

    query_start_loc: list[int]  # [num_inputs + 1]
    uniform_len: int | None  # every input this long (Whisper: 1500): one batched call

    @classmethod
    def from_lens(cls, lens: list[int]) -> EncoderAttentionMetadata:
        starts = [0]
        for length in lens:
            starts.append(starts[-1] + length)
        return cls(starts, lens[0] if len(set(lens)) == 1 else None)


@dataclass(slots=True)
class CommonAttentionMetadata:
    """Backend-independent description of one step's batch, as CPU numpy arrays.

    Requests are in batch order; tokens of request i are
    `query_start_loc[i]:query_start_loc[i + 1]`.
    """

    query_start_loc: np.ndarray  # [num_reqs + 1] int32
    seq_lens: np.ndarray  # [num_reqs] int32, computed + scheduled
    num_computed_tokens: np.ndarray  # [num_reqs] int32
    block_table: np.ndarray  # [num_reqs, max_num_blocks_per_req] int32
    slot_mapping: np.ndarray  # [num_tokens] int64
    num_actual_tokens: int


class AttentionBackend(ABC):
    """A way of computing paged attention; registered by name in `backends/__init__.py`."""

    name: str

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        ...

    @staticmethod
    @abstractmethod
    def build_metadata(common: CommonAttentionMetadata, block_size: int,
                       device: torch.device, causal: bool = True) -> object:
        """Metadata of one step. `causal=False` describes cross-attention: `seq_lens` and
        `block_table` are then the encoder lengths and the cross-attention blocks, and
        every query sees all `seq_len` keys."""

    @staticmethod
    @abstractmethod
    def build_graph_decode_metadata(slot_mapping: torch.Tensor, block_table: torch.Tensor,
                                    decode_mask: torch.Tensor) -> object:
        """Metadata of a captured decode-only step (CUDA graphs): one token per row, in
        views of persistent buffers that every replay refills in place: `slot_mapping`
        `[n]`, `block_table` `[n, max_blocks]` int64, `decode_mask`
        `[n, 1, 1, max_blocks * block_size]` bool (True = attend)."""

    @staticmethod
    @abstractmethod
    def make_impl(num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                  attn_type: AttentionType = AttentionType.DECODER) -> AttentionImpl:
        ...


class AttentionImpl(ABC):
    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, kv_cache: torch.Tensor | None,
                metadata: object) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size], key/value [num_tokens, num_kv_heads,
        head_size] (None for cross-attention, which reads the cache); DECODER writes
        key/value into kv_cache first. Returns [num_tokens, num_heads * head_size]."""

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Stores key/value rows [n, num_kv_heads, head_size] at flat cache slots [n]."""
