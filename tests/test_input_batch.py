"""Exact tests of `InputBatch`: rows added, removed and condensed, with every table moved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.core_factories import make_params
from vllm.v1.worker.block_table import BlockTable
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch

MAX_MODEL_LEN = 16
VOCAB = 50


def state(req_id: str, prompt: list[int], outputs: list[int] | None = None,
          block_ids: list[int] | None = None, embeds: torch.Tensor | None = None,
          num_computed: int = 0, **params) -> CachedRequestState:
    return CachedRequestState(req_id=req_id, prompt_token_ids=prompt, prompt_embeds=embeds,
                              sampling_params=make_params(**params), generator=None,
                              block_ids=list(block_ids or []), num_computed_tokens=num_computed,
                              output_token_ids=list(outputs or []))


def make_batch(max_num_reqs: int = 6) -> InputBatch:
    return InputBatch(max_num_reqs, MAX_MODEL_LEN, block_size=4, vocab_size=VOCAB)


def row_tokens(batch: InputBatch, row: int) -> list[int]:
    return batch.token_ids_cpu[row, :batch.num_tokens[row]].tolist()


def row_blocks(batch: InputBatch, row: int) -> list[int]:
    table = batch.block_table
    return table.table[row, :table.num_blocks_per_row[row]].tolist()


def five_rows() -> InputBatch:
    """Rows a..e: request i has prompt [10i, 10i+1], one output 10i+5, blocks [i+1]."""
    batch = make_batch()
    for i, req_id in enumerate("abcde"):
        batch.add_request(state(req_id, [10 * i, 10 * i + 1], [10 * i + 5], [i + 1],
                                num_computed=2, temperature=0.1 * (i + 1)))
    return batch


def test_add_request_fills_the_next_row() -> None:
    batch = make_batch()
    assert batch.add_request(state("a", [1, 2, 3], [4, 5], [7, 8], num_computed=4)) == 0
    assert batch.add_request(state("b", [9], block_ids=[3])) == 1
    assert batch.num_reqs == 2
    assert batch.req_ids_in_order == ["a", "b"]
    assert batch.req_id_to_index == {"a": 0, "b": 1}
    assert row_tokens(batch, 0) == [1, 2, 3, 4, 5]
    assert batch.is_token_ids[0, :5].tolist() == [True] * 5
    assert batch.num_prompt_tokens[:2].tolist() == [3, 1]
    assert batch.num_tokens[:2].tolist() == [5, 1]
    assert batch.num_computed_tokens_cpu[:2].tolist() == [4, 0]
    assert row_blocks(batch, 0) == [7, 8] and row_blocks(batch, 1) == [3]
    assert batch.block_table.table[0].tolist() == [7, 8, 0, 0]


def test_add_request_copies_sampling_params_into_rows() -> None:
    batch = make_batch()
    batch.add_request(state("a", [1], temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                            presence_penalty=0.5, frequency_penalty=-0.5,
                            repetition_penalty=1.5, min_tokens=3, logprobs=2))
    batch.add_request(state("b", [1], temperature=0.0, top_k=0))
    assert batch.temperature[:2].tolist() == [0.5, 0.0]
    assert batch.top_p[:2].tolist() == pytest.approx([0.9, 1.0])
    assert batch.top_k[:2].tolist() == [5, VOCAB]  # 0 (disabled) becomes the whole vocab
    assert batch.min_p[:2].tolist() == pytest.approx([0.1, 0.0])
    assert batch.presence_penalty[:2].tolist() == [0.5, 0.0]
    assert batch.frequency_penalty[:2].tolist() == [-0.5, 0.0]
    assert batch.repetition_penalty[:2].tolist() == [1.5, 1.0]
    assert batch.min_tokens[:2].tolist() == [3, 0]
    assert batch.num_logprobs[:2].tolist() == [2, -1]


def test_embeds_prompt_positions_are_not_token_ids() -> None:
    batch = make_batch()
    batch.add_request(state("e", [0, 0, 0], [7], embeds=torch.zeros(3, 4)))
    assert row_tokens(batch, 0) == [0, 0, 0, 7]
    assert batch.is_token_ids[0, :4].tolist() == [False, False, False, True]


def test_remove_then_condense_moves_last_rows_into_holes() -> None:
    batch = five_rows()
    assert batch.remove_request("b") == 1
    assert batch.remove_request("d") == 3
    assert batch.remove_request("zzz") is None
    # Before condensing, removed rows are holes with cleared block rows.
    assert batch.req_ids[:5] == ["a", None, "c", None, "e"]
    assert row_blocks(batch, 1) == [] and batch.block_table.table[1].tolist() == [0] * 4
    batch.condense()
    assert batch.num_reqs == 3
    assert batch.req_ids_in_order == ["a", "e", "c"]
    assert batch.req_ids[3:] == [None, None, None]
    assert batch.req_id_to_index == {"a": 0, "e": 1, "c": 2}
    assert [batch.req_states[i].req_id for i in range(3)] == ["a", "e", "c"]
    assert [row_tokens(batch, i) for i in range(3)] == [[0, 1, 5], [40, 41, 45],
                                                         [20, 21, 25]]
    assert [row_blocks(batch, i) for i in range(3)] == [[1], [5], [3]]
    assert batch.temperature[:3].tolist() == pytest.approx([0.1, 0.5, 0.3])
    assert batch.num_computed_tokens_cpu[:3].tolist() == [2, 2, 2]
    # The source row of the move is cleared in the block table.
    assert batch.block_table.table[4].tolist() == [0] * 4
    assert batch.block_table.num_blocks_per_row[4] == 0


def test_condense_moves_is_token_ids_with_the_row() -> None:
    batch = make_batch()
    batch.add_request(state("t", [1, 2]))
    batch.add_request(state("e", [0, 0, 0], [9], embeds=torch.zeros(3, 4), block_ids=[6]))
    batch.remove_request("t")
    batch.condense()
    assert batch.req_ids_in_order == ["e"]
    assert batch.is_token_ids[0, :4].tolist() == [False, False, False, True]
    assert row_tokens(batch, 0) == [0, 0, 0, 9]
    assert row_blocks(batch, 0) == [6]


def test_condense_after_removing_the_last_rows_moves_nothing() -> None:
    batch = five_rows()
    batch.remove_request("e")
    batch.remove_request("d")
    batch.condense()
    assert batch.req_ids_in_order == ["a", "b", "c"]
    assert [row_tokens(batch, i) for i in range(3)] == [[0, 1, 5], [10, 11, 15],
                                                         [20, 21, 25]]


def test_condense_with_holes_at_both_ends() -> None:
    batch = five_rows()
    for req_id in ("a", "b", "e"):
        batch.remove_request(req_id)
    batch.condense()
    assert batch.req_ids_in_order == ["d", "c"]
    assert [row_blocks(batch, i) for i in range(2)] == [[4], [3]]
    assert [row_tokens(batch, i) for i in range(2)] == [[30, 31, 35], [20, 21, 25]]


def test_remove_all_then_add_reuses_row_zero() -> None:
    batch = five_rows()
    for req_id in "abcde":
        batch.remove_request(req_id)
    batch.condense()
    assert batch.num_reqs == 0 and batch.req_id_to_index == {}
    assert batch.add_request(state("f", [7, 8], block_ids=[9])) == 0
    assert row_tokens(batch, 0) == [7, 8]
    assert row_blocks(batch, 0) == [9]


def test_add_after_condense_goes_after_the_last_row() -> None:
    batch = five_rows()
    batch.remove_request("a")
    batch.condense()
    assert batch.req_ids_in_order == ["e", "b", "c", "d"]
    assert batch.add_request(state("f", [7], block_ids=[9])) == 4
    assert row_blocks(batch, 4) == [9]


def test_append_token_extends_row_and_state() -> None:
    batch = make_batch()
    s = state("a", [1, 2])
    batch.add_request(s)
    batch.append_token(0, 33)
    batch.append_token(0, 34)
    assert row_tokens(batch, 0) == [1, 2, 33, 34]
    assert batch.is_token_ids[0, :4].tolist() == [True] * 4
    assert s.output_token_ids == [33, 34]
    assert s.num_tokens == 4


def test_append_token_past_max_model_len_only_counts() -> None:
    batch = make_batch()
    s = state("a", list(range(1, MAX_MODEL_LEN + 1)))
    batch.add_request(s)
    batch.append_token(0, 49)
    assert batch.num_tokens[0] == MAX_MODEL_LEN + 1
    assert batch.token_ids_cpu[0].tolist() == list(range(1, MAX_MODEL_LEN + 1))
    assert s.output_token_ids == [49]


def test_block_table_rows() -> None:
    table = BlockTable(max_num_reqs=3, max_model_len=10, block_size=4)
    assert table.max_num_blocks_per_req == 3
    table.add_row([5], 0)
    table.append_row([6, 7], 0)
    assert table.table[0].tolist() == [5, 6, 7]
    table.add_row([8], 0)  # add_row replaces the row
    assert table.table[0].tolist() == [8, 0, 0]
    table.add_row([1, 2], 2)
    table.move_row(2, 1)
    assert table.table.tolist() == [[8, 0, 0], [1, 2, 0], [1, 2, 0]]
    assert table.num_blocks_per_row.tolist() == [1, 2, 2]
    table.clear_row(2)
    assert table.table[2].tolist() == [0, 0, 0]
    assert table.num_blocks_per_row.tolist() == [1, 2, 0]
    assert table.table.dtype == np.int32
