"""Beam search in the scheduler: `BeamSearchCoordinator` (the groups of the beam-search
requests, forks and drops of their beams) and `BeamGroup` (the beams of one request and the
ranking of their candidates).

Each live beam is a `Request` of its own in the scheduler (the root one runs the prompt;
the others are forks sharing its KV blocks, see `KVCacheManager.fork`). A beam's rows
sample greedily with its top candidates' log-probabilities returned; the scheduler hands
each beam's candidates to its group (`record`) instead of appending a token, and once
every live beam has reported, `advance` ranks them the way `transformers`' beam search
does (`generate(num_beams=k, do_sample=False)`, `early_stopping=False`):

- the `num_keep` best continuations by cumulative log-probability over all beams;
- those among the first k that end (an end-of-sequence id, or the token limit) become
  finished hypotheses scored `cum_logprob / num_generated ** length_penalty`, of which
  the k best are kept;
- the k best continuations that do not end are the next step's beams;
- the search is done at the token limit, or once k hypotheses are finished and the best
  running beam's cumulative log-probability over the current length cannot beat the
  worst of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from vllm.sampling_params import BeamSearchParams, SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.messages import (
    BeamHypothesis,
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
)
from vllm.v1.outputs import LogprobsLists
from vllm.v1.request import Request, RequestStatus


class Candidate(NamedTuple):
    cum_logprob: float
    beam: int  # index of the parent beam in rank order
    rank: int  # the token's rank among its beam's candidates (0: most likely)
    token_id: int
    logprob: float


@dataclass
class Beam:
    """A live hypothesis: the request computing it and its history so far."""

    request: Request
    cum_logprob: float = 0.0
    # Per generated token: [chosen, candidates...] ids and log-probabilities, chosen's rank.
    token_rows: list[list[int]] = field(default_factory=list)
    logprob_rows: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    # This step's candidates (ids, log-probabilities, most likely first), once sampled.
    pending: tuple[list[int], list[float]] | None = None


class Child(NamedTuple):
    """A beam of the next step: `parent`'s tokens plus `candidate.token_id`."""

    parent: Beam
    candidate: Candidate


class BeamGroup:
    """The live beams and finished hypotheses of one request (engine-core id
    `request_id`); it decides, the scheduler applies (forks, frees, appends)."""

    def __init__(self, request_id: str, params: BeamSearchParams, stop_ids: set[int],
                 max_tokens: int) -> None:
        self.request_id = request_id
        self.params = params
        self.width = params.beam_width
        self.stop_ids = set() if params.ignore_eos else stop_ids
        self.num_keep = params.num_candidates(len(self.stop_ids))
        self.max_tokens = max_tokens  # generated tokens at most (the root's limit)
        self.beams: list[Beam] = []
        self.finished: list[BeamHypothesis] = []  # best first, at most `width`
        self.num_generated = 0
        self.done = False
        self.num_forks = 0  # beam ids are f"{request_id}#{n}"

    def next_beam_id(self) -> str:
        beam_id = f"{self.request_id}#{self.num_forks}"
        self.num_forks += 1
        return beam_id

    def beam_of(self, request: Request) -> Beam:
        return next(b for b in self.beams if b.request is request)

    def has_reported(self, request: Request) -> bool:
        """Whether this beam's candidates for the current step are in (it waits, even if
        preempted meanwhile, until the group moves on)."""
        return self.beam_of(request).pending is not None

    def record(self, request: Request, candidates: LogprobsLists) -> bool:
        """Keeps a beam's candidates (row 0 of `candidates`: the sampled token, then the
        top ones); returns whether every live beam has reported."""
        beam = self.beam_of(request)
        beam.pending = (candidates.token_ids[0][1:], candidates.logprobs[0][1:])
        return all(b.pending is not None for b in self.beams)

    def advance(self) -> list[Child]:
        """Ranks the reported candidates; returns the next beams, best first (empty when
        the search is done). Parents that no child names are dropped by the caller."""
        candidates = rank_candidates([b.cum_logprob for b in self.beams],
                                     [b.pending for b in self.beams if b.pending is not None],
                                     self.num_keep)
        self.num_generated += 1
        at_limit = self.num_generated >= self.max_tokens
        ends = [at_limit or c.token_id in self.stop_ids for c in candidates]
        for candidate, end in zip(candidates[:self.width], ends):
            if end:
                self._add_finished(self.beams[candidate.beam], candidate)
        running = [c for c, end in zip(candidates, ends) if not end][:self.width]
        self.done = at_limit or not running or self._cannot_improve(running[0])
        if self.done:
            return []
        return [Child(self.beams[c.beam], c) for c in running]

    def _cannot_improve(self, best_running: Candidate) -> bool:
        if len(self.finished) < self.width:
            return False
        best = best_running.cum_logprob / self.num_generated ** self.params.length_penalty
        return best <= self.finished[-1].score

    def _add_finished(self, beam: Beam, candidate: Candidate) -> None:
        token_ids = [*beam.request.output_token_ids, candidate.token_id]
        score = candidate.cum_logprob / len(token_ids) ** self.params.length_penalty
        stopped = candidate.token_id in self.stop_ids
        rows = extend_history(beam, candidate)
        hypothesis = BeamHypothesis(
            token_ids=token_ids, cum_logprob=candidate.cum_logprob, score=score,
            finish_reason=FinishReason.STOP if stopped else FinishReason.LENGTH,
            stop_reason=(candidate.token_id if stopped
                         and candidate.token_id != beam.request.eos_token_id else None),
            logprobs=LogprobsLists(*rows))
        # Stable: an earlier hypothesis stays ahead of a later one of equal score.
        self.finished.append(hypothesis)
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width:]


