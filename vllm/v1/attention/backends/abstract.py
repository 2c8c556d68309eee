"""The attention backend interface: metadata built once per step, one impl per layer, and
the persistent metadata that captured CUDA graphs read (graph buffers, capture metadata,
replay preparation)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

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
    # Every request one query token, the arrays views of the runner's persistent decode
    # buffers (`DecodeInputs`), refilled in place each step (`build_decode_metadata`).
    uniform_decode: bool = False
    # [num_tokens] int32 or None: where a step holds positions of bidirectional media spans
    # (`bidirectional_key_ends`), the end (exclusive) of the keys each query sees: its
    # span's end, else position + 1. Backends honour it in prefill attention or refuse.
    key_ends: np.ndarray | None = None

    @classmethod
    def padding_decodes(cls, num_tokens: int) -> CommonAttentionMetadata:
        """`num_tokens` one-token requests at position 0 whose K/V go to the null block's
        first slot: the layout of graph padding rows and of capture's dummy steps."""
        return cls(
            query_start_loc=np.arange(num_tokens + 1, dtype=np.int32),
            seq_lens=np.ones(num_tokens, dtype=np.int32),
            num_computed_tokens=np.zeros(num_tokens, dtype=np.int32),
            block_table=np.zeros((num_tokens, 1), dtype=np.int32),
            slot_mapping=np.zeros(num_tokens, dtype=np.int64),
            num_actual_tokens=num_tokens,
        )


class FusedAttention(NamedTuple):
    """A layer's attention as the fused CPU decoder computes it: causal, over the paged KV
    cache, a query at position p seeing keys (p - window, p] (window 0: every key), scores
    `soft_cap * tanh(score / soft_cap)` before the softmax where soft_cap > 0."""

    scale: float  # the softmax scale
    window: int
    soft_cap: float


class DecodeRows(NamedTuple):
    """A decode-only step's paged-cache layout as tensors, one row per request."""

    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    slot_mapping: torch.Tensor  # [num_reqs] int64


class AttentionBackend(ABC):
    """A way of computing paged attention, registered by name (`register_attn_backend` in
    `backends/__init__.py`) and chosen by `attention_backend` / `VLLM_ATTENTION_BACKEND`.

    Eager steps and CPU graphs (`CompiledGraphs`, where attention is an opaque op outside
    the compiled pieces) read `build_metadata`'s per-step metadata; CUDA graphs, which
    bake tensor addresses in, read the backend's graph buffers through the graph hooks.
    """

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
    def build_decode_metadata(common: CommonAttentionMetadata, block_size: int,
                              device: torch.device) -> object | None:
        """Metadata of a decode-only step (`common.uniform_decode`) that reads `common`'s
        arrays in place, never copying them: the runner refills those arrays each step and
        reuses this metadata for every later step of as many requests. None (the default)
        where the backend cannot: the runner then calls `build_metadata` every step."""
        return None

    @staticmethod
    def decode_rows(metadata: object) -> DecodeRows | None:
        """The block table, lengths and slots of a decode-only step's metadata (built by
        `build_decode_metadata`), which the fused CPU decoder reads in this backend's KV
        cache layout; None (the default) where the metadata holds none."""
        return None

    @staticmethod
    @abstractmethod
    def make_impl(num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                  attn_type: AttentionType = AttentionType.DECODER,
                  sliding_window: int | None = None,
                  logits_soft_cap: float | None = None) -> AttentionImpl:
        """The computation of one layer; a backend without `attn_type` (or the window /
        soft-cap) raises NotImplementedError naming it (at model construction, not at the
        first step)."""

    # ---- graph capture: the metadata a captured graph reads lives in buffers the
    # backend owns; `CudaGraphs` holds them opaquely and calls only these three hooks.
    #
    #   init_graph_buffers(max_num_tokens, ...)   once: every row padding
    #   capture_metadata(buffers, size)           per captured size: views of rows [:size]
    #   prepare_replay(buffers, common, size)     per replayed step: rows [:n] the step's,
    #                                             rows [n:size] padding

    @staticmethod
    @abstractmethod
    def init_graph_buffers(max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                           device: torch.device) -> object:
        """Persistent metadata for captured decode-only steps of up to `max_num_tokens`
        one-token requests, each reading at most `max_blocks_per_seq` blocks. Every row
        starts as padding: the layout of `CommonAttentionMetadata.padding_decodes`, a
        one-token sequence at the null block's first slot."""

    @staticmethod
    @abstractmethod
    def capture_metadata(buffers: object, num_tokens: int) -> object:
        """The metadata a graph of `num_tokens` decode rows is captured with: views of the
        first rows of `buffers`, so that each replay reads what `prepare_replay` staged."""

    @staticmethod
    @abstractmethod
    def prepare_replay(buffers: object, common: CommonAttentionMetadata,
                       num_tokens: int) -> None:
        """Stages a decode-only step (one token per request, `common.block_table` at most
        `max_blocks_per_seq` wide) into `buffers`, in place, for the graph of `num_tokens
        >= common.num_actual_tokens` rows: rows past the step's tokens become padding."""


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

    def fused_decode_attention(self) -> FusedAttention | None:
        """This layer's attention as the fused CPU decoder computes it in its place (decode
        queries over this backend's paged KV cache); None (the default) where it may not."""
        return None
