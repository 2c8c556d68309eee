"""`DecodeInputs`: the inputs of a decode-only step written into persistent arrays.

Most steps of a running batch schedule one token per request. A one-token step's forward
streams the whole model through the CPU caches, so the step's own Python runs with cold
caches: every distinct numpy or torch call then costs tens of microseconds (a slice of a
tensor ~60 us, `np.flatnonzero` ~60 us, measured after a 64 MB sweep; under 2 us warm),
far more than its arithmetic. A decode step therefore touches as little as it can:

- the inputs live in arrays allocated once per batch size `n` (all at construction),
  written element by element in plain Python (a few scalar stores per request),
  or with a handful of whole-array operations when the batch is wide enough that a loop
  would cost more (`LOOP_MAX_ROWS`);
- everything a step of `n` rows hands on (those tensors, the `CommonAttentionMetadata`
  of their arrays, and the backend's metadata where it reads the arrays in place, which
  the runner builds for every size when it loads the model) is made once and reused: a
  decode step allocates no tensor and makes no view.

With several KV cache groups (sliding-window models) each group has its own slots, written
with the rows, and its own block table: the groups' tables de-interleaved in one copy a
step, with each window's blocks before the window masked (`BlockTable.group_tables`), so
those steps make one array and a `CommonAttentionMetadata` per group.

The general `compute_step_indices` path keeps every other step (prefill chunks, drafts,
encoder/decoder models, prompt-embeds positions).
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
    """The arrays of steps of `n` rows; `fill` rewrites their contents. The ids and
    positions own their storage (views of one wider buffer would differ from what a graph
    compiled for any size was traced with); the rest are views of arrays shared by every
    size (only one size is in use at a time)."""

    input_ids: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    common: CommonAttentionMetadata  # uniform_decode=True; arrays [n] (+1)
    rows: np.ndarray  # [n] 0..n-1: every row samples
    logits_indices: torch.Tensor  # [n] int64 0..n-1: token r is row r's
    input_ids_np: np.ndarray  # [n] int64, input_ids' memory
    positions_np: np.ndarray  # [n] int64, positions' memory


class DecodeInputs:
    """Persistent decode-step inputs of an `InputBatch` (`windows`: each KV cache group's
    sliding window or None; one group without a window by default).

    Row r decodes the token at position p = num_computed[r] (the runner keeps
    `num_computed_tokens_cpu` current from the scheduler's deltas):

        positions[r]    = p
        seq_lens[r]     = p + 1
        input_ids[r]    = token_ids[r, p]
        slot_mapping[r] = block_table[r, p // block_size] * block_size + p % block_size
                          (group g of G: block_table[r, (p // block_size) * G + g])

    Example (block size 16): num_computed [54, 145], table rows [1, 2, 3, 4, ...] and
    [5, 6, ..., 14, 15]: positions [54, 145], seq_lens [55, 146], block numbers
    [table[0, 3], table[1, 9]] = [4, 14], slots [4*16 + 6, 14*16 + 1] = [70, 225].
    """

    def __init__(self, batch: InputBatch, block_size: int,
                 windows: list[int | None] | None = None) -> None:
        self.windows = windows or [None]
        assert batch.block_table.num_groups == len(self.windows), "a window per group"
        self.batch = batch
        self.block_size = block_size
        # One group without a window: its table is read in place (no array a step).
        self.in_place = self.windows == [None]
        m = batch.max_num_reqs
        self.ones = np.ones(m, dtype=np.int32)  # each row's scheduled tokens (LoRA)
        seq_lens, num_computed = np.zeros(m, dtype=np.int32), np.zeros(m, dtype=np.int32)
        # Each group's slots (group 0's are the steps' `common.slot_mapping`).
        self.group_slots = np.zeros((len(self.windows), m), dtype=np.int64)
        slot_mapping = self.group_slots[0]
        query_start_loc = np.arange(m + 1, dtype=np.int32)  # one token a row
        # Inference tensors, as the general path's (made inside the step's inference mode):
        # a graph compiled for any size guards on it, and its guards are not evaluated.
        with torch.inference_mode():
            self._steps = self._make_steps(m, seq_lens, num_computed, slot_mapping,
                                           query_start_loc)
        self.loop_max_rows = LOOP_MAX_ROWS

    def _make_steps(self, m: int, seq_lens: np.ndarray, num_computed: np.ndarray,
                    slot_mapping: np.ndarray, query_start_loc: np.ndarray
                    ) -> dict[int, DecodeStep]:
        batch = self.batch
        rows = torch.arange(m, dtype=torch.int64)
        # Every size up front (16 bytes a row of each: ~0.5 MB for 256 sequences), so that
        # the tensors an engine holds stay the same from its first step on.
        steps: dict[int, DecodeStep] = {}
        for n in range(1, m + 1):
            input_ids, positions = torch.zeros(n, dtype=torch.int64), \
                torch.zeros(n, dtype=torch.int64)
            common = CommonAttentionMetadata(
                query_start_loc=query_start_loc[:n + 1], seq_lens=seq_lens[:n],
                num_computed_tokens=num_computed[:n], block_table=batch.block_table.table[:n],
                slot_mapping=slot_mapping[:n], num_actual_tokens=n, uniform_decode=True)
            steps[n] = DecodeStep(input_ids, positions, common, rows[:n].numpy(), rows[:n],
                                  input_ids.numpy(), positions.numpy())
        return steps

    def step(self, n: int) -> DecodeStep:
        """The arrays of steps of `n` rows (1 <= n <= max_num_reqs)."""
        return self._steps[n]

    def fill(self, n: int) -> tuple[DecodeStep, bool, list[CommonAttentionMetadata]] | None:
        """Writes the inputs of the batch's first `n` rows, one token each. Returns the
        step, whether every row samples (False where a one-token prefill chunk stops short
        of its prompt's end) and each KV cache group's layout (`[step.common]` with one
        group), or None, leaving nothing usable, where a row's token reads prompt embeds
        (the general path gathers those)."""
        step = self.step(n)
        samples = (self._fill_rows(step, n) if n <= self.loop_max_rows
                   else self._fill_vectorised(step, n))
        if samples is None:
            return None
        if self.in_place:
            return step, samples, [step.common]
        return step, samples, self._group_commons(step, n)

    def _group_commons(self, step: DecodeStep, n: int) -> list[CommonAttentionMetadata]:
        """Each group's layout: its slots, and its block table rows from this step's
        de-interleaved, window-masked copy (group 0's into `step.common`)."""
        common = step.common
        tables = self.batch.block_table.group_tables(n, common.num_computed_tokens,
                                                     self.windows)
        common.block_table = tables[0]
        return [common] + [
            CommonAttentionMetadata(
                query_start_loc=common.query_start_loc, seq_lens=common.seq_lens,
                num_computed_tokens=common.num_computed_tokens, block_table=tables[g],
                slot_mapping=self.group_slots[g, :n], num_actual_tokens=n, uniform_decode=True)
            for g in range(1, len(self.windows))]

    def _fill_rows(self, step: DecodeStep, n: int) -> bool | None:
        batch, bs, common = self.batch, self.block_size, step.common
        token_ids, is_token, table = batch.token_ids_cpu, batch.is_token_ids, \
            batch.block_table.table
        positions, input_ids, num_tokens = step.positions_np, step.input_ids_np, \
            batch.num_tokens
        seq_lens, num_computed, slots = common.seq_lens, common.num_computed_tokens, \
            common.slot_mapping
        num_groups, group_slots = len(self.windows), self.group_slots
        samples = True
        for r, p in enumerate(batch.num_computed_tokens_cpu[:n].tolist()):
            if not is_token[r, p]:
                return None
            positions[r] = p
            num_computed[r] = p
            seq_lens[r] = p + 1
            input_ids[r] = token_ids[r, p]
            # Logical block i of group g is in column i * num_groups + g.
            column = p // bs * num_groups
            slots[r] = int(table[r, column]) * bs + p % bs
            for g in range(1, num_groups):
                group_slots[g, r] = int(table[r, column + g]) * bs + p % bs
            if p + 1 < num_tokens[r]:
                samples = False
        return samples

    def _fill_vectorised(self, step: DecodeStep, n: int) -> bool | None:
        """`_fill_rows` for wide batches: the same values by whole-array operations."""
        batch, bs, common = self.batch, self.block_size, step.common
        positions = step.positions_np
        np.copyto(common.num_computed_tokens, batch.num_computed_tokens_cpu[:n])
        np.copyto(positions, common.num_computed_tokens)
        index = positions + step.rows * batch.max_model_len  # flat token index
        if not batch.is_token_ids.reshape(-1)[index].all():
            return None
        step.input_ids_np[:] = batch.token_ids_cpu.reshape(-1)[index]
        np.add(common.num_computed_tokens, 1, out=common.seq_lens)
        table = batch.block_table
        num_groups = len(self.windows)
        index = positions // bs * num_groups + step.rows * table.max_num_blocks_per_req
        offsets = positions % bs
        for g in range(num_groups):
            slots = self.group_slots[g, :n]
            np.multiply(table.table.reshape(-1)[index + g], bs, out=slots, dtype=np.int64)
            slots += offsets
        return bool((common.seq_lens >= batch.num_tokens[:n]).all())
