"""`RejectionSampler`: verifies drafted tokens against the target model's logits so that
the emitted tokens are distributed exactly as plain sampling would make them.

A sampling row with k drafts has 1 + k logits rows (positions): position j scores the
token after draft j - 1 (position 0: after the last known token). Drafts are proposed
deterministically (prompt lookup, or a drafter's argmax), so the draft distribution q is
one-hot at the draft x, and the rule (Leviathan et al., Chen et al.) becomes:

    accept x_j with probability min(1, p_j(x_j) / q(x_j)) = p_j(x_j);
    at the first rejection emit a token from normalize(max(p_j - q, 0)) = p_j without x_j;
    if all k are accepted emit a bonus token from p_k.

Greedy rows (temperature 0) accept while the draft equals the argmax and emit the argmax
where they stop: token-identical to plain greedy decoding. `p_j` is the request's full
sampling distribution at that position: allowed-token and min_tokens masks and penalties
see the drafts before j as output tokens, then temperature, top-k/top-p and min-p.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np
import torch

from vllm.v1.outputs import LogprobsLists
from vllm.v1.sample.metadata import Penalties, SamplingMetadata
from vllm.v1.sample.sampler import (
    draw_uniforms,
    gather_logprobs,
    greedy_tokens,
    inverse_cdf_sample,
    process_logits,
    sampling_probs,
)


class VerifiedRows(NamedTuple):
    """Per sampling row: the emitted tokens (accepted drafts + one more), and the
    logprobs of every emitted token (one LogprobsLists row each), in row order."""

    token_ids: list[list[int]]
    logprobs: LogprobsLists | None  # rows: the emitted tokens of row 0, then row 1, ...


class DraftLayout(NamedTuple):
    """Where each sampling row's drafts and logits positions are.

    Example: drafts [[7, 8], [], [9]] -> num_drafts [2, 0, 1], starts [0, 3, 4, 6]
    (row i's positions are starts[i] .. starts[i + 1] - 1; its last one is the bonus),
    row_of_position [0, 0, 0, 1, 2, 2], index_in_row [0, 1, 2, 0, 0, 1].
    """

    drafts: list[list[int]]
    num_drafts: np.ndarray  # [n] int64
    starts: np.ndarray  # [n + 1] int64
    row_of_position: np.ndarray  # [T] int64
    index_in_row: np.ndarray  # [T] int64

    @staticmethod
    def of(drafts: list[list[int]]) -> DraftLayout:
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)
        starts = np.zeros(len(drafts) + 1, dtype=np.int64)
        np.cumsum(num_drafts + 1, out=starts[1:])
        row_of_position = np.repeat(np.arange(len(drafts)), num_drafts + 1)
        index_in_row = np.arange(int(starts[-1])) - starts[row_of_position]
        return DraftLayout(drafts, num_drafts, starts, row_of_position, index_in_row)


def expand_metadata(metadata: SamplingMetadata, layout: DraftLayout,
                    num_output_tokens: list[int], min_tokens: list[int],
                    stop_ids: list[list[int]]) -> SamplingMetadata:
    """The per-row metadata of a step, one row per logits position: position j of row i
    sees row i's drafts before j as output tokens (min_tokens and penalty counts).

    Args:
        num_output_tokens / min_tokens / stop_ids: per sampling row, its output tokens so
            far, its min_tokens and the ids min_tokens blocks (stop ids and EOS).
    """
    rows = torch.from_numpy(layout.row_of_position)
    device = metadata.temperature.device

    def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[rows.to(tensor.device)]

    generators = {}
    allowed = {}
    blocked = {}
    for position, (row, j) in enumerate(zip(layout.row_of_position.tolist(),
                                            layout.index_in_row.tolist())):
        if row in metadata.generators:
            generators[position] = metadata.generators[row]
        if row in metadata.allowed_token_ids:
            allowed[position] = metadata.allowed_token_ids[row]
        if num_output_tokens[row] + j < min_tokens[row] and stop_ids[row]:
            blocked[position] = stop_ids[row]
    penalties = metadata.penalties
    if penalties is not None:
        counts = penalties.output_token_counts[rows.to(device)].clone()
        for position, (row, j) in enumerate(zip(layout.row_of_position.tolist(),
                                                layout.index_in_row.tolist())):
            for token in layout.drafts[row][:j]:
                counts[position, token] += 1
        penalties = Penalties(pick(penalties.presence), pick(penalties.frequency),  # type: ignore[arg-type]
                              pick(penalties.repetition), counts,  # type: ignore[arg-type]
                              penalties.prompt_token_mask[rows.to(device)])
    temperature = pick(metadata.temperature)
    assert temperature is not None
    return replace(metadata, temperature=temperature, top_p=pick(metadata.top_p),
                   top_k=pick(metadata.top_k), min_p=pick(metadata.min_p),
                   generators=generators, penalties=penalties, min_tokens_blocked=blocked,
                   allowed_token_ids=allowed)


class RejectionSampler:
    """Verifies a step's drafts: logits of every position in, emitted tokens out."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 layout: DraftLayout) -> VerifiedRows:
        """logits: [T, vocab] model dtype, positions in `layout` order; metadata: one row
        per position (`expand_metadata`)."""
        plain = (metadata.all_greedy and not metadata.min_tokens_blocked
                 and not metadata.allowed_token_ids and metadata.penalties is None)
        processed = logits if plain else process_logits(logits, metadata)
        target = greedy_tokens(processed).tolist()  # argmax of every position
        drafts = layout.drafts
        random_rows = [] if metadata.all_greedy else \
            sorted(set(layout.row_of_position[(metadata.temperature > 0).cpu().numpy()].tolist()))
        emitted = [self._greedy_row(drafts[i], target[layout.starts[i]:layout.starts[i + 1]])
                   for i in range(len(drafts))]
        if random_rows:
            self._sample_random_rows(processed, metadata, layout, random_rows, emitted)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            positions = [int(layout.starts[i]) + j for i, tokens in enumerate(emitted)
                         for j in range(len(tokens))]
            raw = torch.log_softmax(logits[positions].float(), dim=-1)
            sampled = torch.tensor([t for tokens in emitted for t in tokens], dtype=torch.int64,
                                   device=raw.device)
            logprobs = gather_logprobs(raw, sampled, metadata.max_num_logprobs)
        return VerifiedRows(emitted, logprobs)

    @staticmethod
    def _greedy_row(drafts: list[int], target: list[int]) -> list[int]:
        """Accepts drafts while they equal the argmax; emits the argmax where it stops.
        Example: drafts [5, 6, 7], argmax [5, 6, 9, 2] -> [5, 6, 9]."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        return [*drafts[:accepted], target[accepted]]

    @staticmethod
    def _sample_random_rows(logits: torch.Tensor, metadata: SamplingMetadata,
                            layout: DraftLayout, rows: list[int],
                            emitted: list[list[int]]) -> None:
        """Rejection sampling for rows with temperature > 0 (their `emitted` replaced).
        One uniform per position decides its draft (accepted iff u < p(x)); one more per
        row samples the token where the row stops: the residual p without the rejected
        draft, or the bonus from p."""
        index = np.concatenate([np.arange(layout.starts[i], layout.starts[i + 1])
                                for i in rows])
        position_index = torch.from_numpy(index)
        sub = _select_positions(metadata, index)
        probs = sampling_probs(logits[position_index.to(logits.device)], sub)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        accept_u = draw_uniforms(len(index), sub.generators)
        final_rows, stop_positions, rejected = [], [], []
        offset = 0
        for i in rows:
            drafts = layout.drafts[i]
            accepted = 0
            while accepted < len(drafts):
                p = float(probs[offset + accepted, drafts[accepted]])
                if not float(accept_u[offset + accepted]) < p:
                    break
                accepted += 1
            final = probs[offset + accepted].clone()
            if accepted < len(drafts):
                final[drafts[accepted]] = 0.0
            rejected.append(accepted < len(drafts))
            final_rows.append(final)
            stop_positions.append(offset + accepted)
            emitted[i] = drafts[:accepted]
            offset += len(drafts) + 1
        generators = {r: sub.generators[pos] for r, pos in enumerate(stop_positions)
                      if pos in sub.generators}
        final_u = draw_uniforms(len(rows), generators)
        tokens = inverse_cdf_sample(torch.stack(final_rows), final_u).tolist()
        for i, token in zip(rows, tokens):
            emitted[i].append(token)


def _select_positions(metadata: SamplingMetadata, index: np.ndarray) -> SamplingMetadata:
    """The metadata of some positions (sampling_probs reads temperature, top-k/p, min-p;
    draws read the generators)."""
    rows = torch.from_numpy(index)

    def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[rows.to(tensor.device)]

    generators = {new: metadata.generators[int(old)] for new, old in enumerate(index.tolist())
                  if int(old) in metadata.generators}
    temperature = pick(metadata.temperature)
    assert temperature is not None
    return replace(metadata, temperature=temperature, top_p=pick(metadata.top_p),
                   top_k=pick(metadata.top_k), min_p=pick(metadata.min_p),
                   generators=generators)
