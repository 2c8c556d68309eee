"""The worker's mirror of the scheduler's requests: `CachedRequestState`s kept from the
`SchedulerOutput`'s typed messages (`NewRequestData` once, then `CachedRequestData`
deltas), and the persistent `InputBatch` rows of the requests scheduled this step.
"""

from __future__ import annotations

import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.messages import EmbedsLayout
from vllm.v1.spec_decode.spec_runner import SpecDecodeRunner
from vllm.v1.worker.input_batch import CachedRequestState, InputBatch
from vllm.v1.worker.sampling_inputs import SamplingInputsBuilder


class RequestStates:
    """Owns `requests` (every unfinished request the worker has seen, scheduled or not)
    and keeps the batch's rows those scheduled this step: finished requests leave, requests
    not scheduled this step leave the batch but keep their state (a seeded generator goes
    on where it was), new and resumed ones join, and the rest take their deltas in place.
    """

    def __init__(self, batch: InputBatch, sampling_inputs: SamplingInputsBuilder,
                 spec: SpecDecodeRunner | None, device: torch.device) -> None:
        self.batch = batch
        self.sampling_inputs = sampling_inputs
        self.spec = spec
        self.device = device
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        if scheduler_output.finished_req_ids:
            self.sampling_inputs.forget()
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        # Requests not scheduled this step (preempted, or left out by the budget) leave
        # the batch but keep their state: a seeded generator continues where it was.
        for req_id in list(batch.req_id_to_index):
            if req_id not in scheduler_output.num_scheduled_tokens:
                batch.remove_request(req_id)
        to_add = [self._add_new(new) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                       cached.num_computed_tokens):
            state = self.requests[req_id]
            state.num_computed_tokens = num_computed
            state.block_ids.extend(new_block_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                to_add.append(state)
            else:
                batch.num_computed_tokens_cpu[row] = num_computed
                batch.block_table.append_row(new_block_ids, row)
        batch.condense()
        for state in to_add:
            batch.add_request(state)
        if self.spec is not None:
            self.spec.write_drafts(batch, scheduler_output)

    def _add_new(self, new: NewRequestData) -> CachedRequestState:
        """The state of a request sent whole (new, or resumed after preemption: its
        seeded generator carries over)."""
        old = self.requests.get(new.req_id)
        self.batch.remove_request(new.req_id)
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=new.prompt_token_ids,
            prompt_embeds=new.prompt_embeds,
            sampling_params=new.sampling_params,
            generator=old.generator if old else self._make_generator(new.sampling_params),
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=list(new.output_token_ids),
            cross_block_ids=list(new.cross_block_ids),
            num_encoder_tokens=(new.encoder_input.num_tokens
                                if new.encoder_input is not None else 0),
            embeds_layout=EmbedsLayout.of(len(new.prompt_token_ids), new.prompt_embeds,
                                          new.prompt_is_token_ids),
            lora_request=new.lora_request,
            mrope_positions=(None if new.mrope_positions is None
                             else new.mrope_positions.numpy()),
            bidirectional_spans=list(new.bidirectional_spans),
        )
        self.requests[new.req_id] = state
        return state

    def drop(self, req_ids: list[str]) -> None:
        """Forgets the batch rows of a failed step's requests (the scheduler re-sends any
        that go on as new requests); kept states only carry their seeded generators."""
        self.sampling_inputs.forget()
        for req_id in req_ids:
            self.batch.remove_request(req_id)
        self.batch.condense()

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        return generator
