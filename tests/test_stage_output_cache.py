"""Exact tests of the stage-output cache and of how the scheduler hands a finished request's
rows to the runner.

The cache numbers are the design note's: 8 blocks of 4 slots, hidden size 2, a second output
("mm_feature") of 16 features; a 12-token request, then an 8-token request sharing its first
block.
"""

from __future__ import annotations

import torch

from tests.core_factories import make_request, make_runner_output, make_scheduler
from vllm.v1.core.sched.output import RowsToGather
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm.v1.worker.stage_output_cache import HIDDEN_STATES, OutputSpec, StageOutputCache

NUM_BLOCKS, BLOCK_SIZE, HIDDEN, MM_DIM = 8, 4, 2, 16
SPECS = {HIDDEN_STATES: OutputSpec(HIDDEN, torch.float32),
         "mm_feature": OutputSpec(MM_DIM, torch.float32)}


def _rows(tag: float, num_tokens: int) -> dict[str, torch.Tensor]:
    """Distinct rows per token: hidden [tag + i, -(tag + i)], mm_feature 100 * (tag + i) + j."""
    base = tag + torch.arange(num_tokens, dtype=torch.float32)
    return {HIDDEN_STATES: torch.stack([base, -base], 1),
            "mm_feature": 100 * base[:, None] + torch.arange(MM_DIM, dtype=torch.float32)}


def _poison_all_but(cache: StageOutputCache, blocks: list[int]) -> None:
    """NaN in every block not in `blocks`: reading any of them would show."""
    others = [b for b in range(NUM_BLOCKS) if b not in blocks]
    for tensor in cache.tensors.values():
        tensor[others] = float("nan")


def test_block_bytes_and_layout() -> None:
    assert StageOutputCache.block_bytes(BLOCK_SIZE, SPECS) == 4 * (2 + 16) * 4
    cache = StageOutputCache(NUM_BLOCKS, BLOCK_SIZE, SPECS)
    assert cache.tensors[HIDDEN_STATES].shape == (8, 4, 2)
    assert cache.tensors["mm_feature"].shape == (8, 4, 16)
    assert cache.enabled and not StageOutputCache(NUM_BLOCKS, BLOCK_SIZE, {}).enabled


def test_design_note_walkthrough() -> None:
    cache = StageOutputCache(NUM_BLOCKS, BLOCK_SIZE, SPECS)
    first = _rows(0.0, 12)
    # "The quick brown fox was tired and slept beneath the shady tree": blocks 0, 1, 2.
    cache.write(torch.arange(12).numpy(), **first)
    hidden = cache.tensors[HIDDEN_STATES]
    assert torch.equal(hidden[0], first[HIDDEN_STATES][0:4])  # [The quick brown fox]
    assert torch.equal(hidden[2], first[HIDDEN_STATES][8:12])  # [beneath the shady tree]
    assert torch.equal(hidden[3:], torch.zeros(5, 4, 2))  # empty
    assert torch.equal(cache.tensors["mm_feature"][1], first["mm_feature"][4:8])

    # "The quick brown fox jumped over the dog": block 0 is a prefix hit, the 4 new
    # tokens (positions 4..7) go to the newly allocated block 3, slots 12..15.
    second = _rows(50.0, 4)
    cache.write(torch.tensor([12, 13, 14, 15]).numpy(), **second)
    _poison_all_but(cache, [0, 3])
    rows = cache.gather([0, 3], 8)
    for name in SPECS:
        expected = torch.cat([first[name][:4], second[name]])  # cached rows, then new ones
        assert torch.equal(rows[name], expected)

    # A request owning a partial block: positions 0..5 read slots 0..3, 12, 13 only.
    cache.tensors[HIDDEN_STATES][3, 2:] = float("nan")
    partial = cache.gather([0, 3], 6)[HIDDEN_STATES]
    assert torch.equal(partial, torch.cat([first[HIDDEN_STATES][:4],
                                           second[HIDDEN_STATES][:2]]))


def test_mixed_batch_slots_and_copies() -> None:
    """One step writes two requests' tokens at scattered slots; gathered rows are copies."""
    cache = StageOutputCache(NUM_BLOCKS, BLOCK_SIZE, {HIDDEN_STATES: SPECS[HIDDEN_STATES]})
    step = _rows(0.0, 5)[HIDDEN_STATES]
    # Request a decodes position 5 (block 2, slot 9); b prefills positions 0..3 (block 6).
    cache.write(torch.tensor([9, 24, 25, 26, 27]).numpy(), hidden_states=step)
    assert torch.equal(cache.tensors[HIDDEN_STATES][2, 1], step[0])
    assert torch.equal(cache.tensors[HIDDEN_STATES][6], step[1:])
    got = cache.gather_finished([RowsToGather("b", [6], 4)])
    assert list(got) == ["b"] and torch.equal(got["b"], step[1:])
    cache.tensors[HIDDEN_STATES].zero_()
    assert torch.equal(got["b"], step[1:])  # not a view of the cache


