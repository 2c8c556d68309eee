"""`DecodeInputs`: the inputs of a decode-only step written into persistent arrays.

Most steps of a running batch schedule one token per request. A one-token step's forward
streams the whole model through the CPU caches, so the step's own Python runs with cold
caches: every distinct numpy or torch call then costs tens of microseconds (a slice of a
tensor ~60 us, `np.flatnonzero` ~60 us, measured after a 64 MB sweep; under 2 us warm),
far more than its arithmetic. A decode step therefore touches as little as it can:

- the inputs live in arrays allocated once, written element by element in plain Python
  (a few scalar stores per request), or with a handful of whole-array operations when
  the batch is wide enough that a loop would cost more (`LOOP_MAX_ROWS`);
- everything a step of `n` rows hands on (tensor views of those arrays, the
  `CommonAttentionMetadata` of views, and the backend's metadata where it reads the
  arrays in place) is made the first time a step has `n` rows and reused after: a decode
  step allocates no tensor and makes no view.

The general `compute_step_indices` path keeps every other step (prefill chunks, drafts,
several KV cache groups, windows, encoder/decoder models, prompt-embeds positions).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.worker.input_batch import InputBatch

# Widest batch written row by row; wider batches take whole-array operations (a row costs
# ~1 us in the loop; the vectorised form ~15 cold calls, each ~10-60 us).
LOOP_MAX_ROWS = 64


class DecodeStep(NamedTuple):
    """Views of rows `[:n]` of the persistent arrays, made once per `n` (their contents
    are the latest `fill`'s)."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    common: CommonAttentionMetadata  # uniform_decode=True
    rows: np.ndarray  # [n] 0..n-1: every row samples
    logits_indices: torch.Tensor  # [n] int64 0..n-1: token r is row r's


class DecodeInputs:
    """Persistent decode-step inputs of an `InputBatch` with one KV cache group.

    Row r decodes the token at position p = num_computed[r] (the runner keeps
    `num_computed_tokens_cpu` current from the scheduler's deltas):

        positions[r]    = p
        seq_lens[r]     = p + 1
        input_ids[r]    = token_ids[r, p]
        slot_mapping[r] = block_table[r, p // block_size] * block_size + p % block_size

    Example (block size 16): num_computed [54, 145], table rows [1, 2, 3, 4, ...] and
    [5, 6, ..., 14, 15]: positions [54, 145], seq_lens [55, 146], block numbers
    [table[0, 3], table[1, 9]] = [4, 14], slots [4*16 + 6, 14*16 + 1] = [70, 225].
    """

    def __init__(self, batch: InputBatch, block_size: int) -> None:
        assert batch.block_table.num_groups == 1, "one KV cache group only"
        self.batch = batch
        self.block_size = block_size
        n = batch.max_num_reqs
        self.positions = np.zeros(n, dtype=np.int64)
        self.input_ids = np.zeros(n, dtype=np.int64)
        self.seq_lens = np.zeros(n, dtype=np.int32)
        self.num_computed = np.zeros(n, dtype=np.int32)
        self.slot_mapping = np.zeros(n, dtype=np.int64)
        self.query_start_loc = np.arange(n + 1, dtype=np.int32)  # one token a row
        self.ones = np.ones(n, dtype=np.int32)  # each row's scheduled tokens (LoRA)
        self.rows = np.arange(n, dtype=np.int64)
        self._input_ids_t = torch.from_numpy(self.input_ids)
        self._positions_t = torch.from_numpy(self.positions)
        self._rows_t = torch.from_numpy(self.rows)
        self._steps: dict[int, DecodeStep] = {}
        self.loop_max_rows = LOOP_MAX_ROWS

    def step(self, n: int) -> DecodeStep:
        """The views of a step of `n` rows (made on the first step of that size)."""
        step = self._steps.get(n)
        if step is None:
            common = CommonAttentionMetadata(
                query_start_loc=self.query_start_loc[:n + 1],
                seq_lens=self.seq_lens[:n],
                num_computed_tokens=self.num_computed[:n],
                block_table=self.batch.block_table.table[:n],
                slot_mapping=self.slot_mapping[:n],
                num_actual_tokens=n,
                uniform_decode=True,
            )
            step = self._steps[n] = DecodeStep(self._input_ids_t[:n], self._positions_t[:n],
                                               common, self.rows[:n], self._rows_t[:n])
        return step

    def fill(self, n: int) -> bool | None:
        """Writes the inputs of the batch's first `n` rows, one token each. Returns
        whether every row samples (False where a one-token prefill chunk stops short of
        its prompt's end), or None, writing nothing usable, where a row's token reads
        prompt embeds (the general path gathers those)."""
        if n > self.loop_max_rows:
            return self._fill_vectorised(n)
        batch, bs = self.batch, self.block_size
        token_ids, is_token, table = batch.token_ids_cpu, batch.is_token_ids, \
            batch.block_table.table
        num_tokens = batch.num_tokens
        samples = True
        for r, p in enumerate(batch.num_computed_tokens_cpu[:n].tolist()):
            if not is_token[r, p]:
                return None
            self.positions[r] = p
            self.num_computed[r] = p
            self.seq_lens[r] = p + 1
            self.input_ids[r] = token_ids[r, p]
            self.slot_mapping[r] = int(table[r, p // bs]) * bs + p % bs
            if p + 1 < num_tokens[r]:
                samples = False
        return samples

    def _fill_vectorised(self, n: int) -> bool | None:
        """`fill` for wide batches, the same values by whole-array operations."""
        batch, bs = self.batch, self.block_size
        positions = self.positions[:n]
        np.copyto(self.num_computed[:n], batch.num_computed_tokens_cpu[:n])
        np.copyto(positions, self.num_computed[:n])
        index = positions + self.rows[:n] * batch.max_model_len  # flat token index
        if not batch.is_token_ids.reshape(-1)[index].all():
            return None
        self.input_ids[:n] = batch.token_ids_cpu.reshape(-1)[index]
        np.add(self.num_computed[:n], 1, out=self.seq_lens[:n])
        table = batch.block_table
        index = positions // bs + self.rows[:n] * table.max_num_blocks_per_req
        slots = self.slot_mapping[:n]
        np.multiply(table.table.reshape(-1)[index], bs, out=slots, dtype=np.int64)
        slots += positions % bs
        return bool((self.seq_lens[:n] >= batch.num_tokens[:n]).all())
