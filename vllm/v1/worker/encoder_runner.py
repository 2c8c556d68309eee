"""The encoder pass of encoder/decoder models: encoder inputs in, cross-attention K/V out.

Runs once per step, before the decoder forward, for the requests whose cross-attention
blocks are new this step (first schedule, or a resume after their cached blocks were
evicted): one batched encoder call, then every decoder layer's K/V projection of the
encoder output written into the cross blocks. No encoder output outlives the pass.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.interfaces import EncoderDecoderModel
from vllm.v1.attention.backends.abstract import EncoderAttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput


def compute_cross_slot_mapping(cross_block_ids: list[list[int]], encoder_lens: list[int],
                               block_size: int) -> np.ndarray:
    """The cache slot of every encoder output row, inputs concatenated in order.

    Example (block size 4): inputs of 6 and 3 rows with cross blocks [7, 2] and [5]:
        rows of input 0: positions 0..5 -> blocks [7, 7, 7, 7, 2, 2] -> slots
                         [28, 29, 30, 31, 8, 9]
        rows of input 1: positions 0..2 -> block 5 -> slots [20, 21, 22]
    """
    lens = np.asarray(encoder_lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    positions = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)
    # Flatten the block lists; each input's first block sits at block_offsets[i].
    num_blocks = np.array([len(ids) for ids in cross_block_ids], dtype=np.int64)
    block_offsets = np.cumsum(num_blocks) - num_blocks
    flat_blocks = np.fromiter((block for ids in cross_block_ids for block in ids), dtype=np.int64,
                              count=int(num_blocks.sum()))
    block_index = np.repeat(block_offsets, lens) + positions // block_size
    return flat_blocks[block_index] * block_size + positions % block_size


class EncoderRunner:
    """Runs the encoder for a step's new encoder inputs and fills their cross blocks."""

    def __init__(self, model: EncoderDecoderModel, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.num_inputs_encoded = 0  # encoder inputs run so far (tests, benchmarks)

    def run(self, scheduler_output: SchedulerOutput, kv_caches: list[torch.Tensor],
            attn_layers: list[Attention] | None = None) -> None:
        """Encodes the step's new encoder inputs and writes their cross K/V. `attn_layers`:
        the model's `bind_attention_layers` list, for the forward context (needed wherever
        the model's attention runs as the compiled op)."""
        wanted = set(scheduler_output.scheduled_encoder_inputs)
        # Encoder runs only ever come with NewRequestData (first schedule or a resume).
        new_reqs = [r for r in scheduler_output.scheduled_new_reqs if r.req_id in wanted]
        if not new_reqs:
            return
        inputs = []
        for r in new_reqs:
            assert r.encoder_input is not None  # requests of an encoder/decoder model
            inputs.append(r.encoder_input)
        self.num_inputs_encoded += len(inputs)
        lens = [item.num_tokens for item in inputs]
        slot_mapping = torch.from_numpy(compute_cross_slot_mapping(
            [r.cross_block_ids for r in new_reqs], lens, self.block_size)).to(self.device)
        metadata = EncoderAttentionMetadata.from_lens(lens)
        with set_forward_context(None, kv_caches, encoder_attn_metadata=metadata,
                                 attn_layers=attn_layers):
            encoder_out = self.model.encode(inputs)
            for layer in self.model.cross_attention_layers():
                k, v = layer.project_kv(encoder_out)
                layer.attn.write_cross_kv(k, v, slot_mapping)
