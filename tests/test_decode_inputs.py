"""Exact tests of decode-only steps' persistent inputs (`DecodeInputs`): positions, sequence
lengths, input ids and slot mappings over several steps, across a block boundary, after a
preemption, and against the general input preparation on a random run."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.core_factories import (
    HIDDEN,
    make_model_runner,
    make_params,
    make_request,
    make_scheduler,
)
from tests.test_input_prep import run_step
from vllm.v1.attention.backends.abstract import CommonAttentionMetadata
from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.sample.sampler import SamplerOutput
from vllm.v1.worker.model_runner import ModelRunner
from vllm.v1.worker.step_inputs import ModelInputs


def test_design_note_decode_rows() -> None:
    """Rows 0 and 1 of the model-runner note (block size 16): 54 and 145 computed."""
    runner = make_model_runner(block_size=16, max_model_len=240)
    prompts = [[(7 * i + p) % 97 for p in range(n)] for i, n in enumerate((55, 146))]
    blocks = [[1, 2, 3, 4], list(range(5, 15))]
    new = [NewRequestData(req_id=str(i), prompt_token_ids=prompts[i], prompt_embeds=None,
                          output_token_ids=[], sampling_params=make_params(),
                          block_ids=blocks[i], num_computed_tokens=(54, 145)[i])
           for i in range(2)]
    out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"0": 1, "1": 1}, total_num_scheduled_tokens=2,
                          finished_req_ids=[])
    runner._update_states(out)
    inputs = runner._prepare_inputs(out)
    md = _common(inputs)
    assert md.uniform_decode
    assert inputs.positions.tolist() == [54, 145]
    assert inputs.input_ids.tolist() == [prompts[0][54], prompts[1][145]]
    assert md.seq_lens.tolist() == [55, 146]
    assert md.num_computed_tokens.tolist() == [54, 145]
    assert md.query_start_loc.tolist() == [0, 1, 2]
    assert md.slot_mapping.tolist() == [4 * 16 + 6, 14 * 16 + 1]
    assert inputs.sampling_rows.tolist() == [0, 1]
    assert inputs.logits_indices.tolist() == [0, 1]
    assert inputs.input_ids.dtype == inputs.positions.dtype == torch.int64


def test_decode_steps_across_a_block_boundary_and_a_preemption() -> None:
    """Block size 4, a 3-token prompt: decode positions 3, 4 (first slot of a new block),
    5; "b" is preempted when the pool runs dry, then resumes as a new request and decodes
    again into its re-allocated blocks."""
    s = make_scheduler(block_size=4, num_blocks=5, enable_prefix_caching=False)
    runner = make_model_runner(block_size=4, max_model_len=64)
    s.add_request(make_request("a", [10, 11, 12], max_tokens=8, ignore_eos=True))
    s.add_request(make_request("b", [20, 21, 22, 23, 24, 25, 26], max_tokens=8,
                               ignore_eos=True))
    seen = []
    for tokens in ([100, 200], [101, 201], [102, 202], [103, 203]):
        out = s.schedule()
        inputs, result = run_step(runner, out, tokens)
        s.update_from_output(out, result)
        md = _common(inputs)
        seen.append((out.preempted_req_ids, md.uniform_decode,
                     runner.input_batch.req_ids_in_order, inputs.positions.tolist(),
                     inputs.input_ids.tolist(), md.seq_lens.tolist(),
                     md.slot_mapping.tolist()))
    # Blocks: a [1], b [2, 3] for the prompts; a gains 4 at position 4; b gains none at
    # position 7, needs one at position 8 and the pool (4 usable) is dry: b is preempted.
    assert seen == [
        ([], False, ["a", "b"], [0, 1, 2, 0, 1, 2, 3, 4, 5, 6],
         [10, 11, 12, 20, 21, 22, 23, 24, 25, 26], [3, 7],
         [4, 5, 6, 8, 9, 10, 11, 12, 13, 14]),
        ([], True, ["a", "b"], [3, 7], [100, 200], [4, 8], [7, 15]),
        (["b"], True, ["a"], [4], [101], [5], [16]),
        ([], True, ["a"], [5], [102], [6], [17]),
    ]
    assert runner.requests["b"].output_token_ids == [200, 201]  # kept while preempted
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()  # b resumes: prompt and its two tokens recomputed in one prefill
    inputs, result = run_step(runner, out, [202])
    s.update_from_output(out, result)
    assert inputs.positions.tolist() == list(range(9))
    out = s.schedule()
    inputs, _ = run_step(runner, out, [203])
    md = _common(inputs)
    assert md.uniform_decode and runner.input_batch.req_ids_in_order == ["b"]
    blocks = s.kv_cache_manager.get_block_ids("b")
    assert inputs.positions.tolist() == [9] and inputs.input_ids.tolist() == [202]
    assert md.seq_lens.tolist() == [10]
    assert md.slot_mapping.tolist() == [blocks[2] * 4 + 1]
    assert md.block_table[0, :3].tolist() == blocks


def test_a_one_token_step_reading_prompt_embeds_takes_the_general_path() -> None:
    """Rows decode one token each, but row 0's is the last of its prompt embeds: the
    general path gathers its row (`DecodeInputs.fill` declines)."""
    runner = make_model_runner(block_size=4, max_model_len=32)
    rows = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    new = [NewRequestData(req_id="e", prompt_token_ids=[0, 0, 0], prompt_embeds=rows,
                          output_token_ids=[], sampling_params=make_params(), block_ids=[1],
                          num_computed_tokens=2),
           NewRequestData(req_id="t", prompt_token_ids=[5, 6], prompt_embeds=None,
                          output_token_ids=[], sampling_params=make_params(), block_ids=[2],
                          num_computed_tokens=1)]
    out = SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData(),
                          num_scheduled_tokens={"e": 1, "t": 1}, total_num_scheduled_tokens=2,
                          finished_req_ids=[])
    runner._update_states(out)
    inputs = runner._prepare_inputs(out)
    assert not _common(inputs).uniform_decode
    assert inputs.input_ids is None
    assert torch.equal(inputs.inputs_embeds,
                       torch.stack([rows[2], torch.full((HIDDEN,), 6.0)]))
    assert _common(inputs).slot_mapping.tolist() == [6, 9]


def _common(inputs: ModelInputs) -> CommonAttentionMetadata:
    """The step's metadata: `CommonMetadataBackend` hands on the common one itself."""
    assert isinstance(inputs.attn_metadata, CommonAttentionMetadata)
    return inputs.attn_metadata


