"""Exact tests of the scheduler's collaborators, each on its own and through the scheduler:
`FailureIsolation` (suspect order, failures in a row), `StructuredOutputTracker` (compiles
resolved, failures drained, drafts cut, mask rows), `BeamSearchCoordinator` (forks, drops,
stale results, parked beams) and `LoRASlots`.

Grammars and the structured-output manager are fakes: no tokenizer, no compile thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import pytest
import torch

from tests.core_factories import (
    make_request,
    make_runner_output,
    make_scheduler,
    make_scheduler_request,
)
from vllm.lora.request import LoRARequest
from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.beam_search import BeamSearchCoordinator, BeamUpdate, parked_victim
from vllm.v1.core.sched.failure_isolation import EngineStepError, FailureIsolation
from vllm.v1.core.sched.lora_slots import LoRASlots
from vllm.v1.core.sched.structured_output import StructuredOutputTracker
from vllm.v1.engine import FinishReason
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output.backend import GrammarError

CHOICE = StructuredOutputsParams(choice=["x"])

# ---- failure isolation ---------------------------------------------------------------------


def test_suspects_run_alone_in_the_order_they_came_under_suspicion() -> None:
    isolation = FailureIsolation()
    requests = {r: make_scheduler_request(r, [1, 2, 3]) for r in "abcd"}
    assert isolation.blame(["a", "b", "c"]) is None
    assert isolation.suspects == ["a", "b", "c"]
    assert isolation.next_suspect(requests) == "a"
    isolation.cleared("a")  # it ran alone to a sampled token
    # Another failed batch adds only its new suspects, after the older ones.
    assert isolation.blame(["c", "d", "b"]) is None
    assert isolation.suspects == ["b", "c", "d"]
    requests["b"].status = RequestStatus.FINISHED_ABORTED  # finished meanwhile: skipped
    assert isolation.next_suspect(requests) == "c"
    assert isolation.suspects == ["c", "d"]
    assert isolation.blame(["c"]) == "c"  # failed alone: convicted, no longer a suspect
    assert isolation.suspects == ["d"]
    del requests["d"]  # gone meanwhile
    assert isolation.next_suspect(requests) is None
    assert isolation.suspects == []


def test_repeated_failures_end_the_engine_and_a_step_that_ran_resets_the_count() -> None:
    with pytest.raises(EngineStepError, match="no scheduled request"):
        FailureIsolation().blame([])
    isolation = FailureIsolation()
    assert isolation.blame(["a"]) == "a"
    assert isolation.blame(["b"]) == "b"
    with pytest.raises(EngineStepError, match="3 requests in a row failed alone"):
        isolation.blame(["c"])

    isolation = FailureIsolation()
    for req_id in "ab":
        isolation.blame([req_id])
        isolation.step_ran(1)  # any step that ran ends a run of lone failures
    assert isolation.blame(["c"]) == "c" and isolation.lone_failures == 1
    isolation.blame(["a", "b"])
    isolation.step_ran(1)  # a lone request that ran explains no failed batch
    isolation.blame(["a", "b"])
    assert isolation.unexplained_failures == 2
    isolation.step_ran(2)  # a batch that ran does
    assert isolation.unexplained_failures == 0
    isolation.blame(["a", "b"])
    assert isolation.blame(["b"]) == "b"  # a lone failure explains the batches before it
    assert isolation.unexplained_failures == 0
    isolation.blame(["a", "c"])
    isolation.blame(["a", "c"])
    with pytest.raises(EngineStepError, match="3 batches failed in a row"):
        isolation.blame(["a", "c"])


def test_scheduler_runs_a_failed_batch_one_request_at_a_time() -> None:
    s = make_scheduler()
    for req_id in "abc":
        s.add_request(make_request(req_id, [1, 2, 3], max_tokens=4))
    out = s.schedule()
    assert s.recover_from_failed_step(out).outputs == []
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"]
    assert [(r.status, r.num_computed_tokens) for r in s.waiting] == [
        (RequestStatus.PREEMPTED, 0)] * 3
    assert s.failure_isolation.suspects == ["a", "b", "c"]

    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 3}
    s.update_from_output(out, make_runner_output(out, {"a": [10]}))  # a is cleared
    assert s.failure_isolation.suspects == ["b", "c"]
    out = s.schedule()  # running a waits while suspect b runs alone
    assert out.num_scheduled_tokens == {"b": 3}
    [failed] = s.recover_from_failed_step(out).outputs
    assert (failed.request_id, failed.finish_reason) == ("b", FinishReason.ERROR)
    assert s.failure_isolation.suspects == ["c"]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"c": 3} and out.finished_req_ids == ["b"]
    s.update_from_output(out, make_runner_output(out, {"c": [20]}))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "c": 1}
    assert s.failure_isolation.suspects == []


# ---- structured outputs --------------------------------------------------------------------


class FakeGrammar:
    """Allows every token below `limit`; keeps the tokens it accepted."""

    def __init__(self, limit: int = 10) -> None:
        self.limit = limit
        self.accepted: list[int] = []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if any(t >= self.limit for t in token_ids):
            return False
        self.accepted += token_ids
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens:]


class FakeManager:
    """Compiles nothing: the test settles each grammar's future; masks are zeros."""

    def __init__(self) -> None:
        self.futures: list[Future] = []
        self.bitmask_calls: list[tuple[list, list[list[int]]]] = []

    def submit(self, params: StructuredOutputsParams) -> Future:
        self.futures.append(Future())
        return self.futures[-1]

    def grammar_bitmask(self, grammars: list, drafts: list[list[int]]) -> torch.Tensor:
        self.bitmask_calls.append((grammars, drafts))
        return torch.zeros(len(grammars) + sum(map(len, drafts)), 1, dtype=torch.int32)


