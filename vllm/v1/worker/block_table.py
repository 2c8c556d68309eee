"""`BlockTable`: each batch row's physical KV block ids, and slot mapping from it."""

from __future__ import annotations

import numpy as np

from vllm.utils import cdiv


class BlockTable:
    """A `[max_num_reqs, max_num_blocks_per_req]` int32 table; 0 (the null block) pads.

    With several KV cache groups (sliding-window models) a row holds the request's blocks
    interleaved by group, as the scheduler sends them: logical block i of group g in column
    i * num_groups + g; `group_table` reads one group's columns, `group_tables` and
    `compute_slot_mappings` every group's.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int,
                 num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.max_num_blocks_per_req = cdiv(max_model_len, block_size) * num_groups
        self.table = np.zeros((max_num_reqs, self.max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)

    def add_row(self, block_ids: list[int], row: int) -> None:
        self.num_blocks_per_row[row] = 0
        self.table[row] = 0
        self.append_row(block_ids, row)

    def append_row(self, block_ids: list[int], row: int) -> None:
        if not block_ids:
            return
        start = self.num_blocks_per_row[row]
        self.table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks_per_row[row] = start + len(block_ids)

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks_per_row[src]
        self.table[dst] = 0
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks_per_row[dst] = n

    def clear_row(self, row: int) -> None:
        self.table[row] = 0
        self.num_blocks_per_row[row] = 0

    def group_table(self, num_reqs: int, group: int = 0) -> np.ndarray:
        """Rows [:num_reqs] of one group's blocks, `[num_reqs, max_blocks]` (a view of the
        table itself when there is one group).
        e.g. two groups, row [5, 6, 7, 8, 0, 0]: group 0 [5, 7, 0], group 1 [6, 8, 0]."""
        if self.num_groups == 1:
            return self.table[:num_reqs]
        return np.ascontiguousarray(self.table[:num_reqs, group::self.num_groups])

    def group_tables(self, num_reqs: int, num_computed: np.ndarray | None = None,
                     windows: list[int | None] | None = None) -> np.ndarray:
        """Every group's rows [:num_reqs] at once, `[num_groups, num_reqs, max_blocks]`
        (`group_tables(n)[g]` is `group_table(n, g)`): a view of the table with one group
        and no window, else one copy. With `windows` (each group's sliding window or None)
        and the rows' `num_computed`, a window group's blocks wholly before the window
        (`out_of_window`) read as the null block: the scheduler may have freed and handed
        those to another request, so no read may reach them.
        e.g. two groups, row [5, 6, 7, 8, 0, 0]: [[[5, 7, 0]], [[6, 8, 0]]]; one group of
        window 5, block size 4, num_computed [10, 3], rows [[1, 2, 3], [4, 5, 0]]: row 0
        reads keys from position 6 (block 1) -> [[[0, 2, 3], [4, 5, 0]]]."""
        if self.num_groups == 1:
            tables = self.table[None, :num_reqs]
        else:
            rows = self.table[:num_reqs].reshape(num_reqs, -1, self.num_groups)
            tables = np.ascontiguousarray(rows.transpose(2, 0, 1))
        distinct = sorted({w for w in windows or () if w is not None})
        if not distinct:
            return tables
        assert num_computed is not None and windows is not None
        if tables.base is not None:  # a view of the live table
            tables = tables.copy()
        for window in distinct:  # one mask per distinct window (Gemma 3: five groups, one)
            groups = [g for g, w in enumerate(windows) if w == window]
            tables[groups] *= ~out_of_window(num_computed, window, self.block_size,
                                             tables.shape[2])
        return tables

    def compute_slot_mappings(self, req_indices: np.ndarray, positions: np.ndarray
                              ) -> np.ndarray:
        """The KV cache slot of every scheduled token in each group's blocks,
        `[num_groups, num_tokens]` int64:

        slot = table[req, pos // block_size * num_groups + group] * block_size
               + pos % block_size

        Example (one group, block size 16): rows 0 and 1 decode at positions 54 and 145
        with tables [1, 2, 3, 4, ...] and [5, 6, ..., 14, ...]; row 2 prefills from
        position 0 with table [15, ...]:
            block_numbers = [table[0, 3], table[1, 9], table[2, 0], table[2, 0]]
                          = [4, 14, 15, 15]
            offsets       = [54 % 16, 145 % 16, 0, 1] = [6, 1, 0, 1]
            slot_mapping  = [[4*16+6, 14*16+1, 15*16+0, 15*16+1]] = [[70, 225, 240, 241]]
        """
        flat = (req_indices * self.max_num_blocks_per_req
                + positions // self.block_size * self.num_groups)
        flat = flat[None, :] + np.arange(self.num_groups)[:, None]
        block_numbers = self.table.reshape(-1)[flat].astype(np.int64)
        return block_numbers * self.block_size + positions % self.block_size


def out_of_window(num_computed: np.ndarray, window: int, block_size: int,
                  num_blocks: int) -> np.ndarray:
    """`[rows, num_blocks]` bool: the blocks wholly before each row's window (the keys a
    step from `num_computed` tokens can read start at num_computed - window + 1)."""
    first = np.maximum(num_computed - window + 1, 0) // block_size
    return np.arange(num_blocks)[None, :] < first[:, None]