def _general(runner: ModelRunner, out: SchedulerOutput) -> ModelInputs:
    decode, runner.step_inputs.decode_inputs = runner.step_inputs.decode_inputs, None
    try:
        return runner._prepare_inputs(out)
    finally:
        runner.step_inputs.decode_inputs = decode


WINDOWED = [None, 5, 5]  # three KV cache groups: full attention, two of window 5


@pytest.mark.parametrize(("seed", "loop_max_rows", "windows"),
                         [(0, 64, None), (1, 64, None), (2, 2, None), (3, 0, None),
                          (4, 64, WINDOWED), (5, 0, WINDOWED)])
def test_decode_path_matches_the_general_path(seed: int, loop_max_rows: int,
                                              windows: list[int | None] | None) -> None:
    """Random arrivals (some with prompt embeds), aborts, chunked prefill and preemptions:
    every decode-only step's inputs equal those the general path builds from the same
    state, field by field (block tables up to the general path's width), in every KV cache
    group (a sliding-window model's: each group's slots, and its table with the blocks
    before its window masked). Rows are written one by one, or by whole-array operations
    past `loop_max_rows`."""
    rng = random.Random(seed)
    runner = make_model_runner(block_size=2, max_model_len=32, windows=windows)
    groups = runner.model_config.kv_cache_groups
    assert len(groups) == (1 if windows is None else 3)
    s = make_scheduler(block_size=2, num_blocks=24 * len(groups), max_model_len=32,
                       max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True,
                       kv_cache_groups=groups)
    assert runner.step_inputs.decode_inputs is not None
    runner.step_inputs.decode_inputs.loop_max_rows = loop_max_rows
    num_decode_steps = masked_steps = 0
    for step_no in range(300):
        if step_no < 80 and rng.random() < 0.3:
            n = rng.randint(1, 10)
            if rng.random() < 0.2:
                s.add_request(make_request(f"r{step_no}", prompt_embeds=torch.ones(n, HIDDEN),
                                           max_tokens=rng.randint(1, 10)))
            else:
                s.add_request(make_request(f"r{step_no}", [rng.randint(3, 50)
                                                           for _ in range(n)],
                                           ignore_eos=True, max_tokens=rng.randint(1, 10)))
        if step_no < 80 and rng.random() < 0.05 and s.requests:
            s.finish_requests([rng.choice(list(s.requests))], RequestStatus.FINISHED_ABORTED)
        if not s.has_requests():
            continue
        out = s.schedule()
        runner._update_states(out)
        if out.total_num_scheduled_tokens == 0:
            continue
        inputs = runner._prepare_inputs(out)
        if _common(inputs).uniform_decode:
            num_decode_steps += 1
            general = _general(runner, out)
            for field in ("input_ids", "positions", "logits_indices"):
                assert getattr(inputs, field).tolist() == getattr(general, field).tolist()
            assert inputs.sampling_rows.tolist() == general.sampling_rows.tolist()
            assert _common(inputs) is inputs.group_commons[0]
            assert len(inputs.group_commons) == len(general.group_commons) == len(groups)
            for fast, slow in zip(inputs.group_commons, general.group_commons):
                for field in ("query_start_loc", "seq_lens", "num_computed_tokens",
                              "slot_mapping"):
                    assert getattr(fast, field).tolist() == getattr(slow, field).tolist(), field
                width = slow.block_table.shape[1]
                assert np.array_equal(fast.block_table[:, :width], slow.block_table)
                assert fast.num_actual_tokens == slow.num_actual_tokens
            if windows is not None:  # layer l reads group l's metadata (the common itself)
                assert inputs.layer_attn_metadata is not None
                assert all(m is c for m, c in zip(inputs.layer_attn_metadata,
                                                  inputs.group_commons, strict=True))
                n = len(inputs.sampling_rows)
                masked_steps += any(
                    not np.array_equal(c.block_table, runner.input_batch.block_table.group_table(
                        n, g)) for g, c in enumerate(inputs.group_commons))
        tokens = torch.tensor([rng.randint(3, 50) for _ in inputs.sampling_rows])
        s.update_from_output(out, runner._bookkeep(inputs.sampling_rows,
                                                   SamplerOutput(tokens, None)))
    assert num_decode_steps > 20
    assert masked_steps > 0 or windows is None  # some window hid blocks
    assert not s.has_requests()


