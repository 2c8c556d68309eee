"""Around the sampler: a step's grammar bitmask applied to its logits, and its sampled
tokens written back to the `InputBatch` and packed as the `ModelRunnerOutput` (one entry
per batch row, empty for rows that did not sample)."""

from __future__ import annotations

import numpy as np
import torch

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.sample.sampler import SamplerOutput
from vllm.v1.spec_decode.rejection_sampler import DraftLayout
from vllm.v1.structured_output.bitmask import apply_grammar_bitmask
from vllm.v1.worker.input_batch import InputBatch


def apply_step_bitmask(logits: torch.Tensor, batch: InputBatch, sampling_rows: np.ndarray,
                       draft_layout: DraftLayout | None,
                       scheduler_output: SchedulerOutput) -> None:
    """Masks, in place, the tokens each constrained request's grammar forbids. Logit rows
    are keyed by request id; with drafts, by (id, j) for a request's j-th verified
    position, as the scheduler keys its bitmask rows."""
    assert scheduler_output.grammar_bitmask is not None
    req_ids = batch.req_ids_in_order
    logit_keys = [req_ids[row] for row in sampling_rows.tolist()]
    mask_keys = scheduler_output.structured_output_request_ids
    if draft_layout is not None:  # a key per verified position: (id, j)
        row_of_position, index_in_row = draft_layout.positions()
        logit_keys = [f"{logit_keys[row]}\0{j}" for row, j in
                      zip(row_of_position.tolist(), index_in_row.tolist())]
        mask_keys = [f"{req_id}\0{j}" for req_id, j in
                     zip(mask_keys, _occurrence_index(mask_keys))]
    apply_grammar_bitmask(logits, logit_keys, mask_keys, scheduler_output.grammar_bitmask)


def bookkeep(batch: InputBatch, rows: np.ndarray, sampler_output: SamplerOutput,
             finished_rows: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
    """Appends each sampling row's token to the batch and builds the step's output."""
    req_ids = list(batch.req_ids_in_order)
    sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
    for row, token in zip(rows.tolist(), sampler_output.sampled_token_ids.tolist()):
        batch.append_token(row, token)
        sampled_token_ids[row] = [token]
    logprobs = None
    if sampler_output.logprobs is not None:
        # Rows that did not sample get empty logprob rows so that indices align.
        sampled = sampler_output.logprobs
        token_ids: list[list[int]] = [[] for _ in req_ids]
        values: list[list[float]] = [[] for _ in req_ids]
        ranks = [0] * len(req_ids)
        for i, row in enumerate(rows.tolist()):
            token_ids[row], values[row], ranks[row] = (
                sampled.token_ids[i], sampled.logprobs[i], sampled.ranks[i])
        logprobs = type(sampled)(token_ids, values, ranks)
    return ModelRunnerOutput(req_ids, dict(batch.req_id_to_index), sampled_token_ids,
                             logprobs, finished_rows or {})


def _occurrence_index(keys: list[str]) -> list[int]:
    """How many times each key occurred before: ["a", "a", "b", "a"] -> [0, 1, 0, 2]."""
    seen: dict[str, int] = {}
    out = []
    for key in keys:
        out.append(seen.get(key, 0))
        seen[key] = out[-1] + 1
    return out