def rank_candidates(cum_logprobs: list[float],
                    pending: list[tuple[list[int], list[float]]],
                    num_keep: int) -> list[Candidate]:
    """The `num_keep` best continuations of all beams by cumulative log-probability
    (ties: the better beam, then the likelier token).

    Example: beams with cum [-1.0, -1.5], candidates beam 0 {7: -0.5, 8: -2.0}, beam 1
    {9: -0.1, 7: -0.2}, num_keep 3 -> (cum -1.5, beam 0, token 7), (-1.6, beam 1, 9),
    (-1.7, beam 1, 7).
    """
    candidates = [Candidate(cum + logprob, beam, rank, token_id, logprob)
                  for beam, (cum, (token_ids, logprobs)) in enumerate(zip(cum_logprobs,
                                                                          pending))
                  for rank, (token_id, logprob) in enumerate(zip(token_ids, logprobs))]
    candidates.sort(key=lambda c: (-c.cum_logprob, c.beam, c.rank))
    return candidates[:num_keep]


def extend_history(beam: Beam, candidate: Candidate
                   ) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """The beam's logprob rows with this step's appended: [chosen, candidates...]."""
    assert beam.pending is not None
    token_ids, logprobs = beam.pending
    return ([*beam.token_rows, [candidate.token_id, *token_ids]],
            [*beam.logprob_rows, [candidate.logprob, *logprobs]],
            [*beam.ranks, candidate.rank + 1])


class Fork(NamedTuple):
    """A beam forked this step. `runs`: it shares its running parent's blocks and joins
    the running requests; else it waits and is computed from scratch."""

    request: Request
    runs: bool


class BeamUpdate(NamedTuple):
    """What one beam's sampled candidates change, for the scheduler to apply."""

    forks: list[Fork]  # new beams' requests, in the order they forked
    dropped: list[Request]  # beams that end: they leave the queues, their blocks go back
    output: EngineCoreOutput | None  # the request's final output, once its search is done


