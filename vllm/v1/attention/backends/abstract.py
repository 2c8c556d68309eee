"""The attention backend interface: metadata built once per step, one impl per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


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
                       device: torch.device) -> object:
        ...

    @staticmethod
    @abstractmethod
    def make_impl(num_heads: int, head_size: int, num_kv_heads: int,
                  scale: float) -> AttentionImpl:
        ...


class AttentionImpl(ABC):
    @abstractmethod
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: object) -> torch.Tensor:
        """query [num_tokens, num_heads, head_size], key/value [num_tokens, num_kv_heads,
        head_size]; writes key/value into kv_cache and returns [num_tokens, num_heads *
        head_size]."""
