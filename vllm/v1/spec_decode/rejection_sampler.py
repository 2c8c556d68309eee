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

from vllm.sampling_params import may_stop_at
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
    """Where each sampling row's drafts and logits positions are, built in plain Python:
    a step of one request has a handful of positions, and after the forward has swept the
    caches each numpy call costs more than such a loop (see `decode_inputs`).

    Example: drafts [[7, 8], [], [9]] -> starts [0, 3, 4, 6] (row i's positions are
    starts[i] .. starts[i + 1] - 1; its last one is the bonus); draft_tokens()
    [7, 8, -1, -1, 9, -1] (the draft each position verifies; -1 at each row's last);
    positions() -> row_of_position [0, 0, 0, 1, 2, 2], index_in_row [0, 1, 2, 0, 0, 1].
    """

    drafts: list[list[int]]
    starts: list[int]  # [n + 1]

    @staticmethod
    def of(drafts: list[list[int]]) -> DraftLayout:
        starts = [0]
        for row in drafts:
            starts.append(starts[-1] + len(row) + 1)
        return DraftLayout(drafts, starts)

    def draft_tokens(self) -> np.ndarray:
        """[T] int64 the draft each position verifies, -1 at each row's last position."""
        return np.array([t for row in self.drafts for t in (*row, -1)], dtype=np.int64)

    def num_drafts(self) -> np.ndarray:
        """[n] int64 drafts per row."""
        return np.array([len(row) for row in self.drafts], dtype=np.int64)

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """([T] row of each position, [T] its index within the row), int64."""
        rows = [i for i, row in enumerate(self.drafts) for _ in range(len(row) + 1)]
        index = [j for row in self.drafts for j in range(len(row) + 1)]
        return np.array(rows, dtype=np.int64), np.array(index, dtype=np.int64)


def is_plain_greedy(metadata: SamplingMetadata) -> bool:
    """Every row greedy with nothing that changes its logits: its verification reads only
    the argmax of each position (no per-position metadata)."""
    return (metadata.all_greedy and not metadata.min_tokens_blocked
            and not metadata.allowed_token_ids and metadata.penalties is None)


def expand_metadata(metadata: SamplingMetadata, layout: DraftLayout,
                    num_output_tokens: list[int], min_tokens: list[int],
                    stop_ids: list[list[int]]) -> SamplingMetadata:
    """The per-row metadata of a step, one row per logits position: position j of row i
    sees row i's drafts before j as output tokens (min_tokens and penalty counts).

    Args:
        num_output_tokens / min_tokens / stop_ids: per sampling row, its output tokens so
            far, its min_tokens and the ids min_tokens blocks (stop ids and EOS).
    """
    row_of_position, index_in_row = layout.positions()
    rows = torch.from_numpy(row_of_position)
    device = metadata.temperature.device

    def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor[rows.to(tensor.device)]

    generators = {}
    allowed = {}
    blocked = {}
    for position, (row, j) in enumerate(zip(row_of_position.tolist(),
                                            index_in_row.tolist())):
        if row in metadata.generators:
            generators[position] = metadata.generators[row]
        if row in metadata.allowed_token_ids:
            allowed[position] = metadata.allowed_token_ids[row]
        if not may_stop_at(num_output_tokens[row] + j, min_tokens[row]) and stop_ids[row]:
            blocked[position] = stop_ids[row]
    penalties = metadata.penalties
    if penalties is not None:
        counts = penalties.output_token_counts[rows.to(device)].clone()
        for position, (row, j) in enumerate(zip(row_of_position.tolist(),
                                                index_in_row.tolist())):
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


def first_stops(stops: np.ndarray, starts: list[int]) -> np.ndarray:
    """The first position at or after each row's start where `stops` holds: with every
    row's last position a stop, the position inside the row where it stops.

    Example: stops [F, F, T, T, F, T] (rows at [0, 3, 4, 6]) -> [2, 3, 5].
    """
    hits = np.flatnonzero(stops)
    return hits[np.searchsorted(hits, starts[:-1])]