class BeamSearchCoordinator:
    """Runs the beam-search requests on the scheduler's requests.

    A beam-search request becomes a root beam (`{id}#0`, `add`) that runs the prompt; each
    time one of its beams has sampled, its group may move on (`sampled`): beams continue
    in their own request, fork (a new request sharing the parent's blocks through
    `KVCacheManager.fork`) or end, and the search ends with the best hypotheses.

    Owns the groups (by engine-core request id) and the block copies that forks wait for.
    The scheduler owns the requests and queues: it registers, queues and drops the beams
    this class returns (`BeamUpdate`).
    """

    def __init__(self, kv_cache_manager: KVCacheManager, max_model_len: int,
                 block_hasher: Callable[[Request], list[BlockHash]] | None) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.block_hasher = block_hasher
        self.groups: dict[str, BeamGroup] = {}
        self.block_copies: list[tuple[int, int]] = []  # (source, destination), sent next step

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.groups

    def add(self, engine_request: EngineCoreRequest) -> Request:
        """Starts a beam-search request; returns its root beam, which samples greedily with
        its top candidates' log-probabilities (the caller queues it)."""
        params = engine_request.sampling_params
        beam_params = params.beam_search
        assert beam_params is not None
        group = BeamGroup(engine_request.request_id, beam_params,
                          set(params.end_of_sequence_ids()), 0)
        row_params = SamplingParams(temperature=0.0, max_tokens=beam_params.max_tokens,
                                    ignore_eos=True, logprobs=group.num_keep)
        root = Request.from_engine_core_request(
            dataclasses.replace(engine_request, request_id=group.next_beam_id(),
                                sampling_params=row_params),
            self.max_model_len, self.block_hasher)
        root.beam_group = group
        group.max_tokens = root.max_tokens
        group.beams.append(Beam(root))
        self.groups[group.request_id] = group
        return root

    def sampled(self, request: Request, logprobs: LogprobsLists) -> BeamUpdate:
        """A beam's candidates are in; once its group has them all, the group moves on:
        beams continue (their chosen token appended), fork or are dropped, or the group
        finishes with its best hypotheses."""
        group: BeamGroup = request.beam_group
        if request.num_computed_tokens < request.num_tokens:
            # It got its next token after this step was scheduled: a stale result.
            return BeamUpdate([], [], None)
        if not group.record(request, logprobs):
            return BeamUpdate([], [], None)
        children = group.advance()
        if group.done:
            del self.groups[group.request_id]
            best = group.finished[0]
            output = EngineCoreOutput(
                group.request_id, [], finish_reason=best.finish_reason,
                stop_reason=best.stop_reason,
                num_cached_tokens=group.beams[0].request.num_cached_tokens or 0,
                beams=group.finished)
            return BeamUpdate([], [beam.request for beam in group.beams], output)
        return self._apply_children(group, children)

    def _apply_children(self, group: BeamGroup, children: list[Child]) -> BeamUpdate:
        """The next step's beams: a parent's first child continues in the parent's request,
        its other children fork (before the parent grows), parents without children go."""
        beams: list[Beam] = []
        forks: list[Fork] = []
        continued: list[int] = []  # id() of the parents that continue
        for parent, candidate in children:
            if id(parent) in continued:
                child = parent.request.fork(group.next_beam_id())
                copies = self.kv_cache_manager.fork(parent.request, child)
                if copies is not None:
                    self.block_copies += copies
                forks.append(Fork(child, copies is not None
                                  and parent.request.status == RequestStatus.RUNNING))
                beams.append(Beam(child))
            else:
                continued.append(id(parent))
                beams.append(Beam(parent.request))
            beam = beams[-1]
            beam.token_rows, beam.logprob_rows, beam.ranks = extend_history(parent, candidate)
            beam.cum_logprob = candidate.cum_logprob
        dropped = [parent.request for parent in group.beams if id(parent) not in continued]
        for beam, (_, candidate) in zip(beams, children):
            beam.request.append_output_token_ids([candidate.token_id])
            beam.request.resend_in_full = True
        group.beams = beams
        return BeamUpdate(forks, dropped, None)

    def finish(self, request_id: str) -> list[Request] | None:
        """Ends a beam-search request from outside; returns its live beams for the caller
        to drop (None: `request_id` is not a beam-search request)."""
        group = self.groups.pop(request_id, None)
        return None if group is None else [beam.request for beam in group.beams]

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self.block_copies = self.block_copies, []
        return copies


def is_parked(request: Request) -> bool:
    """A beam that has reported its candidates and waits for its group's other beams."""
    group = request.beam_group
    return group is not None and group.has_reported(request)


def parked_victim(running: Sequence[Request], waiting: Sequence[Request]) -> Request | None:
    """When nothing could be scheduled: the newest running beam that waits for its group's
    other beams, to preempt for a waiting request that could run (its candidates are kept:
    it is recomputed only once its group moves on); None if there is none or no such
    waiting request."""
    if not any(r.status != RequestStatus.WAITING_FOR_GRAMMAR and not is_parked(r)
               for r in waiting):
        return None
    return next((r for r in reversed(running) if is_parked(r)), None)
