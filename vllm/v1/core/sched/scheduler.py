"""`Scheduler`: continuous batching in tokens under a budget, with preemption by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.config import CacheConfig, InputKind, SchedulerConfig
from vllm.v1.core.kv_cache_groups import KVCacheGroupSpec
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import make_block_hasher
from vllm.v1.core.sched.beam_search import (
    BeamSearchCoordinator,
    BeamUpdate,
    is_parked,
    parked_victim,
)
from vllm.v1.core.sched.failure_isolation import EngineStepError, FailureIsolation
from vllm.v1.core.sched.lora_slots import LoRASlots
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    RowsToGather,
    SchedulerOutput,
)
from vllm.v1.core.sched.span_reservation import SpanReservation
from vllm.v1.core.sched.structured_output import StructuredOutputTracker
from vllm.v1.core.sched.utils import append_until_stop
from vllm.v1.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.spec_decode.metrics import SpecDecodingStats
from vllm.v1.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from vllm.v1.engine.media_rows import MediaRows

__all__ = ["EngineStepError", "Scheduler"]


@dataclass(slots=True)
class _Step:
    """What one `schedule()` call has decided so far."""

    budget: int
    encoder_budget: int  # encoder input tokens left this step (encoder/decoder inputs, media)
    num_scheduled: dict[str, int] = field(default_factory=dict)  # in scheduling order
    encoder_req_ids: list[str] = field(default_factory=list)  # their encoder runs this step
    new_reqs: list[Request] = field(default_factory=list)
    cached_reqs: list[Request] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts verified
    suspect: str | None = None  # a request suspected of failing a step, run alone
    # A starved media run's request (`SpanReservation`) and the budget only it may use
    # until it is scheduled.
    reserved_for: str | None = None
    reserve: int = 0

    def budget_for(self, request: Request) -> int:
        """What is left of the budget for `request`: all of it for the reserved request,
        less the reservation for any other."""
        if request.request_id == self.reserved_for:
            return self.budget
        return max(0, self.budget - self.reserve)

    def take(self, request: Request, num_new: int) -> None:
        self.num_scheduled[request.request_id] = num_new
        self.budget -= num_new
        if request.request_id == self.reserved_for:
            self.reserve = 0


class Scheduler:
    """Decides, each step, how many tokens of which requests to compute.

    Every request is `num_tokens` long and has `num_computed_tokens` done; a step gives
    running requests (oldest first) and then waiting ones a share of the token budget. A
    prompt that does not fit is chunked; a request that cannot get KV blocks preempts the
    newest running request, which restarts from scratch later (its outputs are kept).

    With LoRA, the running requests never use more distinct adapters than there are slots
    (`max_loras`): a request whose adapter would need one more waits (`LoRASlots`).

    Encoder/decoder requests run their encoder in the step that first schedules them (or
    re-schedules them after a preemption), unless their cross-attention blocks are still
    cached; encoder inputs are never split and count against their own per-step budget.

    A model whose media attend bidirectionally (Gemma 3's images) gives its requests the
    media runs' spans: a chunk never ends inside one (it ends before the run, which a later
    step takes whole) and neither does a prefix hit (`Request.chunk_end`, `splits_span`).
    A run that finds too little budget left gets it reserved (`SpanReservation`).

    Requests with images or audio wait in the media stage (`MediaRows`) until their items
    fit that same budget (`_encode_media`: items in the encoder cache, or already encoded
    this step, cost nothing); their rows are then computed in one encoder batch per
    modality and they join `waiting` as mixed ids/embeds prompts. No token of a request is
    scheduled before its rows exist, and chunks or preemptions reuse the rows.

    A finished request that asked for its hidden states keeps its blocks for one more step:
    the runner reads its rows from the stage-output cache through them (`rows_to_gather`),
    and its final output leaves with those rows. Only then do the blocks go back.

    A step whose execution raised is undone (`recover_from_failed_step`): a lone request is
    failed with FinishReason.ERROR; the requests of a failed batch become suspects and run
    one at a time until each has sampled a token or failed alone (`FailureIsolation`).

    Its collaborators each hold one job and only that job's state; the scheduler owns the
    requests, the queues and their KV blocks: `BeamSearchCoordinator` (beam-search requests),
    `FailureIsolation` (whom a failed step blames), `StructuredOutputTracker` (grammars),
    `LoRASlots` (a step's adapter admission); `utils.check_stop` holds the stop rules.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 kv_cache_groups: list[KVCacheGroupSpec] | None = None,
                 structured_output_manager: StructuredOutputManager | None = None,
                 media: MediaRows | None = None) -> None:
        self.config = scheduler_config
        self.media = media  # None: the model takes no images or audio
        self.media_failures: list[EngineCoreOutput] = []  # sent with the next outputs
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching,
                                               kv_cache_groups)
        self.block_hasher = (make_block_hasher(cache_config.block_size)
                             if cache_config.enable_prefix_caching else None)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: list[str] = []
        # Finished, blocks still held, final output waiting for the rows: req_id -> output.
        self.held_for_rows: dict[str, EngineCoreOutput] = {}
        self.num_preemptions = 0
        self.failure_isolation = FailureIsolation()
        self.structured_output = StructuredOutputTracker(structured_output_manager)
        # Each beam is a request of its own; the coordinator holds their groups.
        self.beam_search = BeamSearchCoordinator(self.kv_cache_manager, self.max_model_len,
                                                 self.block_hasher)
        # Speculative decoding: drafts per request and step (k; 0: off).
        self.num_spec_tokens = scheduler_config.num_spec_tokens
        self.span_reservation = SpanReservation(scheduler_config.max_num_batched_tokens)

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, engine_request: EngineCoreRequest) -> None:
        req_id = engine_request.request_id
        if (req_id in self.requests or req_id in self.beam_search
                or (self.media is not None and self.media.holds(req_id))):
            raise ValueError(f"Request id {req_id!r} is already running.")
        if engine_request.mm_inputs:
            if self.media is None:
                raise ValueError("This model takes no images or audio.")
            self.media.admit(engine_request)  # its rows first (`_encode_media`)
            return
        self._enqueue(engine_request)

    def _enqueue(self, engine_request: EngineCoreRequest) -> None:
        if engine_request.sampling_params.beam_search is not None:
            request = self.beam_search.add(engine_request)  # the root beam
        else:
            request = Request.from_engine_core_request(engine_request, self.max_model_len,
                                                       self.block_hasher)
        if request.sampling_params.structured_outputs is not None:
            self.structured_output.submit(request)  # it waits for its grammar
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Ends requests from outside: an abort, or a stop string the front end matched
        (FINISHED_STOPPED; a request that asked for its hidden states still returns them).
        A beam-search request ends with all its beams. Unknown ids are ignored."""
        for req_id in request_ids:
            beams = self.beam_search.finish(req_id)
            if beams is not None:
                for beam in beams:
                    self._drop_beam(beam)
                continue
            request = self.requests.get(req_id)
            if request is None:
                if self.media is not None:  # its rows not computed yet: nothing else held
                    self.media.drop([req_id])
                continue
            if req_id in self.held_for_rows:  # already finished, rows not yet read
                if status == RequestStatus.FINISHED_ABORTED:
                    del self.held_for_rows[req_id]
                    self._release(request)
                continue
            if status == RequestStatus.FINISHED_STOPPED and _wants_rows(request):
                self._stop_with_rows(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            self.finished_req_ids.append(req_id)

    def _stop_with_rows(self, request: Request) -> None:
        """Stops a request whose rows must still be returned. Running with every token but
        the last computed (the usual case), its rows are complete: it finishes now. Else it
        was preempted meanwhile: it runs on to its next sampled token, which recomputes
        every row, and finishes there (the front end keeps the rows it needs)."""
        if (request.status == RequestStatus.RUNNING
                and request.num_computed_tokens >= request.num_tokens - 1):
            self.running.remove(request)
            request.status = RequestStatus.FINISHED_STOPPED
            final = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.STOP,
                                     num_cached_tokens=request.num_cached_tokens or 0)
            self._finish(request, final, [])
        else:
            request.stop_requested = True

    def _finish(self, request: Request, final: EngineCoreOutput,
                outputs: list[EngineCoreOutput]) -> None:
        """Ends a request that left `running`: its final output goes to `outputs`, or, if
        it asked for its hidden states, waits with its blocks for the runner's rows."""
        self.finished_req_ids.append(request.request_id)
        if _wants_rows(request):
            self.held_for_rows[request.request_id] = final
            return
        outputs.append(final)
        self._release(request)

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._num_media_pending())

    def has_finished_requests(self) -> bool:
        """Finished ids not yet delivered to the runner (it frees their state then), or
        finished requests whose rows it has yet to read."""
        return bool(self.finished_req_ids or self.held_for_rows or self.media_failures)

    def has_requests(self) -> bool:
        return self.has_unfinished_requests() or self.has_finished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + self._num_media_pending()

    def _num_media_pending(self) -> int:
        return 0 if self.media is None else len(self.media.pending)

    # ---- beam search ----------------------------------------------------------------

    def _apply_beam_update(self, update: BeamUpdate, outputs: list[EngineCoreOutput]) -> None:
        """Queues the beams that forked (a fork without its parent's blocks recomputes from
        scratch) and drops those that ended; a finished search's output goes to `outputs`."""
        for child, runs in update.forks:
            self.requests[child.request_id] = child
            if runs:
                self.running.append(child)
            else:
                child.num_computed_tokens = 0
                child.status = RequestStatus.WAITING
                self.waiting.appendleft(child)
        for request in update.dropped:
            self._drop_beam(request)
        if update.output is not None:
            outputs.append(update.output)

    def _preempt_parked_beam(self, step: _Step) -> bool:
        """When nothing could be scheduled because beams that wait for the rest of their
        group hold the blocks a waiting request needs, preempts the newest of them."""
        victim = parked_victim(self.running, self.waiting)
        if victim is None:
            return False
        self.running.remove(victim)
        self._preempt(victim)
        step.preempted.append(victim)
        return True

    def _drop_beam(self, request: Request) -> None:
        """A beam that ends (not chosen, its group done or aborted): it leaves the queues and
        gives its blocks back; the runner forgets it."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._release(request)
        self.finished_req_ids.append(request.request_id)

    # ---- scheduling ---------------------------------------------------------------

    def _step_kind(self) -> InputKind | None:
        """Under `separate` embeds batching: the one kind of prompt a step takes, the oldest
        request's; None when kinds mix freely."""
        if self.config.prompt_embeds_batching != "separate":
            return None
        candidates = [*self.running, *self.waiting]
        if not candidates:
            return None
        return min(candidates, key=lambda r: r.arrival_time).prompt_kind

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens,
                     encoder_budget=self.config.max_num_encoder_input_tokens,
                     suspect=self.failure_isolation.next_suspect(self.requests))
        self._resolve_grammars()
        self._encode_media(step)
        kind = None if step.suspect is not None else self._step_kind()
        step.reserved_for, step.reserve = self.span_reservation.take(self.requests, kind,
                                                                     step.suspect)
        self._schedule_running(step, kind)
        if not step.preempted:
            self._schedule_waiting(step, kind)
        if step.reserve:  # its request could not be admitted (no seat, no blocks)
            step.reserve = 0
            self._schedule_running(step, kind, may_preempt=False)
        while not step.num_scheduled and self._preempt_parked_beam(step):
            self._schedule_waiting(step, kind)
        if step.suspect is not None and not step.num_scheduled:
            # The suspect waits for blocks that running requests hold: let them progress.
            step.suspect = None
            self._schedule_running(step, None)
        if kind is not None and not step.num_scheduled:
            # The oldest request's kind cannot run (it waits for blocks held by running
            # requests of the other kind): let those progress, admitting nothing new.
            self._schedule_running(step, kind.other)
        output = self._make_output(step)
        for request in (*step.cached_reqs, *step.new_reqs):
            request.num_computed_tokens += step.num_scheduled[request.request_id]
        return output

    def _encode_media(self, step: _Step) -> None:
        """Media requests, in arrival order, whose items fit the step's encoder budget get
        their rows (one encoder batch per modality) and join `waiting`. After the first that
        does not fit, only those costing nothing (every item cached or already in this
        step) are taken, so a large image is not overtaken by ever newer small ones. An item
        is never split: with the budget untouched, the first request is taken whatever its
        cost. A request whose item fails the encoder finishes with FinishReason.ERROR.

        Example: budget 400, 196 positions an image, pending [A, B, C(A), D, E(A)] with A
        cached: A costs 0, B 196, C 0, D 196, E 0; all five fit (392). Budget 300: A, B, C,
        then D (196 > 104) does not fit; E (0) is still taken; D waits for the next step.
        """
        media = self.media
        if media is None or not media.pending:
            return
        chosen: list[EngineCoreRequest] = []
        seen: set[bytes] = set()  # items already in this step's batch (or cached)
        blocked = False
        for engine_request in media.pending:
            step_items = set(seen)
            cost = media.encoder_cost(engine_request, step_items)
            untouched = step.encoder_budget == self.config.max_num_encoder_input_tokens
            if cost and (blocked or (cost > step.encoder_budget and not untouched)):
                blocked = True
                continue
            seen = step_items
            step.encoder_budget = max(0, step.encoder_budget - cost)
            chosen.append(engine_request)
        if not chosen:
            return
        filled, failed = media.take(chosen)
        for engine_request in filled:
            self._enqueue(engine_request)
        self.media_failures += [
            EngineCoreOutput(r.request_id, [], finish_reason=FinishReason.ERROR)
            for r in failed]

    def _schedule_running(self, step: _Step, kind: InputKind | None,
                          may_preempt: bool = True) -> None:
        """Running requests, oldest first; a request short of blocks preempts the newest
        (unless `may_preempt` is False: a second pass, where the newest may already be in
        this step, skips it)."""
        index = 0
        while (index < len(self.running) and step.budget > 0
               and len(step.num_scheduled) < self.config.max_num_seqs):
            request = self.running[index]
            budget = step.budget_for(request)
            num_new = self._num_new_tokens(request, budget)
            drafts = self._drafts_to_verify(request, num_new, budget)
            num_new += len(drafts)
            if ((kind is not None and request.prompt_kind is not kind) or num_new == 0
                    or request.request_id in step.num_scheduled
                    or (step.suspect is not None and request.request_id != step.suspect)):
                if num_new == 0 and budget > 0 and request.request_id not in step.num_scheduled:
                    self.span_reservation.blocked(request, request.num_computed_tokens)
                index += 1
                continue
            while (new_blocks := self.kv_cache_manager.allocate_slots(
                    request, num_new + self._lookahead(request, num_new))) is None:
                if not may_preempt:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                step.preempted.append(victim)
                if victim.request_id == step.reserved_for:
                    step.reserve = 0
                if victim is request:
                    return
            if new_blocks is None:
                index += 1
                continue
            if request.resend_in_full:  # a beam whose tokens the runner does not know
                request.resend_in_full = False
                step.new_reqs.append(request)
            else:
                step.cached_reqs.append(request)
            step.new_block_ids[request.request_id] = [block.block_id for block in new_blocks]
            step.take(request, num_new)
            self.span_reservation.served(request.request_id)
            if drafts:
                step.spec_tokens[request.request_id] = drafts
            index += 1

    def _schedule_waiting(self, step: _Step, kind: InputKind | None) -> None:
        skipped: list[Request] = []
        loras = LoRASlots(self.config.max_loras, self.running)
        # Beams waiting for their group's other beams hold no batch row.
        num_parked = sum(map(is_parked, self.running))
        while (self.waiting and step.budget > 0
               and len(self.running) - num_parked < self.config.max_num_seqs
               and len(step.num_scheduled) < self.config.max_num_seqs):
            request = self.waiting[0]
            if (request.status == RequestStatus.WAITING_FOR_GRAMMAR or is_parked(request)
                    or (kind is not None and request.prompt_kind is not kind)
                    or (step.suspect is not None and request.request_id != step.suspect)
                    or not loras.admits(request)):
                skipped.append(self.waiting.popleft())
                continue
            budget = step.budget_for(request)
            if budget == 0:  # what is left is reserved for a request behind it
                skipped.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = request.chunk_end(num_hit, num_hit + min(num_new, budget)) - num_hit
            if num_new == 0:  # its next image run does not fit what is left of the budget
                self.span_reservation.blocked(request, num_hit)
                break
            cross_hits = self.kv_cache_manager.get_cached_cross_blocks(request)
            encoder_cost = request.num_encoder_tokens if cross_hits is None else 0
            if encoder_cost > step.encoder_budget:
                break
            lookahead = self._lookahead(request, num_new, num_hit)
            if self.kv_cache_manager.allocate_slots(request, num_new + lookahead, hit_blocks,
                                                     num_hit, cross_hits) is None:
                break
            if encoder_cost:
                step.encoder_budget -= encoder_cost
                step.encoder_req_ids.append(request.request_id)
            self.waiting.popleft()
            self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            request.num_computed_tokens = num_hit
            request.resend_in_full = False
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            loras.add(request)
            step.new_reqs.append(request)
            step.take(request, num_new)
            self.span_reservation.served(request.request_id)
        self.waiting.extendleft(reversed(skipped))

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        computed = request.num_computed_tokens
        num_new = min(request.num_tokens - computed, budget)
        # The token at position max_model_len - 1 is the last that needs a KV slot.
        num_new = max(0, min(num_new, self.max_model_len - computed))
        return request.chunk_end(computed, computed + num_new) - computed

    def _drafts_to_verify(self, request: Request, num_new: int, budget: int) -> list[int]:
        """A decoding request's drafts that this step verifies with its last token: as
        many as fit the budget, max_model_len (their KV slots) and its max_tokens (one
        more token is always sampled after them)."""
        drafts = request.spec_token_ids
        if not drafts or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return []
        room = min(budget - 1, self.max_model_len - request.num_tokens,
                   request.max_tokens - request.num_output_tokens - 1)
        return self.structured_output.valid_drafts(request, drafts[:max(0, room)])

    def _lookahead(self, request: Request, num_new: int, num_hit: int = 0) -> int:
        """KV slots past a step's tokens for the drafts a draft model writes after it
        (none where the step does not reach the end of the known tokens)."""
        end = request.num_computed_tokens + num_hit + num_new
        if not self.config.num_lookahead_tokens or end < request.num_tokens:
            return 0
        return max(0, min(self.config.num_lookahead_tokens, self.max_model_len - end))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _make_output(self, step: _Step) -> SchedulerOutput:
        kv_manager = self.kv_cache_manager
        new_data = [NewRequestData.from_request(r, kv_manager.get_block_ids(r.request_id),
                                                kv_manager.get_cross_block_ids(r.request_id))
                    for r in step.new_reqs]
        cached = CachedRequestData()
        for request in step.cached_reqs:
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(step.new_block_ids[request.request_id])
            cached.num_computed_tokens.append(request.num_computed_tokens)
        finished, self.finished_req_ids = self.finished_req_ids, []
        rows = [RowsToGather(req_id, kv_manager.get_group_block_ids(req_id),
                             self.requests[req_id].num_tokens - 1)
                for req_id in self.held_for_rows]
        grammar_ids, bitmask = self.structured_output.bitmask(self.requests, step.num_scheduled,
                                                              step.spec_tokens)
        return SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=sum(step.num_scheduled.values()),
            finished_req_ids=finished,
            preempted_req_ids=[r.request_id for r in step.preempted],
            scheduled_encoder_inputs=step.encoder_req_ids,
            rows_to_gather=rows,
            structured_output_request_ids=grammar_ids,
            grammar_bitmask=bitmask,
            blocks_to_copy=self.beam_search.take_block_copies(),
            scheduled_spec_decode_tokens=step.spec_tokens,
        )

    def _resolve_grammars(self) -> None:
        """Requests whose grammar compiled become schedulable; one whose grammar failed
        finishes with FinishReason.ERROR (its output leaves with the next outputs)."""
        for request in self.structured_output.resolve(self.waiting, idle=not self.running):
            self.waiting.remove(request)
            request.status = RequestStatus.FINISHED_ERROR
            self._release(request)
            self.finished_req_ids.append(request.request_id)

    # ---- results ------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        outputs = self._release_held(scheduler_output, runner_output)
        outputs += self.structured_output.take_failures()
        outputs += self._take_media_failures()
        self.failure_isolation.step_ran(len(scheduler_output.num_scheduled_tokens))
        spec_stats = (SpecDecodingStats.new(self.num_spec_tokens)
                      if scheduler_output.scheduled_spec_decode_tokens else None)
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            index = runner_output.req_id_to_index[req_id]
            new_token_ids = runner_output.sampled_token_ids[index]
            if not new_token_ids:
                continue  # a prefill chunk that did not reach the end of the prompt
            self.failure_isolation.cleared(req_id)  # if a suspect, it ran alone to a token
            new_logprobs = runner_output.logprobs_of(index)
            if request.beam_group is not None:
                assert new_logprobs is not None  # beam rows always ask for their candidates
                self._apply_beam_update(self.beam_search.sampled(request, new_logprobs),
                                        outputs)
                continue
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # Rejected drafts' KV slots are simply overwritten later.
                request.num_computed_tokens -= len(drafts) + 1 - len(new_token_ids)
                assert spec_stats is not None  # drafts were scheduled
                spec_stats.observe(len(drafts), len(new_token_ids) - 1)
            new_token_ids, stopped = append_until_stop(request, new_token_ids,
                                                       self.max_model_len)
            if new_logprobs is not None and len(new_logprobs.ranks) > len(new_token_ids):
                n = len(new_token_ids)
                new_logprobs = LogprobsLists(new_logprobs.token_ids[:n],
                                             new_logprobs.logprobs[:n], new_logprobs.ranks[:n])
            self.structured_output.accept(request, new_token_ids)
            if runner_output.spec_token_ids is not None and not stopped:
                request.spec_token_ids = runner_output.spec_token_ids[index]
            output = EngineCoreOutput(
                request_id=req_id,
                new_token_ids=new_token_ids,
                new_logprobs=new_logprobs,
                finish_reason=request.get_finished_reason(),
                stop_reason=request.stop_reason,
                num_cached_tokens=request.num_cached_tokens or 0,
            )
            if stopped:
                self.running.remove(request)
                self._finish(request, output, outputs)
            else:
                outputs.append(output)
        return EngineCoreOutputs(outputs, self.make_stats(spec_stats))

    def _release_held(self, scheduler_output: SchedulerOutput,
                      runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """The final outputs of requests whose rows the runner read this step, rows attached
        (passed through, never kept); their blocks go back to the pool now."""
        outputs = []
        for gathered in scheduler_output.rows_to_gather:
            final = self.held_for_rows.pop(gathered.req_id, None)
            if final is None:
                continue
            final.hidden_states = runner_output.hidden_states.get(gathered.req_id)
            self._release(self.requests[gathered.req_id])
            outputs.append(final)
        return outputs

    # ---- failed steps -------------------------------------------------------------

    def recover_from_failed_step(self, scheduler_output: SchedulerOutput) -> EngineCoreOutputs:
        """Undoes a step whose execution raised, blaming one request when it can.

        The blocks the step was to fill leave the prefix cache (their K/V may never have
        been written). A step of one request convicts it: it finishes with
        FinishReason.ERROR and its blocks go back. The requests of a failed batch go back to
        waiting with nothing computed (as if preempted) and become suspects, each then
        scheduled alone until it samples a token (cleared) or fails alone (convicted).

        Raises:
            EngineStepError: the failure cannot be attributed, or it repeats (see
                `FailureIsolation.blame`).
        """
        # The runner may not have dropped these yet; it does so (idempotently) next step.
        self.finished_req_ids[:0] = scheduler_output.finished_req_ids
        num_scheduled = scheduler_output.num_scheduled_tokens
        scheduled = [self.requests[req_id] for req_id in num_scheduled]
        for request in scheduled:
            req_id = request.request_id
            self.kv_cache_manager.uncache_uncomputed(
                request, request.num_computed_tokens - num_scheduled[req_id],
                req_id in scheduler_output.scheduled_encoder_inputs)
        failures = self.structured_output.take_failures() + self._take_media_failures()
        culprit = self.failure_isolation.blame(list(num_scheduled))
        if culprit is not None:
            return EngineCoreOutputs([*failures, self._convict(self.requests[culprit])],
                                     self.make_stats())
        for request in reversed(scheduled):  # preempting puts each at the front: keep order
            self.running.remove(request)
            self._preempt(request)
        return EngineCoreOutputs(failures, self.make_stats())

    def _take_media_failures(self) -> list[EngineCoreOutput]:
        failures, self.media_failures = self.media_failures, []
        return failures

    def _convict(self, request: Request) -> EngineCoreOutput:
        """Finishes the lone request of a failed step with FinishReason.ERROR."""
        group = request.beam_group
        if group is not None:  # a failing beam fails its whole request
            self.finish_requests([group.request_id], RequestStatus.FINISHED_ERROR)
            return EngineCoreOutput(group.request_id, [], finish_reason=FinishReason.ERROR)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        self._release(request)
        self.finished_req_ids.append(request.request_id)
        return EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                                num_cached_tokens=request.num_cached_tokens or 0)

    def make_stats(self, spec_decoding: SpecDecodingStats | None = None) -> SchedulerStats:
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            spec_decoding=spec_decoding if spec_decoding and spec_decoding.num_drafts else None,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + self._num_media_pending(),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
        )


def _wants_rows(request: Request) -> bool:
    return request.sampling_params.return_hidden_states
