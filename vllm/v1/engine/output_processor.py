"""`OutputProcessor`: engine-core outputs -> user `RequestOutput`s (text, logprobs, n>1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import BeamHypothesis, EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.engine.detokenizer import IncrementalDetokenizer
from vllm.v1.outputs import Logprob, LogprobsLists


@dataclass
class ParentRequest:
    """Gathers the n child sequences of one user request (n > 1)."""

    request_id: str  # the engine-core id the children's ids derive from
    n: int
    output_kind: RequestOutputKind
    completions: list[CompletionOutput | None] = field(default_factory=list)
    num_finished: int = 0

    def __post_init__(self) -> None:
        self.completions = [None] * self.n


@dataclass
class RequestState:
    request_id: str  # the engine-core id (a child id when n > 1)
    parent: ParentRequest | None
    index: int
    prompt: str | None
    prompt_token_ids: list[int] | None
    num_prompt_tokens: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    num_cached_tokens: int = 0
    sent_text_len: int = 0
    sent_num_tokens: int = 0
    queue: Any = None  # AsyncLLM: where this request's outputs go
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    # A stop string finished it here, but it asked for its hidden states: (finish reason,
    # stop reason) until the engine core's last output for it brings the rows.
    awaiting_rows: tuple[FinishReason, int | str | None] | None = None
    external_id: str = ""  # the id the user gave (what RequestOutput.request_id says)


class OutputProcessor:
    """Owns detokenizer state and stop-string matching for every live request.

    A request has the id its user gave (external) and engine-core ids: its own, or its
    children's when n > 1. `AsyncLLM` makes every submission's engine-core id unique, so a
    late abort or output of a finished request can never reach a newer one with the same
    external id. Aborts name external ids only: a child cannot be aborted on its own.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}
        # Live external id -> its engine-core id (the request's, or its parent's).
        self.live_ids: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None,
                    prompt_token_ids: list[int] | None, num_prompt_tokens: int,
                    params: SamplingParams, parent: ParentRequest | None = None,
                    index: int = 0, queue: Any = None, encoder_prompt: str | None = None,
                    encoder_prompt_token_ids: list[int] | None = None,
                    external_id: str | None = None) -> None:
        # Nobody sees the text before the end, and no stop string needs it: decode once.
        assert isinstance(params.stop, list)  # SamplingParams.__post_init__ made it one
        incremental = bool(params.stop) or params.output_kind != RequestOutputKind.FINAL_ONLY
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                       params.skip_special_tokens, params.stop,
                                       params.include_stop_str_in_output, params.min_tokens,
                                       incremental)
        wants_logprobs = params.logprobs is not None
        self.request_states[request_id] = RequestState(
            request_id, parent, index, prompt, prompt_token_ids, num_prompt_tokens, params,
            detok, [] if wants_logprobs else None, 0.0 if wants_logprobs else None,
            queue=queue, encoder_prompt=encoder_prompt,
            encoder_prompt_token_ids=encoder_prompt_token_ids)
        core_id = parent.request_id if parent is not None else request_id
        state = self.request_states[request_id]
        state.external_id = external_id if external_id is not None else core_id
        self.live_ids[state.external_id] = core_id
        if parent is not None:
            self.parents[parent.request_id] = parent

    def check_request_id(self, request_id: str) -> None:
        """Raises ValueError if a live request already has this (external) id."""
        if request_id in self.live_ids:
            raise ValueError(f"Request id {request_id!r} is already in use by a request "
                             "that has not finished.")

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forgets live requests by external id; returns the engine-core ids to abort.
        Ids of finished or unknown requests (and child ids) are ignored."""
        to_abort = []
        for external_id in request_ids:
            req_id = self.live_ids.pop(external_id, None)
            if req_id is None:
                continue
            parent = self.parents.pop(req_id, None)
            ids = [s.request_id for s in self.request_states.values()
                   if s.parent is parent] if parent else [req_id]
            for core_id in ids:
                if self.request_states.pop(core_id, None) is not None:
                    to_abort.append(core_id)
        return to_abort

    def process_outputs(self, outputs: EngineCoreOutputs
                        ) -> tuple[list[tuple[RequestState, RequestOutput]], list[str]]:
        """Returns (request outputs ready for users, with their states) and the ids that
        a stop string finished, which the engine core must stop."""
        ready: list[tuple[RequestState, RequestOutput]] = []
        reqs_to_stop: list[str] = []
        for out in outputs.outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # aborted meanwhile
            if out.beams is not None:
                self._forget_finished(state)
                request_output = self._beam_output(state, out.beams, out.num_cached_tokens)
            elif state.awaiting_rows is not None:
                request_output = self._finish_with_rows(state, out, state.awaiting_rows)
            else:
                request_output = self._process_output(state, out, reqs_to_stop)
            if request_output is not None:
                ready.append((state, request_output))
        return ready, reqs_to_stop

    def _process_output(self, state: RequestState, out: EngineCoreOutput,
                        reqs_to_stop: list[str]) -> RequestOutput | None:
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        state.num_cached_tokens = out.num_cached_tokens
        num_before = len(state.detokenizer.token_ids)
        stop_str = state.detokenizer.update(out.new_token_ids, finish_reason == FinishReason.STOP)
        num_kept = len(state.detokenizer.token_ids) - num_before  # cut at a stop string
        if stop_str is not None:
            if finish_reason is None:  # the engine core still runs it
                reqs_to_stop.append(out.request_id)
            finish_reason, stop_reason = FinishReason.STOP, stop_str
        elif finish_reason is not None:
            state.detokenizer.flush()
        if out.new_logprobs is not None and state.logprobs is not None:
            self._append_logprobs(state, out.new_logprobs, num_kept)
        if finish_reason is None:
            return self._make_request_output(state, None, None)
        if out.finish_reason is None and state.params.return_hidden_states:
            state.awaiting_rows = (finish_reason, stop_reason)
            return None  # the final output leaves with the rows
        self._forget_finished(state)
        return self._make_request_output(state, finish_reason, stop_reason, out.hidden_states)

    def _finish_with_rows(self, state: RequestState, out: EngineCoreOutput,
                          awaiting_rows: tuple[FinishReason, int | str | None]
                          ) -> RequestOutput | None:
        """The core's outputs for a request a stop string already finished here: tokens it
        made meanwhile are dropped; its last output brings the rows, cut to the positions
        of the tokens kept."""
        if not out.finished:
            return None
        self._forget_finished(state)
        rows = out.hidden_states
        if rows is not None:
            rows = rows[:state.num_prompt_tokens + len(state.detokenizer.token_ids) - 1]
        return self._make_request_output(state, *awaiting_rows, rows)

    def _beam_output(self, state: RequestState, beams: list[BeamHypothesis],
                     num_cached_tokens: int) -> RequestOutput:
        """A beam-search request's one output: its n best beams as completions, best first
        (`cumulative_logprob` is the beam's; with `logprobs`, each token's dict holds the
        chosen token and up to `logprobs` of the candidates its beam ranked)."""
        params = state.params
        k = params.logprobs
        detok = state.detokenizer
        completions = []
        for index, beam in enumerate(beams[:params.n]):
            tokens = beam.token_ids
            if beam.finish_reason == FinishReason.STOP and not params.include_stop_str_in_output:
                tokens = tokens[:-1]  # the end-of-sequence token's text is left out
            text = ("" if self.tokenizer is None else self.tokenizer.decode(
                tokens, skip_special_tokens=params.skip_special_tokens))
            logprobs = None
            if k is not None:
                logprobs = []
                for ids, values, rank in zip(*beam.logprobs):
                    entry = {ids[0]: Logprob(values[0], rank, detok.decode_token(ids[0]))}
                    for r, (tid, value) in enumerate(zip(ids[1:k + 1], values[1:k + 1]), 1):
                        entry.setdefault(tid, Logprob(value, r, detok.decode_token(tid)))
                    logprobs.append(entry)
            completions.append(CompletionOutput(
                index=index, text=text, token_ids=list(beam.token_ids),
                cumulative_logprob=beam.cum_logprob, logprobs=logprobs,
                finish_reason=str(beam.finish_reason), stop_reason=beam.stop_reason))
        state.num_cached_tokens = num_cached_tokens
        return self._request_output(state, completions, True)

    def _forget_finished(self, state: RequestState) -> None:
        del self.request_states[state.request_id]
        if state.parent is None:
            self.live_ids.pop(state.external_id, None)

    def _append_logprobs(self, state: RequestState, new_logprobs: LogprobsLists,
                         num_rows: int | None = None) -> None:
        # Both are set when logprobs were asked for (the only states this is called for).
        assert state.logprobs is not None and state.cumulative_logprob is not None
        k = state.params.logprobs or 0
        detok = state.detokenizer
        for token_ids, values, rank in zip(new_logprobs.token_ids[:num_rows],
                                           new_logprobs.logprobs[:num_rows],
                                           new_logprobs.ranks[:num_rows]):
            entry = {token_ids[0]: Logprob(values[0], rank, detok.decode_token(token_ids[0]))}
            for top_rank, (token_id, value) in enumerate(zip(token_ids[1:k + 1],
                                                             values[1:k + 1]), 1):
                if token_id not in entry:
                    entry[token_id] = Logprob(value, top_rank, detok.decode_token(token_id))
            state.logprobs.append(entry)
            state.cumulative_logprob += values[0]

    def _make_request_output(self, state: RequestState, finish_reason: FinishReason | None,
                             stop_reason: int | str | None,
                             hidden_states: torch.Tensor | None = None) -> RequestOutput | None:
        finished = finish_reason is not None
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._make_completion(state, finished, finish_reason, stop_reason, kind)
        completion.hidden_states = hidden_states
        parent = state.parent
        if parent is None:
            return self._request_output(state, [completion], finished)
        parent.completions[state.index] = completion
        parent.num_finished += finished
        all_done = parent.num_finished == parent.n
        if all_done:
            self.parents.pop(parent.request_id, None)
            self.live_ids.pop(state.external_id, None)
        if kind == RequestOutputKind.FINAL_ONLY:
            if not all_done:
                return None
            # Every child wrote its completion when it finished.
            completions = [c for c in parent.completions if c is not None]
            return self._request_output(state, completions, True)
        return self._request_output(state, [completion], all_done)

    def _make_completion(self, state: RequestState, finished: bool,
                         finish_reason: FinishReason | None, stop_reason: int | str | None,
                         kind: RequestOutputKind) -> CompletionOutput:
        detok = state.detokenizer
        text = detok.get_text(finished)
        token_ids = detok.token_ids
        logprobs = state.logprobs
        if kind == RequestOutputKind.DELTA:
            text, state.sent_text_len = text[state.sent_text_len:], len(text)
            token_ids = token_ids[state.sent_num_tokens:]
            if logprobs is not None:
                logprobs = logprobs[state.sent_num_tokens:]
            state.sent_num_tokens = len(detok.token_ids)
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=state.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            stop_reason=stop_reason,
        )

    def _request_output(self, state: RequestState, completions: list[CompletionOutput],
                        finished: bool) -> RequestOutput:
        return RequestOutput(
            request_id=state.external_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            num_prompt_tokens=state.num_prompt_tokens,
            encoder_prompt=state.encoder_prompt,
            encoder_prompt_token_ids=state.encoder_prompt_token_ids,
        )