def test_tracker_resolves_compiled_grammars_and_keeps_failures_until_taken() -> None:
    manager = FakeManager()
    tracker = StructuredOutputTracker(manager)  # type: ignore[arg-type]
    a, b, c = (make_scheduler_request(r, [1, 2], structured_outputs=CHOICE) for r in "abc")
    for request in (a, b, c):
        tracker.submit(request)
    assert [r.status for r in (a, b, c)] == [RequestStatus.WAITING_FOR_GRAMMAR] * 3
    grammar = FakeGrammar()
    manager.futures[0].set_result(grammar)
    manager.futures[1].set_exception(GrammarError("Invalid regex"))
    free = make_scheduler_request("free", [1, 2])
    assert tracker.resolve([a, b, c, free], idle=False) == [b]
    assert (a.status, a.grammar, a.grammar_future) == (RequestStatus.WAITING, grammar, None)
    assert b.grammar is None and b.grammar_future is None
    assert c.status == RequestStatus.WAITING_FOR_GRAMMAR  # still compiling
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in tracker.failures] == [
        ("b", FinishReason.ERROR, "Invalid regex")]
    [failure] = tracker.failures
    assert tracker.take_failures() == [failure]
    assert tracker.take_failures() == []
    with pytest.raises(ValueError, match="no structured-output support"):
        StructuredOutputTracker(None).submit(make_scheduler_request("d", [1],
                                                                    structured_outputs=CHOICE))


def test_tracker_cuts_drafts_advances_matchers_and_builds_mask_rows(
        caplog: pytest.LogCaptureFixture) -> None:
    manager = FakeManager()
    tracker = StructuredOutputTracker(manager)  # type: ignore[arg-type]
    a, b, c, d = (make_scheduler_request(r, [1, 2, 3, 4]) for r in "abcd")
    grammars = {r.request_id: FakeGrammar() for r in (a, b, d)}
    for request in (a, b, d):
        request.grammar = grammars[request.request_id]  # type: ignore[assignment]
    # Drafts stop at the first the grammar refuses; the matcher is left where it was.
    assert tracker.valid_drafts(a, [3, 4, 12, 5]) == [3, 4]
    assert grammars["a"].accepted == []
    assert tracker.valid_drafts(c, [12, 13]) == [12, 13]  # no grammar: all of them
    tracker.accept(a, [5])
    with caplog.at_level(logging.WARNING, logger="vllm.v1.core.sched.structured_output"):
        tracker.accept(a, [11])
    assert grammars["a"].accepted == [5]
    assert "Request a: its grammar rejected sampled token(s) [11]." in caplog.text
    # a decodes with two drafts, b is mid-prefill (samples nothing), c has no grammar,
    # d's whole prompt is scheduled: one row per verified position of a, one for d.
    a.num_computed_tokens = 3
    requests = {r.request_id: r for r in (a, b, c, d)}
    ids, bitmask = tracker.bitmask(requests, {"c": 4, "a": 3, "b": 2, "d": 4},
                                   {"a": [3, 4]})
    assert ids == ["a", "a", "a", "d"]
    assert bitmask is not None and bitmask.shape == (4, 1)
    assert manager.bitmask_calls == [([grammars["a"], grammars["d"]], [[3, 4], []])]
    assert tracker.bitmask(requests, {"c": 4, "b": 2}, {}) == ([], None)
    assert len(manager.bitmask_calls) == 1


def test_failed_step_delivers_pending_grammar_failures_first() -> None:
    manager = FakeManager()
    s = make_scheduler(structured_output_manager=manager)  # type: ignore[arg-type]
    s.add_request(make_request("bad", [5, 6], structured_outputs=CHOICE))
    s.add_request(make_request("a", [1, 2, 3]))
    manager.futures[0].set_exception(GrammarError("no"))
    out = s.schedule()  # "bad" fails to compile: its output waits for the step's
    assert out.num_scheduled_tokens == {"a": 3} and out.finished_req_ids == ["bad"]
    result = s.recover_from_failed_step(out)
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in result.outputs] == [
        ("bad", FinishReason.ERROR, "no"), ("a", FinishReason.ERROR, None)]
    assert s.structured_output.failures == [] and not s.requests
    assert s.schedule().finished_req_ids == ["bad", "a"]


# ---- beam search ---------------------------------------------------------------------------


def _beam_search_request(width: int, max_tokens: int):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
    return make_request("r", [1, 2, 3, 4, 5], max_tokens=max_tokens, ignore_eos=True,
                        temperature=0, beam_search=params)


