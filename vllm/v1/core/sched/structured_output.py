"""`StructuredOutputTracker`: the scheduler's side of structured outputs (grammar compiles,
matchers, per-step bitmasks, failed grammars)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from vllm.v1.messages import EngineCoreOutput, FinishReason
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output.manager import StructuredOutputManager, grammar_error

logger = logging.getLogger(__name__)


class StructuredOutputTracker:
    """Tracks the grammars of the scheduler's constrained requests.

    A constrained request waits (WAITING_FOR_GRAMMAR) while its grammar compiles on the
    manager's thread (`submit`); `resolve` lets it be scheduled once compiled, or reports
    it failed (a grammar that fails ends only its request). Each step, `bitmask` packs the
    allowed tokens of the constrained rows that sample; drafts are cut to what the grammar
    allows (`valid_drafts`), and sampled tokens advance the matcher (`accept`).

    Owns the grammar-failure outputs until the next outputs leave (`take_failures`) and
    the requests' grammar fields; the scheduler owns the requests and queues.
    """

    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager  # None: this engine has no structured-output support
        self.failures: list[EngineCoreOutput] = []  # sent with the next outputs

    def submit(self, request: Request) -> None:
        """Starts compiling `request`'s grammar; it waits until `resolve` sees it done."""
        constraint = request.sampling_params.structured_outputs
        assert constraint is not None
        if self.manager is None:
            raise ValueError("This engine has no structured-output support.")
        request.grammar_future = self.manager.submit(constraint)
        request.status = RequestStatus.WAITING_FOR_GRAMMAR

    def resolve(self, waiting: Sequence[Request], idle: bool) -> list[Request]:
        """Requests whose grammar finished compiling become WAITING (schedulable); a
        failed one's output (FinishReason.ERROR, the reason as its stop_reason) is kept
        for `take_failures`. When `idle` (nothing runs) and every waiting request waits
        for a grammar, waits (briefly) for a compile rather than spin through empty steps.

        Returns:
            The requests whose grammar failed, in `waiting` order: the caller ends them.
        """
        pending = [r for r in waiting if r.status == RequestStatus.WAITING_FOR_GRAMMAR]
        if not pending:
            return []
        if idle and len(pending) == len(waiting):
            futures = [r.grammar_future for r in pending if r.grammar_future is not None]
            wait(futures, timeout=0.05, return_when=FIRST_COMPLETED)
        failed = []
        for request in pending:
            future = request.grammar_future
            assert future is not None  # set with WAITING_FOR_GRAMMAR
            if not future.done():
                continue
            request.grammar_future = None
            error = grammar_error(future)
            if error is None:
                request.grammar = future.result()
                request.status = RequestStatus.WAITING
                continue
            logger.warning("Request %s: %s", request.request_id, error)
            failed.append(request)
            self.failures.append(EngineCoreOutput(
                request.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=error))
        return failed

    def take_failures(self) -> list[EngineCoreOutput]:
        failures, self.failures = self.failures, []
        return failures

    def valid_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The leading drafts that `request`'s grammar allows (all without a grammar);
        the matcher is left where it was."""
        grammar = request.grammar
        if grammar is None:
            return drafts
        num_valid = 0
        while num_valid < len(drafts) and grammar.accept_tokens([drafts[num_valid]]):
            num_valid += 1
        if num_valid:
            grammar.rollback(num_valid)
        return drafts[:num_valid]

    def accept(self, request: Request, token_ids: list[int]) -> None:
        """Advances `request`'s matcher past its sampled tokens."""
        if request.grammar is not None and not request.grammar.accept_tokens(token_ids):
            logger.warning("Request %s: its grammar rejected sampled token(s) %s.",
                           request.request_id, token_ids)

    def bitmask(self, requests: dict[str, Request], num_scheduled: dict[str, int],
                spec_tokens: dict[str, list[int]]) -> tuple[list[str], torch.Tensor | None]:
        """The constrained requests that sample this step (their scheduled tokens reach the
        end of what they know) and their packed allowed-token masks, one row each, or with
        drafts one per verified position (the request's id repeated; row j: after the
        first j drafts).

        Example: "a" (constrained, 2 drafts) and "b" (constrained, none) sample, "c" is
        unconstrained -> (["a", "a", "a", "b"], bitmask of 4 rows).
        """
        rows = []
        for req_id, num_new in num_scheduled.items():
            request = requests[req_id]
            if (request.grammar is not None
                    and request.num_computed_tokens + num_new >= request.num_tokens):
                rows.append(request)
        if not rows:
            return [], None
        assert self.manager is not None  # requests got their grammars from it
        drafts = [spec_tokens.get(r.request_id, []) for r in rows]
        bitmask = self.manager.grammar_bitmask([r.grammar for r in rows], drafts)
        return [r.request_id for r, d in zip(rows, drafts) for _ in range(1 + len(d))], bitmask