class RejectionSampler:
    """Verifies a step's drafts: logits of every position in, emitted tokens out."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 layout: DraftLayout) -> VerifiedRows:
        """logits: [T, vocab] model dtype, positions in `layout` order; metadata: one row
        per position (`expand_metadata`), or where `is_plain_greedy` the step's own (one
        row per sampling row: only its flags are read).

        Greedy rows accept while the draft equals the argmax and emit the argmax where
        they stop. Example: drafts [5, 6, 7], argmax [5, 6, 9, 2] -> [5, 6, 9]. (A loop:
        one request's 1 + k positions cost less in Python than in numpy calls.)
        """
        processed = logits if is_plain_greedy(metadata) else process_logits(logits, metadata)
        argmax = greedy_tokens(processed).tolist()  # of every position
        emitted = []
        for start, drafts in zip(layout.starts, layout.drafts):
            accepted = 0
            for draft in drafts:
                if draft != argmax[start + accepted]:
                    break
                accepted += 1
            emitted.append(argmax[start:start + accepted + 1])
        if not metadata.all_greedy:
            temperature = metadata.temperature[layout.starts[:-1]]  # each row's first
            random_rows = np.flatnonzero((temperature > 0).cpu().numpy())
            if random_rows.size:
                self._sample_random_rows(processed, metadata, layout, random_rows.tolist(),
                                         emitted)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            positions = [layout.starts[i] + j for i, tokens in enumerate(emitted)
                         for j in range(len(tokens))]
            raw = torch.log_softmax(logits[positions].float(), dim=-1)
            sampled = torch.tensor([t for tokens in emitted for t in tokens], dtype=torch.int64,
                                   device=raw.device)
            logprobs = gather_logprobs(raw, sampled, metadata.max_num_logprobs)
        return VerifiedRows(emitted, logprobs)

    @staticmethod
    def _sample_random_rows(logits: torch.Tensor, metadata: SamplingMetadata,
                            layout: DraftLayout, rows: list[int],
                            emitted: list[list[int]]) -> None:
        """Rejection sampling for rows with temperature > 0 (their `emitted` replaced).
        One uniform per position decides its draft (accepted iff u < p(x)); one more per
        row samples the token where the row stops: the residual p without the rejected
        draft, or the bonus from p.

        Example: one row, drafts [4, 2], p(4) 0.7 at position 0 and p(2) 0.1 at 1, draws
        [0.5, 0.3, u]: 4 accepted (0.5 < 0.7), 2 rejected (0.3 >= 0.1): the row stops at
        position 1 and emits [4, t] with t drawn by u from position 1's p without token 2.
        """
        starts = layout.starts
        index = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in rows])
        sub_starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([starts[i + 1] - starts[i] for i in rows], out=sub_starts[1:])
        position_index = torch.from_numpy(index)
        sub = _select_positions(metadata, index)
        probs = sampling_probs(logits[position_index.to(logits.device)], sub)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        accept_u = draw_uniforms(len(index), sub.generators)
        drafts = torch.from_numpy(layout.draft_tokens()[index]).to(probs.device)
        p_draft = probs.gather(1, drafts.clamp(min=0)[:, None])[:, 0]
        accepted = (accept_u.to(probs.device) < p_draft) & (drafts >= 0)
        stops = first_stops(~accepted.cpu().numpy(), sub_starts.tolist())
        stop_index = torch.from_numpy(stops).to(probs.device)
        final = probs[stop_index]  # a copy (advanced indexing)
        rejected = drafts[stop_index]  # -1 where the row accepted every draft
        hit = rejected >= 0
        final[torch.arange(len(rows), device=final.device)[hit], rejected[hit]] = 0.0
        generators = {r: sub.generators[pos] for r, pos in enumerate(stops.tolist())
                      if pos in sub.generators}
        final_u = draw_uniforms(len(rows), generators)
        tokens = inverse_cdf_sample(final, final_u).tolist()
        for r, (i, token) in enumerate(zip(rows, tokens)):
            emitted[i] = [*layout.drafts[i][:int(stops[r] - sub_starts[r])], token]


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