def _candidates(row: dict[int, float]) -> LogprobsLists:
    """A beam row's logprobs: the sampled (first) token, then the candidates."""
    ids, values = list(row), list(row.values())
    return LogprobsLists([[ids[0], *ids]], [[values[0], *values]], [1])


def _run(kv: KVCacheManager, request: Request) -> None:
    """Computes every known token of `request` (as a step would)."""
    assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.RUNNING


def test_beam_coordinator_forks_drops_and_leaves_the_queues_to_the_scheduler() -> None:
    kv = KVCacheManager(16, 4, False)
    beams = BeamSearchCoordinator(kv, 64, None)
    root = beams.add(_beam_search_request(width=2, max_tokens=4))
    assert root.request_id == "r#0" and "r" in beams and root.beam_group is beams.groups["r"]
    assert root.sampling_params.logprobs == 4  # num_keep: max(2, 1 + 0 stop ids) * width
    assert root.status == RequestStatus.WAITING  # the caller queues it
    _run(kv, root)  # 5 tokens in blocks [1, 2]
    root.num_computed_tokens -= 1  # a result for a step before the last: stale, ignored
    assert beams.sampled(root, _candidates({40: -0.1, 41: -0.5})) == BeamUpdate([], [], None)
    root.num_computed_tokens += 1

    update = beams.sampled(root, _candidates({40: -0.1, 41: -0.5}))
    [(child, runs)] = update.forks
    assert (child.request_id, runs, update.dropped, update.output) == ("r#1", True, [], None)
    assert (root.output_token_ids, child.output_token_ids) == ([40], [41])
    assert root.resend_in_full and child.resend_in_full
    assert kv.get_block_ids("r#1") == [1, 3]  # full block shared, the last one copied
    assert beams.take_block_copies() == [(2, 3)]
    assert beams.take_block_copies() == []

    _run(kv, root)
    _run(kv, child)
    assert beams.sampled(root, _candidates({50: -0.1, 51: -0.2})) == BeamUpdate([], [], None)
    # r#0 has reported and waits for r#1: the newest such beam is preempted for a
    # waiting request that could run, never for one that waits for its grammar.
    other = make_scheduler_request("o", [9])
    assert parked_victim([root, child], [other]) is root
    assert parked_victim([root, child], []) is None
    other.status = RequestStatus.WAITING_FOR_GRAMMAR
    assert parked_victim([root, child], [other]) is None
    kv.free(root)  # preempted: its fork holds no blocks and starts from scratch
    root.status, root.num_computed_tokens = RequestStatus.PREEMPTED, 0

    # r#0's candidates beat r#1's: r#0 continues with 50, r#2 forks with 51, r#1 ends.
    update = beams.sampled(child, _candidates({60: -5.0, 61: -6.0}))
    [(fork, runs)] = update.forks
    assert (fork.request_id, runs, update.output) == ("r#2", False, None)
    assert update.dropped == [child]
    assert (root.output_token_ids, fork.output_token_ids) == ([40, 50], [40, 51])
    assert beams.take_block_copies() == []
    assert [b.request for b in beams.groups["r"].beams] == [root, fork]
    assert beams.finish("r") == [root, fork]
    assert "r" not in beams and beams.finish("r") is None


def test_beam_coordinator_reports_the_finished_search() -> None:
    kv = KVCacheManager(16, 4, False)
    beams = BeamSearchCoordinator(kv, 64, None)
    root = beams.add(_beam_search_request(width=1, max_tokens=1))
    _run(kv, root)
    update = beams.sampled(root, _candidates({40: -0.1, 41: -0.5}))
    assert update.forks == [] and update.dropped == [root] and beams.groups == {}
    assert update.output is not None
    assert (update.output.request_id, update.output.finish_reason) == ("r",
                                                                       FinishReason.LENGTH)
    assert [h.token_ids for h in update.output.beams or []] == [[40]]


# ---- LoRA slots ----------------------------------------------------------------------------


def _with_lora(request_id: str, lora_id: int | None) -> Request:
    request = make_scheduler_request(request_id, [1, 2])
    if lora_id is not None:
        request.lora_request = LoRARequest(f"a{lora_id}", lora_id, "/nowhere")
    return request


def test_lora_slots_admit_in_order_and_block_behind_the_first_that_waits() -> None:
    running = [_with_lora("r1", 1), _with_lora("r2", 2), _with_lora("r3", 1)]
    slots = LoRASlots(2, running)
    assert slots.active == [1, 2]
    waiting = [_with_lora("w3", 3), _with_lora("w1", 1), _with_lora("base", None)]
    assert [slots.admits(r) for r in waiting] == [False, False, True]
    slots = LoRASlots(3, running)
    assert [slots.admits(r) for r in waiting] == [True, True, True]
    slots.add(waiting[0])
    assert slots.active == [1, 2, 3]
    assert not slots.admits(_with_lora("w4", 4))
    assert LoRASlots(None, running).admits(_with_lora("w5", 5))  # LoRA off: no limit
