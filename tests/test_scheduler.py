"""Exact tests of `Scheduler`: budgets, chunking, preemption, stopping, embeds batching.

Every step is driven by hand: `schedule()`, then a hand-made `ModelRunnerOutput` naming the
tokens each request "sampled", then `update_from_output()`.
"""

from __future__ import annotations

import pytest
import torch

from tests.core_factories import (
    EOS_TOKEN_ID,
    cached,
    make_request,
    make_runner_output,
    make_scheduler,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.request import RequestStatus


def step(scheduler: Scheduler, sampled: dict[str, list[int]] | None = None
         ) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, make_runner_output(out, sampled))


def new_blocks(out: SchedulerOutput) -> dict[str, list[int]]:
    return {r.req_id: r.block_ids for r in out.scheduled_new_reqs}


def num_free(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def free_ids(scheduler: Scheduler) -> list[int]:
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    return [b.block_id for b in queue.get_all_free_blocks()]


# ---- budget, chunked prefill, mixed steps -------------------------------------------------


def test_walkthrough_budget_chunking_and_block_deltas() -> None:
    """The prepare-inputs walkthrough: block size 2, budget 10, prompts of 3, 2 and 8."""
    s = make_scheduler(block_size=2, max_num_batched_tokens=10, num_blocks=20)
    s.add_request(make_request("0", [10, 11, 12]))
    s.add_request(make_request("1", [20, 21]))
    s.add_request(make_request("2", [30, 31, 32, 33, 34, 35, 36, 37]))

    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 3, "1": 2, "2": 5}
    assert out.total_num_scheduled_tokens == 10
    assert new_blocks(out) == {"0": [1, 2], "1": [3], "2": [4, 5, 6]}
    assert [r.num_computed_tokens for r in out.scheduled_new_reqs] == [0, 0, 0]
    assert [r.prompt_token_ids for r in out.scheduled_new_reqs] == [
        [10, 11, 12], [20, 21], [30, 31, 32, 33, 34, 35, 36, 37]]
    assert cached(out) == []
    assert [s.requests[r].num_computed_tokens for r in "012"] == [3, 2, 5]
    # Request 2's chunk stops short of its prompt's end: it samples nothing.
    result = s.update_from_output(out, make_runner_output(out, {"0": [40], "1": [50]}))
    assert [(o.request_id, o.new_token_ids) for o in result.outputs] == [("0", [40]),
                                                                      ("1", [50])]

    # Step 2: two decodes and the rest of the chunked prompt in one step. Only new block
    # ids travel: request 1 opens block 7 (position 2), request 2 block 8 (positions 6, 7).
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 3}
    assert out.scheduled_new_reqs == []
    assert cached(out) == [("0", [], 3), ("1", [7], 2), ("2", [8], 5)]
    assert s.kv_cache_manager.get_block_ids("1") == [3, 7]
    assert s.kv_cache_manager.get_block_ids("2") == [4, 5, 6, 8]
    s.update_from_output(out, make_runner_output(out, {"0": [41], "1": [51], "2": [60]}))

    # Step 3: all decode; positions 4 and 8 open blocks 9 and 10.
    out = s.schedule()
    assert out.num_scheduled_tokens == {"0": 1, "1": 1, "2": 1}
    assert cached(out) == [("0", [9], 4), ("1", [], 3), ("2", [10], 8)]


