"""Exact tests of input preparation: step indices, slot mapping and the runner's states.

The numbers are those of the design notes: the walkthrough (block size 2, max_model_len 12,
scheduled [3, 2, 5]) and the model-runner note (block size 16, max_model_len 240,
scheduled [1, 1, 93, 75, 30] with [54, 145, 0, 0, 0] computed).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.core_factories import (
    HIDDEN,
    cached,
    make_model_runner,
    make_params,
    make_request,
    make_runner_output,
    make_scheduler,
)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.sample.sampler import SamplerOutput
from vllm.v1.worker.block_table import BlockTable
from vllm.v1.worker.model_runner import ModelRunner
from vllm.v1.worker.step_inputs import compute_step_indices

# ---- compute_step_indices ---------------------------------------------------------------


def test_step_indices_walkthrough_first_step() -> None:
    idx = compute_step_indices(np.array([3, 2, 5]), np.array([0, 0, 0]), max_model_len=12)
    assert idx.req_indices.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert idx.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert idx.token_indices.tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
    assert idx.query_start_loc.tolist() == [0, 3, 5, 10]
    assert idx.seq_lens.tolist() == [3, 2, 5]


def test_step_indices_walkthrough_second_step() -> None:
    idx = compute_step_indices(np.array([1, 1, 3]), np.array([3, 2, 5]), max_model_len=12)
    assert idx.req_indices.tolist() == [0, 1, 2, 2, 2]
    assert idx.positions.tolist() == [3, 2, 5, 6, 7]
    assert idx.token_indices.tolist() == [3, 14, 29, 30, 31]
    assert idx.query_start_loc.tolist() == [0, 1, 2, 5]
    assert idx.seq_lens.tolist() == [4, 3, 8]


def design_note_indices():
    return compute_step_indices(np.array([1, 1, 93, 75, 30], dtype=np.int32),
                                np.array([54, 145, 0, 0, 0], dtype=np.int32),
                                max_model_len=240)


def test_step_indices_design_note() -> None:
    idx = design_note_indices()
    m = 240
    expected_req = [0, 1] + [2] * 93 + [3] * 75 + [4] * 30
    expected_pos = [54, 145, *range(93), *range(75), *range(30)]
    assert idx.req_indices.tolist() == expected_req
    assert idx.positions.tolist() == expected_pos
    assert idx.token_indices.tolist() == [
        54, 145 + m, *range(2 * m, 2 * m + 93), *range(3 * m, 3 * m + 75),
        *range(4 * m, 4 * m + 30)]
    assert idx.query_start_loc.tolist() == [0, 1, 2, 95, 170, 200]
    assert idx.seq_lens.tolist() == [55, 146, 93, 75, 30]


def test_step_indices_with_no_requests() -> None:
    idx = compute_step_indices(np.array([], dtype=np.int32), np.array([], dtype=np.int32), 12)
    assert idx.req_indices.tolist() == [] and idx.positions.tolist() == []
    assert idx.query_start_loc.tolist() == [0]
    assert idx.seq_lens.tolist() == []


# ---- BlockTable slot mapping ---------------------------------------------------------------


def test_slot_mapping_design_note() -> None:
    table = BlockTable(max_num_reqs=8, max_model_len=240, block_size=16)
    assert table.max_num_blocks_per_req == 15
    # Blocks handed out sequentially from 1: 4, 10, 6, 5 and 2 blocks.
    next_block = 1
    for row, n in enumerate([4, 10, 6, 5, 2]):
        table.add_row(list(range(next_block, next_block + n)), row)
        next_block += n
    assert table.table[:6].tolist() == [
        [1, 2, 3, 4] + [0] * 11,
        [5, 6, 7, 8, 9, 10, 11, 12, 13, 14] + [0] * 5,
        [15, 16, 17, 18, 19, 20] + [0] * 9,
        [21, 22, 23, 24, 25] + [0] * 10,
        [26, 27] + [0] * 13,
        [0] * 15,
    ]
    idx = design_note_indices()
    slots = table.compute_slot_mappings(idx.req_indices, idx.positions)[0]
    assert slots[:4].tolist() == [70, 225, 240, 241]
    assert slots[-1] == 445
    # Sequential blocks make each prefill a contiguous slot range.
    assert slots.tolist() == [70, 225, *range(240, 333), *range(336, 411), *range(416, 446)]
    assert slots.dtype == np.int64


def test_slot_mapping_walkthrough_block_size_2() -> None:
    table = BlockTable(max_num_reqs=4, max_model_len=12, block_size=2)
    table.add_row([1, 2], 0)
    table.add_row([3], 1)
    table.add_row([4, 5, 6], 2)
    assert table.table.tolist() == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0],
                                    [4, 5, 6, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    idx = compute_step_indices(np.array([3, 2, 5]), np.array([0, 0, 0]), 12)
    slots = table.compute_slot_mappings(idx.req_indices, idx.positions)[0]
    assert slots.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    # Step 2: blocks 7 and 8 appended to rows 1 and 2.
    table.append_row([], 0)
    table.append_row([7], 1)
    table.append_row([8], 2)
    assert table.table[:3].tolist() == [[1, 2, 0, 0, 0, 0], [3, 7, 0, 0, 0, 0],
                                        [4, 5, 6, 8, 0, 0]]
    idx = compute_step_indices(np.array([1, 1, 3]), np.array([3, 2, 5]), 12)
    assert table.compute_slot_mappings(idx.req_indices, idx.positions)[0].tolist() == [
        5, 14, 13, 16, 17]


# ---- the runner, driven by the real scheduler (no model) -----------------------------------


def run_step(runner: ModelRunner, out: SchedulerOutput, tokens: list[int]):
    """`execute_model` without the forward pass: the sampling rows 'sample' `tokens`."""
    runner._update_states(out)
    inputs = runner._prepare_inputs(out)
    sampled = torch.tensor(tokens[:len(inputs.sampling_rows)], dtype=torch.int64)
    result = runner._bookkeep(inputs.sampling_rows, SamplerOutput(sampled, None))
    return inputs, result


def table_rows(runner: ModelRunner) -> list[list[int]]:
    b = runner.input_batch
    return [b.block_table.table[i, :b.block_table.num_blocks_per_row[i]].tolist()
            for i in range(b.num_reqs)]


def walkthrough_setup() -> tuple[Scheduler, ModelRunner]:
    s = make_scheduler(block_size=2, max_num_batched_tokens=10, max_model_len=12)
    s.add_request(make_request("0", [10, 11, 12], max_tokens=1))
    s.add_request(make_request("1", [20, 21]))
    s.add_request(make_request("2", [30, 31, 32, 33, 34, 35, 36, 37]))
    return s, make_model_runner(block_size=2, max_model_len=12)


def test_runner_walkthrough_two_steps() -> None:
    s, runner = walkthrough_setup()
    out = s.schedule()
    inputs, result = run_step(runner, out, [40, 50])
    batch = runner.input_batch
    assert batch.req_ids_in_order == ["0", "1", "2"]
    assert inputs.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 31, 32, 33, 34]
    assert inputs.inputs_embeds is None
    assert inputs.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    md = inputs.attn_metadata
    assert md.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert md.query_start_loc.tolist() == [0, 3, 5, 10]
    assert md.seq_lens.tolist() == [3, 2, 5]
    assert md.num_computed_tokens.tolist() == [0, 0, 0]
    assert md.num_actual_tokens == 10
    assert md.block_table.tolist() == [[1, 2, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0],
                                       [4, 5, 6, 0, 0, 0]]
    # The whole prompt of request 2 is in the token table, though only 5 are scheduled.
    assert batch.token_ids_cpu[2, :8].tolist() == [30, 31, 32, 33, 34, 35, 36, 37]
    assert table_rows(runner) == [[1, 2], [3], [4, 5, 6]]
    # Rows 0 and 1 reach the end of their prompts and sample; row 2 is mid-prompt.
    assert inputs.sampling_rows.tolist() == [0, 1]
    assert inputs.logits_indices.tolist() == [2, 4]
    assert result.req_ids == ["0", "1", "2"]
    assert result.sampled_token_ids == [[40], [50], []]
    s.update_from_output(out, result)  # "0" finishes (max_tokens=1)

    # Step 2: "0" is gone, its row filled by the last row ("2"); "1" decodes.
    out = s.schedule()
    assert out.finished_req_ids == ["0"]
    inputs, result = run_step(runner, out, [51, 60])
    assert batch.req_ids_in_order == ["2", "1"]
    assert table_rows(runner) == [[4, 5, 6, 8], [3, 7]]
    assert batch.block_table.table[2].tolist() == [0] * 6
    assert inputs.input_ids.tolist() == [35, 36, 37, 50]
    assert inputs.positions.tolist() == [5, 6, 7, 2]
    md = inputs.attn_metadata
    assert md.slot_mapping.tolist() == [13, 16, 17, 14]
    assert md.query_start_loc.tolist() == [0, 3, 4]
    assert md.seq_lens.tolist() == [8, 3]
    assert md.num_computed_tokens.tolist() == [5, 2]
    assert inputs.sampling_rows.tolist() == [0, 1]
    assert inputs.logits_indices.tolist() == [2, 3]
    assert result.req_id_to_index == {"2": 0, "1": 1}
    assert result.sampled_token_ids == [[51], [60]]
    assert batch.token_ids_cpu[1, :4].tolist() == [20, 21, 50, 60]
    assert batch.token_ids_cpu[0, :9].tolist() == [30, 31, 32, 33, 34, 35, 36, 37, 51]
    assert runner.requests["1"].output_token_ids == [50, 60]
    outputs = s.update_from_output(out, result).outputs
    assert {o.request_id: o.new_token_ids for o in outputs} == {"2": [51], "1": [60]}


def test_runner_design_note_step() -> None:
    """The model-runner note through `_update_states` and `_prepare_inputs`: requests 0
    and 1 decode after 54 and 145 computed tokens, 2 and 3 prefill whole prompts of 93 and
    75 tokens, 4 prefills the first 30 of 40; blocks handed out sequentially from 1."""
    runner = make_model_runner(block_size=16, max_model_len=240, max_num_seqs=8)
    prompt_lens, computed, scheduled = [55, 146, 93, 75, 40], [54, 145, 0, 0, 0], \
        [1, 1, 93, 75, 30]
    num_blocks = [4, 10, 6, 5, 2]
    new_reqs, next_block = [], 1
    for i in range(5):
        prompt = [(i * 7 + p) % 97 for p in range(prompt_lens[i])]
        new_reqs.append(NewRequestData(
            req_id=str(i), prompt_token_ids=prompt, prompt_embeds=None, output_token_ids=[],
            sampling_params=make_params(),
            block_ids=list(range(next_block, next_block + num_blocks[i])),
            num_computed_tokens=computed[i]))
        next_block += num_blocks[i]
    out = SchedulerOutput(scheduled_new_reqs=new_reqs,
                          scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={str(i): n for i, n in enumerate(scheduled)},
                          total_num_scheduled_tokens=200, finished_req_ids=[])
    runner._update_states(out)
    inputs = runner._prepare_inputs(out)
    md = inputs.attn_metadata
    assert md.slot_mapping.tolist() == [70, 225, *range(240, 333), *range(336, 411),
                                        *range(416, 446)]
    assert md.query_start_loc.tolist() == [0, 1, 2, 95, 170, 200]
    assert md.seq_lens.tolist() == [55, 146, 93, 75, 30]
    assert md.block_table[:, :10].tolist() == [
        [1, 2, 3, 4, 0, 0, 0, 0, 0, 0], list(range(5, 15)), [15, 16, 17, 18, 19, 20, 0, 0, 0, 0],
        [21, 22, 23, 24, 25, 0, 0, 0, 0, 0], [26, 27, 0, 0, 0, 0, 0, 0, 0, 0]]
    assert inputs.positions.tolist() == [54, 145, *range(93), *range(75), *range(30)]
    prompts = [r.prompt_token_ids for r in new_reqs]
    assert inputs.input_ids.tolist() == [prompts[0][54], prompts[1][145], *prompts[2],
                                         *prompts[3], *prompts[4][:30]]
    # Request 4 stops short of its prompt's end: no logits for it.
    assert inputs.sampling_rows.tolist() == [0, 1, 2, 3]
    assert inputs.logits_indices.tolist() == [0, 1, 94, 169]


def test_runner_keeps_state_of_a_preempted_request_and_rebuilds_its_row() -> None:
    s = make_scheduler(num_blocks=5, enable_prefix_caching=False)
    runner = make_model_runner(block_size=4, max_model_len=64)
    s.add_request(make_request("a", [10, 11, 12, 13, 14, 15, 16], max_tokens=4))
    s.add_request(make_request("b", [20, 21, 22, 23, 24, 25, 26], seed=7, temperature=1.0))
    preempted = []
    for tokens in ([100, 200], [101, 201], [102], [103]):
        out = s.schedule()
        _, result = run_step(runner, out, tokens)
        s.update_from_output(out, result)
        preempted.append(out.preempted_req_ids)
    assert preempted == [[], [], ["b"], []]
    # b left the batch but the runner keeps its state, seeded generator included.
    assert runner.input_batch.req_ids_in_order == ["a"]
    generator = runner.requests["b"].generator
    assert generator is not None
    out = s.schedule()
    assert out.finished_req_ids == ["a"]
    inputs, _ = run_step(runner, out, [202])
    assert runner.input_batch.req_ids_in_order == ["b"]
    assert "a" not in runner.requests
    assert runner.requests["b"].generator is generator
    assert table_rows(runner) == [[3, 4, 2]]
    assert inputs.input_ids.tolist() == [20, 21, 22, 23, 24, 25, 26, 200, 201]
    assert inputs.positions.tolist() == list(range(9))
    assert inputs.logits_indices.tolist() == [8]
    assert runner.requests["b"].output_token_ids == [200, 201, 202]


def test_runner_readds_a_request_skipped_for_a_step() -> None:
    # Separate embeds batching: t1 is running when an older embeds request e0 arrives, so
    # the next step is embeds-only and t1 sits it out; it then comes back as a cached
    # request whose row the runner must rebuild (with the block it gains meanwhile).
    s = make_scheduler(prompt_embeds_batching="separate")
    runner = make_model_runner(block_size=4, max_model_len=64)
    s.add_request(make_request("t1", list(range(10, 18)), max_tokens=3, arrival_time=2.0))
    out = s.schedule()
    _, result = run_step(runner, out, [18])
    s.update_from_output(out, result)
    assert table_rows(runner) == [[1, 2]]

    rows = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    s.add_request(make_request("e0", prompt_embeds=rows, max_tokens=1, arrival_time=1.0))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"e0": 3}
    inputs, result = run_step(runner, out, [19])
    assert runner.input_batch.req_ids_in_order == ["e0"]
    assert "t1" in runner.requests  # out of the batch, state kept
    assert inputs.input_ids is None
    assert torch.equal(inputs.inputs_embeds, rows)
    assert inputs.attn_metadata.slot_mapping.tolist() == [12, 13, 14]
    s.update_from_output(out, result)  # e0 finishes, block 3 goes back to the pool

    out = s.schedule()
    assert cached(out) == [("t1", [4], 8)]
    inputs, result = run_step(runner, out, [20])
    assert runner.input_batch.req_ids_in_order == ["t1"]
    assert table_rows(runner) == [[1, 2, 4]]
    assert runner.input_batch.token_ids_cpu[0, :10].tolist() == list(range(10, 18)) + [18, 20]
    assert inputs.input_ids.tolist() == [18]
    assert inputs.positions.tolist() == [8]
    assert inputs.attn_metadata.slot_mapping.tolist() == [16]
    assert runner.requests["t1"].output_token_ids == [18, 20]


def test_runner_gathers_prompt_embeds_rows_and_token_embeddings() -> None:
    runner = make_model_runner(block_size=4, max_model_len=32)
    rows = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(1))
    # A resumed embeds request: 4 embeds rows E0..E3 and a generated token 9; 2 positions
    # computed (a prefix hit), 3 scheduled: positions 2, 3, 4 -> [E2, E3, embed(9)].
    embeds_req = NewRequestData(req_id="e", prompt_token_ids=[0, 0, 0, 0], prompt_embeds=rows,
                                output_token_ids=[9], sampling_params=make_params(),
                                block_ids=[1, 2], num_computed_tokens=2)
    token_req = NewRequestData(req_id="t", prompt_token_ids=[5, 6], prompt_embeds=None,
                               output_token_ids=[], sampling_params=make_params(),
                               block_ids=[3], num_computed_tokens=0)
    out = SchedulerOutput(scheduled_new_reqs=[embeds_req, token_req],
                          scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"e": 3, "t": 2},
                          total_num_scheduled_tokens=5, finished_req_ids=[])
    runner._update_states(out)
    batch = runner.input_batch
    assert batch.is_token_ids[0, :5].tolist() == [False, False, False, False, True]
    assert batch.token_ids_cpu[0, :5].tolist() == [0, 0, 0, 0, 9]
    inputs = runner._prepare_inputs(out)
    assert inputs.input_ids is None
    expected = torch.stack([rows[2], rows[3], torch.full((HIDDEN,), 9.0),
                            torch.full((HIDDEN,), 5.0), torch.full((HIDDEN,), 6.0)])
    assert torch.equal(inputs.inputs_embeds, expected)
    assert inputs.positions.tolist() == [2, 3, 4, 0, 1]
    assert inputs.attn_metadata.slot_mapping.tolist() == [6, 7, 8, 12, 13]
    assert inputs.sampling_rows.tolist() == [0, 1]
    assert inputs.logits_indices.tolist() == [2, 4]


def test_runner_empty_step_forgets_finished_requests() -> None:
    s, runner = walkthrough_setup()
    out = s.schedule()
    _, result = run_step(runner, out, [40, 50])
    s.update_from_output(out, result)
    s.finish_requests(["1", "2"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.total_num_scheduled_tokens == 0
    assert runner.execute_model(out) == ModelRunnerOutput([], {}, [], None)
    assert runner.input_batch.num_reqs == 0
    assert runner.requests == {}


def test_make_runner_output_matches_the_runner_layout() -> None:
    s, runner = walkthrough_setup()
    out = s.schedule()
    _, result = run_step(runner, out, [40, 50])
    assert make_runner_output(out, {"0": [40], "1": [50]}) == result


# ---- scheduler + runner simulation -------------------------------------------------------------


def position_key(request, position: int) -> tuple:
    """What the KV at `position` of `request` depends on: every input up to it."""
    parts = []
    for p in range(position + 1):
        if request.prompt_embeds is not None and p < request.num_prompt_tokens:
            parts.append(tuple(request.prompt_embeds[p].tolist()))
        else:
            parts.append(request.all_token_ids[p])
    return tuple(parts)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("caching", "chunked"), [(True, True), (True, False), (False, True)])
def test_simulated_run_keeps_runner_and_kv_contents_consistent(seed: int, caching: bool,
                                                              chunked: bool) -> None:
    """Random arrivals, aborts, prefix hits and preemptions on a small pool. Every step the
    runner's rows must mirror the scheduler's requests, and every position a request
    attends to must hold the KV written for exactly its own inputs (a stand-in cache
    records, per slot, which inputs were written there). Everything drains at the end."""
    rng = random.Random(seed)
    block_size, max_model_len = 2, 32
    s = make_scheduler(block_size=block_size, num_blocks=18, max_model_len=max_model_len,
                       max_num_batched_tokens=12 if chunked else max_model_len,
                       max_num_seqs=4, enable_chunked_prefill=chunked,
                       enable_prefix_caching=caching)
    runner = make_model_runner(block_size=block_size, max_model_len=max_model_len)
    shared = [rng.randint(3, 50) for _ in range(8)]
    kv: dict[int, tuple] = {}
    for step_no in range(400):
        if step_no < 100 and rng.random() < 0.4:
            n = rng.randint(1, 16)
            if rng.random() < 0.3:
                rows = torch.full((n, HIDDEN), float(rng.randint(0, 1)))
                s.add_request(make_request(f"r{step_no}", prompt_embeds=rows,
                                           max_tokens=rng.randint(1, 8)))
            else:
                k = rng.randint(0, min(n, 8))
                prompt = shared[:k] + [rng.randint(3, 50) for _ in range(n - k)]
                s.add_request(make_request(f"r{step_no}", prompt, ignore_eos=True,
                                           max_tokens=rng.randint(1, 8)))
        if step_no < 100 and rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        if not s.has_requests():
            continue
        out = s.schedule()
        runner._update_states(out)
        batch = runner.input_batch
        assert sorted(batch.req_ids_in_order) == sorted(out.num_scheduled_tokens)
        if out.total_num_scheduled_tokens == 0:
            continue
        inputs = runner._prepare_inputs(out)
        slots = inputs.attn_metadata.slot_mapping.tolist()
        qsl = np.cumsum([0] + [out.num_scheduled_tokens[r] for r in batch.req_ids_in_order])
        rows = table_rows(runner)
        for row, req_id in enumerate(batch.req_ids_in_order):
            request = s.requests[req_id]
            assert rows[row] == s.kv_cache_manager.get_block_ids(req_id)
            assert batch.token_ids_cpu[row, :request.num_tokens].tolist() == \
                request.all_token_ids
            computed = int(batch.num_computed_tokens_cpu[row])
            assert computed + out.num_scheduled_tokens[req_id] == request.num_computed_tokens
            for t in range(qsl[row], qsl[row + 1]):
                kv[slots[t]] = position_key(request, computed + t - qsl[row])
            for p in range(request.num_computed_tokens):
                slot = int(batch.block_table.table[row, p // block_size]) * block_size \
                    + p % block_size
                assert kv.get(slot) == position_key(request, p), (step_no, req_id, p)
        tokens = torch.tensor([rng.randint(3, 50) for _ in inputs.sampling_rows])
        s.update_from_output(out, runner._bookkeep(inputs.sampling_rows,
                                                   SamplerOutput(tokens, None)))
    assert not s.has_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 17
    assert runner.requests == {} and runner.input_batch.num_reqs == 0
