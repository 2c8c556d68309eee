"""`StageOutputCache`: per-token stage outputs (the last hidden states) kept beside the KV cache.

One CPU tensor per output kind, laid out like the KV cache's blocks, so that the block ids
and slot mapping the scheduler hands out for KV serve it unchanged:

    kind "hidden_states" (D = hidden_size):  [num_blocks, block_size, D]
    viewed flat:                             [num_blocks * block_size, D]
                                             row = block_id * block_size + offset in block

Every computed token's rows are written right after the forward, whoever asked for them, so a
block's rows live exactly as long as its KV: a prefix hit finds both, a block handed to
another request is overwritten in both. A finished request's rows are read back through its
own block ids, positions [0, num_tokens - 1): the last sampled token was never fed back, so
it has no hidden state. The cache never holds a per-request history of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.v1.core.sched.output import RowsToGather

HIDDEN_STATES = "hidden_states"


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One output kind: `dim` features per token, stored as `dtype`."""

    dim: int
    dtype: torch.dtype


class StageOutputCache:
    """Writes per-token outputs through slot mappings and reads a request's rows back.

    A cache with no output kinds is the disabled one: every call is a no-op.
    """

    def __init__(self, num_blocks: int, block_size: int, specs: dict[str, OutputSpec]) -> None:
        self.block_size = block_size
        self.tensors = {name: torch.zeros(num_blocks, block_size, spec.dim, dtype=spec.dtype)
                        for name, spec in specs.items()}
        # The same memory, one row per slot: [num_blocks * block_size, D].
        self._flat = {name: t.view(-1, t.shape[-1]) for name, t in self.tensors.items()}

    @staticmethod
    def block_bytes(block_size: int, specs: dict[str, OutputSpec]) -> int:
        """Bytes one block adds: block_size rows of every kind."""
        return sum(block_size * spec.dim * spec.dtype.itemsize for spec in specs.values())

    @property
    def enabled(self) -> bool:
        return bool(self.tensors)

    def write(self, slot_mapping: np.ndarray, **outputs: torch.Tensor) -> None:
        """Stores row i of every output at slot `slot_mapping[i]`.

        Args:
            slot_mapping: [num_tokens] int64, the step's KV slots.
            outputs: kind -> [num_tokens, D]; kinds the cache does not hold are ignored.
        """
        if not self._flat:
            return
        slots = torch.from_numpy(slot_mapping)
        for name, flat in self._flat.items():
            rows = outputs[name].detach().to(device=flat.device, dtype=flat.dtype)
            flat.index_copy_(0, slots, rows)

    def gather(self, block_ids: list[int], num_rows: int) -> dict[str, torch.Tensor]:
        """Copies of the rows of positions [0, num_rows) of a request holding `block_ids`.

        Example (block size 4): block ids [1, 4], num_rows 7:
            positions     = [0, 1, 2, 3, 4, 5, 6]
            block_numbers = block_ids[positions // 4] = [1, 1, 1, 1, 4, 4, 4]
            slots         = block_numbers * 4 + positions % 4 = [4, 5, 6, 7, 16, 17, 18]
        Only the request's own blocks are read; slot 19 (its unwritten tail) is not.
        """
        assert num_rows <= len(block_ids) * self.block_size
        positions = torch.arange(num_rows)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        slots = blocks[positions // self.block_size] * self.block_size \
            + positions % self.block_size
        return {name: flat[slots] for name, flat in self._flat.items()}

    def gather_finished(self, requests: list[RowsToGather]) -> dict[str, torch.Tensor]:
        """The hidden states of finished requests: req_id -> [num_rows, hidden_size]."""
        if not self._flat:
            return {}
        return {r.req_id: self.gather(r.block_ids, r.num_rows)[HIDDEN_STATES]
                for r in requests}