def test_disabled_cache_is_a_no_op() -> None:
    cache = StageOutputCache(NUM_BLOCKS, BLOCK_SIZE, {})
    cache.write(torch.arange(3).numpy(), hidden_states=torch.ones(3, HIDDEN))
    assert cache.gather_finished([RowsToGather("a", [1], 3)]) == {}


# ---- the scheduler's side: blocks held one step, rows to gather, final output --------------


def _step(scheduler, sampled=None, hidden_states=None):
    out = scheduler.schedule()
    runner_output = make_runner_output(out, sampled)
    runner_output.hidden_states = hidden_states or {}
    return out, scheduler.update_from_output(out, runner_output)


def test_finished_request_holds_blocks_until_its_rows_are_read() -> None:
    # 8 blocks (block 0 is the null block), block size 4: the design note's requests.
    s = make_scheduler(block_size=4, num_blocks=8)
    s.add_request(make_request("a", list(range(100, 111)), max_tokens=1,
                               return_hidden_states=True))  # 11 prompt + 1 sampled = 12
    out, outputs = _step(s, {"a": [7]})
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[1, 2, 3]]
    assert outputs.outputs == []  # the final output waits for the rows
    assert s.kv_cache_manager.get_block_ids("a") == [1, 2, 3]  # still held
    assert s.has_requests() and not s.has_unfinished_requests()

    rows = torch.arange(22, dtype=torch.float32).reshape(11, 2)
    out, outputs = _step(s, hidden_states={"a": rows})
    assert out.finished_req_ids == ["a"]
    assert out.rows_to_gather == [RowsToGather("a", [1, 2, 3], 11)]
    assert out.total_num_scheduled_tokens == 0
    [final] = outputs.outputs
    assert final.new_token_ids == [7] and final.finish_reason == FinishReason.LENGTH
    assert final.hidden_states is rows
    assert s.kv_cache_manager.get_block_ids("a") == [] and not s.has_requests()

    # The 8-token request sharing the first block hits it and gets one new block.
    s.add_request(make_request("b", [*range(100, 104), 1, 2, 3, 4], max_tokens=1,
                               return_hidden_states=True))
    out, _ = _step(s, {"b": [9]})
    assert [(r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ([1, 4], 4)]
    out, _ = _step(s, hidden_states={"b": torch.zeros(8, 2)})
    assert out.rows_to_gather == [RowsToGather("b", [1, 4], 8)]


def test_abort_while_held_frees_blocks_and_sends_nothing() -> None:
    s = make_scheduler(block_size=4, num_blocks=8)
    s.add_request(make_request("a", [1, 2, 3, 5, 6], max_tokens=1, return_hidden_states=True))
    _step(s, {"a": [7]})
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.get_block_ids("a") == [] and not s.held_for_rows
    out, outputs = _step(s)
    assert out.rows_to_gather == [] and outputs.outputs == []


def test_front_end_stop_returns_rows() -> None:
    """A stop string (matched in the front end) ends a running, fully computed request at
    once: its last output brings no token, only the rows."""
    s = make_scheduler(block_size=4, num_blocks=8)
    s.add_request(make_request("a", [1, 3, 5, 6], max_tokens=10, return_hidden_states=True))
    _step(s, {"a": [7]})
    _step(s, {"a": [8]})  # 6 tokens, 5 computed
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    out, outputs = _step(s, hidden_states={"a": torch.zeros(5, 2)})
    assert out.rows_to_gather == [RowsToGather("a", [1, 2], 5)]
    [final] = outputs.outputs
    assert final.new_token_ids == [] and final.finish_reason == FinishReason.STOP


def test_front_end_stop_of_a_preempted_request_recomputes_its_rows() -> None:
    s = make_scheduler(block_size=4, num_blocks=8)
    s.add_request(make_request("a", [1, 3, 5, 6], max_tokens=10, return_hidden_states=True))
    _step(s, {"a": [7]})
    request = s.requests["a"]
    s.running.remove(request)
    s._preempt(request)  # as if preempted between the token and the stop
    s.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert request.stop_requested and request.status == RequestStatus.PREEMPTED
    # It hits its own cached first block, recomputes position 4 and samples once more.
    out, outputs = _step(s, {"a": [9]})
    assert [(r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs] == [
        ([1, 2], 4)]
    assert out.num_scheduled_tokens == {"a": 1} and outputs.outputs == []
    out, outputs = _step(s, hidden_states={"a": torch.zeros(5, 2)})
    assert out.rows_to_gather == [RowsToGather("a", [1, 2], 5)]  # positions 0..4
    assert outputs.outputs[0].finish_reason == FinishReason.STOP


def test_requests_without_rows_finish_as_before() -> None:
    s = make_scheduler(block_size=4, num_blocks=8)
    s.add_request(make_request("a", [1, 3, 5], max_tokens=1))
    out, outputs = _step(s, {"a": [7]})
    assert outputs.outputs[0].finished and outputs.outputs[0].hidden_states is None
    assert s.kv_cache_manager.get_block_ids("a") == []
    out, _ = _step(s)
    assert out.finished_req_ids == ["a"] and out.rows_to_gather == []