def test_running_requests_are_served_before_waiting_ones() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", [10, 11]))
    step(s, {"a": [12]})
    s.add_request(make_request("b", [20, 21, 22, 23, 24, 25]))
    out, _ = step(s, {"a": [13]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert new_blocks(out) == {"b": [2]}
    out, _ = step(s, {"a": [14], "b": [26]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 3}
    assert cached(out) == [("a", [], 3), ("b", [3], 3)]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_fits_it() -> None:
    s = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add_request(make_request("a", [10, 11, 12, 13, 14]))
    s.add_request(make_request("b", [20, 21, 22, 23, 24]))
    out, _ = step(s, {"a": [15]})
    assert out.num_scheduled_tokens == {"a": 5}
    assert [r.request_id for r in s.waiting] == ["b"]
    out, _ = step(s, {"a": [16], "b": [25]})
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", list(range(100, 110))))  # 10 tokens
    counts = []
    for _ in range(3):
        out = s.schedule()
        counts.append(out.num_scheduled_tokens["a"])
        done = s.requests["a"].num_computed_tokens == 10
        s.update_from_output(out, make_runner_output(out, {"a": [7]} if done else None))
    assert counts == [4, 4, 2]
    assert s.requests["a"].output_token_ids == [7]


def test_max_num_seqs_limits_running_requests() -> None:
    s = make_scheduler(max_num_seqs=2)
    s.add_request(make_request("a", [10, 11], max_tokens=1))
    s.add_request(make_request("b", [20, 21], max_tokens=3))
    s.add_request(make_request("c", [30, 31]))
    out, result = step(s, {"a": [12], "b": [22]})
    assert out.num_scheduled_tokens == {"a": 2, "b": 2}
    assert [r.request_id for r in s.waiting] == ["c"]
    assert result.outputs[0].finish_reason == FinishReason.LENGTH
    out, _ = step(s, {"b": [23], "c": [32]})
    assert out.finished_req_ids == ["a"]
    assert out.num_scheduled_tokens == {"b": 1, "c": 2}


def test_empty_schedule() -> None:
    s = make_scheduler()
    out = s.schedule()
    assert out.num_scheduled_tokens == {}
    assert out.total_num_scheduled_tokens == 0
    assert not s.has_unfinished_requests()


def test_duplicate_request_id_is_rejected() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", [1, 3]))
    with pytest.raises(ValueError, match="already running"):
        s.add_request(make_request("a", [1, 3]))


# ---- preemption ----------------------------------------------------------------------------


def test_newest_request_is_preempted_and_resumes_with_its_outputs() -> None:
    # 4 usable blocks of 4 tokens; two 7-token prompts fill them.
    s = make_scheduler(num_blocks=5, enable_prefix_caching=False)
    prompt_b = [20, 21, 22, 23, 24, 25, 26]
    s.add_request(make_request("a", [10, 11, 12, 13, 14, 15, 16], max_tokens=4))
    s.add_request(make_request("b", prompt_b))
    out, _ = step(s, {"a": [100], "b": [200]})
    assert new_blocks(out) == {"a": [1, 2], "b": [3, 4]}
    out, _ = step(s, {"a": [101], "b": [201]})
    assert cached(out) == [("a", [], 7), ("b", [], 7)]

    # a's token at position 8 needs a third block: b (newest) is preempted; b's blocks go
    # back tail first, so a gets block 4.
    out, result = step(s, {"a": [102]})
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == ["b"]
    assert cached(out) == [("a", [4], 8)]
    assert out.finished_req_ids == []
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [200, 201]
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert [r.request_id for r in s.waiting] == ["b"]
    assert s.running == [s.requests["a"]]
    assert s.kv_cache_manager.get_block_ids("b") == []
    assert result.scheduler_stats.num_preemptions == 1
    assert [o.request_id for o in result.outputs] == ["a"]

    # b (9 tokens, 3 blocks) cannot come back while only block 3 is free.
    out, result = step(s, {"a": [103]})
    assert out.num_scheduled_tokens == {"a": 1}
    assert result.outputs[0].finish_reason == FinishReason.LENGTH
    assert free_ids(s) == [3, 4, 2, 1]

    # b resumes as a new request: prompt + outputs recomputed from scratch.
    out, _ = step(s, {"b": [202]})
    assert out.finished_req_ids == ["a"]
    assert out.num_scheduled_tokens == {"b": 9}
    [new] = out.scheduled_new_reqs
    assert new.req_id == "b"
    assert new.prompt_token_ids == prompt_b
    assert new.output_token_ids == [200, 201]
    assert new.num_computed_tokens == 0
    assert new.block_ids == [3, 4, 2]
    assert b.status == RequestStatus.RUNNING
    assert b.output_token_ids == [200, 201, 202]
    assert b.all_token_ids == prompt_b + [200, 201, 202]


def test_resumed_request_hits_its_own_surviving_blocks() -> None:
    s = make_scheduler(num_blocks=5, enable_prefix_caching=True)
    s.add_request(make_request("a", [10, 11, 12, 13, 14, 15, 16], max_tokens=4))
    s.add_request(make_request("b", [20, 21, 22, 23, 24, 25, 26]))
    step(s, {"a": [100], "b": [200]})
    step(s, {"a": [101], "b": [201]})
    out, _ = step(s, {"a": [102]})
    assert out.preempted_req_ids == ["b"]
    # b freed [4, 3]; a took block 4, evicting b's second block. Block 3 is still cached.
    step(s, {"a": [103]})
    out, result = step(s, {"b": [202]})
    [new] = out.scheduled_new_reqs
    assert new.num_computed_tokens == 4
    assert new.block_ids == [3, 4, 2]
    assert out.num_scheduled_tokens == {"b": 5}
    assert result.outputs[0].num_cached_tokens == 0  # set on b's first schedule, no hit
    assert result.scheduler_stats.prefix_cache_queries == 9
    assert result.scheduler_stats.prefix_cache_hits == 4


def test_request_that_cannot_grow_and_is_newest_preempts_itself() -> None:
    s = make_scheduler(num_blocks=4, enable_prefix_caching=False)  # 3 usable blocks
    s.add_request(make_request("a", [10, 11, 12, 13, 14, 15]))
    s.add_request(make_request("b", [20, 21, 22, 23]))
    out, _ = step(s, {"a": [100], "b": [200]})
    assert new_blocks(out) == {"a": [1, 2], "b": [3]}
    out, _ = step(s, {"a": [101]})
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.preempted_req_ids == ["b"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert free_ids(s) == [3]
    # No waiting request is admitted in a step that preempted.
    assert [r.request_id for r in s.waiting] == ["b"]


def test_preempted_request_goes_before_older_waiting_requests() -> None:
    s = make_scheduler(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)
    s.add_request(make_request("a", [10, 11, 12, 13, 14, 15]))
    s.add_request(make_request("b", [20, 21, 22, 23]))
    s.add_request(make_request("c", [30]))
    step(s, {"a": [100], "b": [200]})
    out, _ = step(s, {"a": [101]})
    assert out.preempted_req_ids == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


# ---- finishing -----------------------------------------------------------------------------


def test_finished_request_frees_its_blocks_and_is_reported_once() -> None:
    s = make_scheduler(num_blocks=10)
    s.add_request(make_request("a", [10, 11, 12, 13, 14], max_tokens=2))
    out, _ = step(s, {"a": [20]})
    assert num_free(s) == 7
    out, result = step(s, {"a": [21]})
    [o] = result.outputs
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([21], FinishReason.LENGTH,
                                                                  None)
    assert num_free(s) == 9
    assert "a" not in s.requests and s.running == []
    assert not s.has_unfinished_requests()
    # The runner still holds a's state until an (empty) step delivers the finished id.
    assert s.has_finished_requests() and s.has_requests()
    out = s.schedule()
    assert out.finished_req_ids == ["a"]
    assert out.total_num_scheduled_tokens == 0
    assert not s.has_finished_requests() and not s.has_requests()
    assert s.schedule().finished_req_ids == []


def test_abort_running_and_waiting_requests() -> None:
    s = make_scheduler(max_num_seqs=1, num_blocks=10)
    s.add_request(make_request("a", [10, 11, 12]))
    s.add_request(make_request("b", [20, 21]))
    step(s, {"a": [13]})
    assert num_free(s) == 8
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert s.running == [] and list(s.waiting) == []
    assert s.requests == {}
    assert num_free(s) == 9
    assert s.get_num_unfinished_requests() == 0
    assert s.schedule().finished_req_ids == ["a", "b"]


def test_output_of_a_request_aborted_during_its_step_is_dropped() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", [10, 11]))
    s.add_request(make_request("b", [20, 21]))
    out = s.schedule()
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    result = s.update_from_output(out, make_runner_output(out, {"a": [12], "b": [22]}))
    assert [o.request_id for o in result.outputs] == ["b"]


def run_one(params: dict, tokens: list[int], max_model_len: int = 64
            ) -> tuple[list[list[int]], FinishReason | None, int | str | None, Scheduler]:
    """Feeds `tokens` one per step to a 3-token prompt until it finishes."""
    s = make_scheduler(max_model_len=max_model_len)
    s.add_request(make_request("r", [10, 11, 12], **params))
    emitted = []
    for token in tokens:
        _, result = step(s, {"r": [token]})
        [o] = result.outputs
        emitted.append(o.new_token_ids)
        if o.finished:
            return emitted, o.finish_reason, o.stop_reason, s
    return emitted, None, None, s


def test_stop_on_eos() -> None:
    emitted, reason, stop_reason, s = run_one({}, [5, EOS_TOKEN_ID, 6])
    assert emitted == [[5], [EOS_TOKEN_ID]]
    assert (reason, stop_reason) == (FinishReason.STOP, None)
    assert not s.has_unfinished_requests()


def test_ignore_eos() -> None:
    emitted, reason, _, _ = run_one({"ignore_eos": True, "max_tokens": 3},
                                    [EOS_TOKEN_ID, EOS_TOKEN_ID, EOS_TOKEN_ID])
    assert emitted == [[EOS_TOKEN_ID]] * 3
    assert reason == FinishReason.LENGTH


def test_stop_on_stop_token_ids() -> None:
    emitted, reason, stop_reason, _ = run_one({"stop_token_ids": [7, 8]}, [5, 8, 6])
    assert emitted == [[5], [8]]
    assert (reason, stop_reason) == (FinishReason.STOP, 8)


def test_stop_on_generation_config_stop_ids() -> None:
    s = make_scheduler()
    request = make_request("r", [10, 11, 12])
    request.sampling_params.all_stop_token_ids = [9]
    s.add_request(request)
    _, result = step(s, {"r": [9]})
    assert (result.outputs[0].finish_reason, result.outputs[0].stop_reason) == (
        FinishReason.STOP, 9)


def test_stop_on_max_tokens() -> None:
    emitted, reason, stop_reason, _ = run_one({"max_tokens": 3}, [5, 6, 7, 8])
    assert emitted == [[5], [6], [7]]
    assert (reason, stop_reason) == (FinishReason.LENGTH, None)


def test_eos_as_the_last_allowed_token_reports_length() -> None:
    # As in vLLM v1, the length cap is checked before EOS and stop token ids.
    _, reason, _, _ = run_one({"max_tokens": 2}, [5, EOS_TOKEN_ID])
    assert reason == FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_token_ids() -> None:
    emitted, reason, _, _ = run_one({"min_tokens": 3}, [EOS_TOKEN_ID, EOS_TOKEN_ID,
                                                        EOS_TOKEN_ID, 5])
    assert emitted == [[EOS_TOKEN_ID]] * 3
    assert reason == FinishReason.STOP
    emitted, reason, stop_reason, _ = run_one({"min_tokens": 2, "stop_token_ids": [7]},
                                              [7, 7, 5])
    assert emitted == [[7], [7]]
    assert (reason, stop_reason) == (FinishReason.STOP, 7)


def test_max_model_len_caps_generation() -> None:
    # 3 prompt tokens, max_model_len 6: max_tokens 16 is cut to the 3 tokens of room.
    emitted, reason, _, s = run_one({"max_tokens": 16}, [5, 6, 7, 8], max_model_len=6)
    assert emitted == [[5], [6], [7]]
    assert reason == FinishReason.LENGTH


def test_output_carries_logprobs_row_and_cached_tokens() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", [10, 11, 12, 13, 14]))
    s.add_request(make_request("b", [20, 21]))
    out = s.schedule()
    runner = make_runner_output(out, {"a": [30], "b": [31]},
                                logprobs={"a": ([30, 30, 9], [-0.5, -0.5, -1.5], 1),
                                          "b": ([31, 4, 31], [-2.0, -1.0, -2.0], 2)})
    result = s.update_from_output(out, runner)
    a, b = result.outputs
    assert a.new_logprobs.token_ids == [[30, 30, 9]]
    assert a.new_logprobs.logprobs == [[-0.5, -0.5, -1.5]]
    assert a.new_logprobs.ranks == [1]
    assert b.new_logprobs.token_ids == [[31, 4, 31]] and b.new_logprobs.ranks == [2]

    # A later request with the same 5-token prompt hits one block of 4 tokens.
    s.add_request(make_request("c", [10, 11, 12, 13, 14]))
    out = s.schedule()
    [new] = out.scheduled_new_reqs
    assert (new.num_computed_tokens, out.num_scheduled_tokens["c"]) == (4, 1)
    assert new.block_ids[0] == s.kv_cache_manager.get_block_ids("a")[0]
    result = s.update_from_output(out, make_runner_output(out, {"a": [1], "b": [1],
                                                                "c": [1]}))
    assert [o.num_cached_tokens for o in result.outputs] == [0, 0, 4]
    assert result.scheduler_stats.prefix_cache_queries == 5
    assert result.scheduler_stats.prefix_cache_hits == 4
    assert result.scheduler_stats.num_running_reqs == 3


def test_prefix_hit_then_chunked_rest_of_the_prompt() -> None:
    s = make_scheduler(max_num_batched_tokens=4)
    shared = [10, 11, 12, 13, 14, 15, 16, 17]
    s.add_request(make_request("a", shared + [18], max_tokens=1))
    for sampled in (None, None, {"a": [19]}):  # 9 tokens in chunks of 4, 4, 1
        step(s, sampled)
    assert not s.has_unfinished_requests()
    assert free_ids(s)[-3:] == [3, 2, 1]
    # b shares a's first two blocks: 8 tokens hit, the other 5 go in chunks of 4 and 1.
    s.add_request(make_request("b", shared + [20, 21, 22, 23, 24]))
    out, result = step(s)
    [new] = out.scheduled_new_reqs
    assert (new.num_computed_tokens, new.block_ids) == (8, [1, 2, 4])
    assert out.num_scheduled_tokens == {"b": 4}
    assert out.finished_req_ids == ["a"]
    assert result.outputs == []
    assert (result.scheduler_stats.prefix_cache_queries,
            result.scheduler_stats.prefix_cache_hits) == (13, 8)
    out, result = step(s, {"b": [25]})
    assert cached(out) == [("b", [5], 12)]
    assert out.num_scheduled_tokens == {"b": 1}
    assert result.outputs[0].num_cached_tokens == 8


# ---- prompt embeds batching ---------------------------------------------------------------


def embeds(num_rows: int) -> torch.Tensor:
    return torch.ones(num_rows, 8)


def add_mixed_requests(s: Scheduler, embeds_first: bool) -> None:
    """Adds e1 (embeds), t1 (tokens), e2 (embeds); e1 and t1 swap places unless
    `embeds_first`. Requests arrive in the order they are added."""
    e1 = ("e1", dict(prompt_embeds=embeds(3), max_tokens=2))
    t1 = ("t1", dict(prompt_token_ids=[10, 11, 12, 13], max_tokens=1))
    e2 = ("e2", dict(prompt_embeds=embeds(5) * 2, max_tokens=1))
    for req_id, kwargs in [e1, t1, e2] if embeds_first else [t1, e1, e2]:
        s.add_request(make_request(req_id, **kwargs))


def test_mixed_batching_schedules_both_kinds_together() -> None:
    s = make_scheduler(prompt_embeds_batching="mixed")
    add_mixed_requests(s, embeds_first=True)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"e1": 3, "t1": 4, "e2": 5}
    e1 = out.scheduled_new_reqs[0]
    assert e1.prompt_token_ids == [0, 0, 0]  # placeholders
    assert torch.equal(e1.prompt_embeds, embeds(3))


def test_separate_batching_follows_the_oldest_request() -> None:
    s = make_scheduler(prompt_embeds_batching="separate")
    add_mixed_requests(s, embeds_first=True)
    # Oldest is e1 (embeds): an embeds-only step; t1 keeps its place in the queue.
    out, _ = step(s, {"e1": [40], "e2": [41]})
    assert out.num_scheduled_tokens == {"e1": 3, "e2": 5}
    assert [r.request_id for r in s.waiting] == ["t1"]
    # e2 finished; e1 (still the oldest) decodes alone.
    out, _ = step(s, {"e1": [42]})
    assert out.num_scheduled_tokens == {"e1": 1}
    # e1 finished: the token request finally runs.
    out, _ = step(s, {"t1": [43]})
    assert out.num_scheduled_tokens == {"t1": 4}
    assert not s.has_unfinished_requests()


def test_separate_batching_token_step_skips_embeds_requests_in_order() -> None:
    s = make_scheduler(prompt_embeds_batching="separate")
    add_mixed_requests(s, embeds_first=False)
    s.add_request(make_request("t2", [50, 51], max_tokens=1))
    out, _ = step(s, {"t1": [60], "t2": [61]})
    assert out.num_scheduled_tokens == {"t1": 4, "t2": 2}
    assert [r.request_id for r in s.waiting] == ["e1", "e2"]
    out, _ = step(s, {"e1": [62], "e2": [63]})
    assert out.num_scheduled_tokens == {"e1": 3, "e2": 5}


def test_separate_batching_makes_progress_when_blocks_are_short() -> None:
    # 5 usable blocks of 2 tokens. t0 (oldest, tokens) makes the first step a token step,
    # which admits t0 and t1 while the embeds request e (older than t1) waits.
    s = make_scheduler(block_size=2, num_blocks=6, prompt_embeds_batching="separate")
    s.add_request(make_request("t0", [10, 11], max_tokens=1))
    s.add_request(make_request("e", prompt_embeds=embeds(6), max_tokens=1))
    s.add_request(make_request("t1", [20, 21, 22, 23, 24, 25], max_tokens=3))
    out, _ = step(s, {"t0": [12], "t1": [26]})
    assert new_blocks(out) == {"t0": [1], "t1": [2, 3, 4]}
    # t0 is done; e is now the oldest and needs 3 blocks while only 2 are free and t1
    # holds the other 3. Some step must still run something, and all must finish.
    for _ in range(10):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.total_num_scheduled_tokens > 0, "no progress"
        sampled = {r: [30] for r in out.num_scheduled_tokens
                   if s.requests[r].num_computed_tokens == s.requests[r].num_tokens}
        s.update_from_output(out, make_runner_output(out, sampled))
    assert not s.has_unfinished_requests()
