"""What the model runner sends back to the scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Logprob(NamedTuple):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob.
SampleLogprobs = list[dict[int, Logprob]]


class LogprobsLists(NamedTuple):
    """Top-k logprobs for the sampled tokens of one step, row per request.

    The first column is the sampled token; the rest are the top-k in rank order.
    """

    token_ids: list[list[int]]  # [num_reqs][1 + k]
    logprobs: list[list[float]]  # [num_reqs][1 + k]
    ranks: list[int]  # [num_reqs] rank of the sampled token


@dataclass(slots=True)
class ModelRunnerOutput:
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: the token(s) sampled this step; empty for a request
    # whose prefill chunk did not reach the end of its prompt.
    sampled_token_ids: list[list[int]]
    logprobs: LogprobsLists | None = None
    # Finished requests' rows (`SchedulerOutput.rows_to_gather`):
    # req_id -> [num_rows, hidden_size] in the model dtype, CPU.
    hidden_states: dict[str, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding: each request's drafts for its next step ([] for none), and
    # where its rows of `logprobs` start (one row per sampled token; [num_reqs + 1]);
    # None: `logprobs` has one row per request.
    spec_token_ids: list[list[int]] | None = None
    logprob_starts: list[int] | None = None

    def logprobs_of(self, index: int) -> LogprobsLists | None:
        """The logprobs rows of request `index`'s sampled tokens."""
        lp = self.logprobs
        if lp is None:
            return None
        start, end = ((index, index + 1) if self.logprob_starts is None
                      else self.logprob_starts[index:index + 2])
        return LogprobsLists(lp.token_ids[start:end], lp.logprobs[start:end],
                             lp.ranks[start:end])


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput([], {}, [], None)