def test_native_decode_metadata_is_built_once_per_size_and_reads_the_buffers() -> None:
    """With the CPU backend's native kernels, a step of n decode rows reuses the metadata
    of the first step of n rows, whose tensors share the refilled arrays."""
    s = make_scheduler(block_size=4, num_blocks=16)
    runner = make_model_runner(block_size=4, max_model_len=64)
    runner.attn_backend = TorchSDPABackend
    s.add_request(make_request("a", [10, 11, 12], max_tokens=6, ignore_eos=True))
    s.add_request(make_request("b", [20, 21], max_tokens=6, ignore_eos=True))
    metadata = []
    for tokens in ([100, 200], [101, 201], [102, 202], [103, 203]):
        out = s.schedule()
        inputs, result = run_step(runner, out, tokens)
        s.update_from_output(out, result)
        md = inputs.attn_metadata
        assert isinstance(md, TorchSDPAMetadata)
        metadata.append(md)
        if len(metadata) > 1:  # decode steps: positions 3 and 2, then 4 and 3, ...
            step = len(metadata) - 2
            assert md.decode_only and md.prefills == []
            assert md.decode_seq_lens.tolist() == [4 + step, 3 + step]
            blocks = [s.kv_cache_manager.get_block_ids(r) for r in ("a", "b")]
            assert md.slot_mapping.tolist() == [
                blocks[0][(3 + step) // 4] * 4 + (3 + step) % 4,
                blocks[1][(2 + step) // 4] * 4 + (2 + step) % 4]
            assert md.decode_block_table_i32[:, :2].tolist() == [
                (blocks[0] + [0])[:2], (blocks[1] + [0])[:2]]
    assert metadata[1] is metadata[2] is metadata[3]
    assert metadata[0] is not metadata[1]


def test_sampling_inputs_hit_on_the_same_rows_until_a_row_changes_request() -> None:
    """Decode steps hand the sampling builder the same rows array each step: it hits
    without comparing states until the batch changes, even under the same array."""
    runner = make_model_runner(block_size=4, max_model_len=16)

    def new(req_id: str, temperature: float) -> NewRequestData:
        return NewRequestData(req_id=req_id, prompt_token_ids=[1, 2], prompt_embeds=None,
                              output_token_ids=[],
                              sampling_params=make_params(temperature=temperature),
                              block_ids=[1], num_computed_tokens=0)

    def step(new_reqs: list[NewRequestData], finished: list[str]) -> None:
        runner._update_states(SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=CachedRequestData(),
            num_scheduled_tokens={r.req_id: 2 for r in new_reqs},
            total_num_scheduled_tokens=2 * len(new_reqs), finished_req_ids=finished))

    step([new("a", 0.5)], [])
    assert runner.step_inputs.decode_inputs is not None
    rows = runner.step_inputs.decode_inputs.step(1).rows
    first = runner._sampling_metadata(rows)
    assert runner._sampling_metadata(rows) is first
    assert runner.sampling_inputs.num_rebuilds == 1
    # "a" sits this step out (preempted: no `forget`); row 0 now holds another request.
    step([new("c", 0.0)], [])
    assert runner._sampling_metadata(rows).temperature.tolist() == [0.0]
    assert runner.sampling_inputs.num_rebuilds == 2
