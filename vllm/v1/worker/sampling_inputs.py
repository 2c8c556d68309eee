"""`SamplingInputsBuilder`: the step's `SamplingMetadata` from the persistent `InputBatch`.

A request's sampling parameters never change, so the per-row tensors (temperature, top-k,
top-p, min-p), the generators and the flags are cached under the sampling rows' request
states (by identity: a reused request id is a new state), and rebuilt only when those change
(a request joins, leaves or moves row). What does
change every step is recomputed: min_tokens blocking (while a row is below its min_tokens)
and the penalties' token counts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from vllm.sampling_params import may_stop_at
from vllm.v1.sample.metadata import Penalties, SamplingMetadata
from vllm.v1.worker.input_batch import InputBatch


@dataclass(slots=True)
class _Cached:
    key: tuple[int, ...]  # id() of the sampling rows' request states, in logits order
    states: tuple  # those states, held so that their ids stay unique while cached
    metadata: SamplingMetadata  # without min_tokens blocking and penalty inputs
    any_min_tokens: bool
    any_penalties: bool
    # The rows array last served and the batch's version then: the same (unchanging)
    # array of a decode step, such as `DecodeInputs`' rows, with no row changed since,
    # hits without comparing states.
    rows: np.ndarray | None = None
    version: int = -1


class SamplingInputsBuilder:
    """Builds each step's `SamplingMetadata`, caching what the batch alone decides."""

    def __init__(self, input_batch: InputBatch, device: torch.device,
                 max_model_len: int) -> None:
        self.input_batch = input_batch
        self.device = device
        self.max_model_len = max_model_len
        self._cached: _Cached | None = None
        self.num_rebuilds = 0  # how often the cache missed (tests read it)

    def forget(self) -> None:
        """Drops the cache: called when requests finish or are dropped, whose states (and
        their prompt embeds) the cache would otherwise keep alive until the next build."""
        self._cached = None

    def build(self, rows: np.ndarray) -> SamplingMetadata:
        """rows: [num_sampling_reqs] batch rows that sample this step, in logits order."""
        batch = self.input_batch
        cached = self._cached
        if cached is None or cached.rows is not rows or cached.version != batch.version:
            states = tuple(batch.state(row) for row in rows.tolist())
            key = tuple(map(id, states))
            if cached is None or cached.key != key:
                cached = self._cached = self._build_static(rows, key, states)
            cached.rows, cached.version = rows, batch.version
        if not cached.any_min_tokens and not cached.any_penalties:
            return cached.metadata
        metadata = replace(cached.metadata,
                           min_tokens_blocked=self._min_tokens_blocked(rows)
                           if cached.any_min_tokens else {})
        if cached.any_penalties:
            metadata.penalties = self._penalties(rows)
        return metadata

    def _build_static(self, rows: np.ndarray, key: tuple[int, ...], states: tuple) -> _Cached:
        self.num_rebuilds += 1
        batch = self.input_batch
        greedy = batch.temperature[rows] < 1e-5
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        generators: dict[int, torch.Generator] = {}
        allowed: dict[int, torch.Tensor] = {}
        for i, state in enumerate(states):
            if state.generator is not None:
                generators[i] = state.generator
            allowed_ids = state.sampling_params.allowed_token_ids
            if allowed_ids is not None:
                allowed[i] = torch.tensor(allowed_ids, dtype=torch.int64, device=self.device)
        num_logprobs = batch.num_logprobs[rows]
        metadata = SamplingMetadata(
            temperature=torch.from_numpy(batch.temperature[rows]).to(self.device),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            top_p=_tensor_if(top_p, (top_p < 1.0).any(), self.device),
            top_k=_tensor_if(top_k.astype(np.int64), (top_k < batch.vocab_size).any(),
                             self.device),
            min_p=_tensor_if(min_p, (min_p > 0.0).any(), self.device),
            generators=generators,
            penalties=None,
            min_tokens_blocked={},
            max_num_logprobs=int(num_logprobs.max()) if (num_logprobs >= 0).any() else None,
            allowed_token_ids=allowed,
        )
        any_penalties = bool((batch.presence_penalty[rows] != 0).any()
                             or (batch.frequency_penalty[rows] != 0).any()
                             or (batch.repetition_penalty[rows] != 1).any())
        any_min_tokens = bool((batch.min_tokens[rows] > 0).any())
        return _Cached(key, states, metadata, any_min_tokens, any_penalties)

    def _min_tokens_blocked(self, rows: np.ndarray) -> dict[int, list[int]]:
        """Rows still below min_tokens -> the stop ids (and EOS) they must not sample."""
        batch = self.input_batch
        blocked_rows: dict[int, list[int]] = {}
        for i, row in enumerate(rows.tolist()):
            state = batch.state(row)
            # The token sampled now is output token number len(output_token_ids).
            if may_stop_at(len(state.output_token_ids), int(batch.min_tokens[row])):
                continue
            blocked = state.sampling_params.stop_ids()
            if blocked:
                blocked_rows[i] = blocked
        return blocked_rows

    def _penalties(self, rows: np.ndarray) -> Penalties:
        """The rows' penalties, and their token counts over the vocabulary from the
        token-id table.

        Output tokens are positions [num_prompt, num_tokens); prompt tokens are positions
        [0, num_prompt) that hold real ids (embeds positions are not tokens).
        """
        batch = self.input_batch
        max_len = min(int(batch.num_tokens[rows].max()), self.max_model_len)
        tokens = torch.from_numpy(batch.token_ids_cpu[rows, :max_len].astype(np.int64))
        pos = np.arange(max_len)[None, :]
        is_output = pos >= batch.num_prompt_tokens[rows][:, None]
        is_output &= pos < batch.num_tokens[rows][:, None]
        is_prompt = pos < batch.num_prompt_tokens[rows][:, None]
        is_prompt &= batch.is_token_ids[rows, :max_len]
        counts = torch.zeros(len(rows), batch.vocab_size, dtype=torch.int32)
        counts.scatter_add_(1, tokens, torch.from_numpy(is_output.astype(np.int32)))
        prompt_mask = torch.zeros(len(rows), batch.vocab_size, dtype=torch.int32)
        prompt_mask.scatter_add_(1, tokens, torch.from_numpy(is_prompt.astype(np.int32)))
        return Penalties(
            presence=torch.from_numpy(batch.presence_penalty[rows]).to(self.device),
            frequency=torch.from_numpy(batch.frequency_penalty[rows]).to(self.device),
            repetition=torch.from_numpy(batch.repetition_penalty[rows]).to(self.device),
            output_token_counts=counts.to(self.device),
            prompt_token_mask=(prompt_mask > 0).to(self.device))


def _tensor_if(array: np.ndarray, condition, device: torch.device) -> torch.Tensor | None:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device) if condition else None
