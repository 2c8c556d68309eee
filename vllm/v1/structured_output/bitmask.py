"""The model runner's side of structured outputs: one batched masking of the step's
constrained logits rows by the scheduler's packed grammar bitmask."""

from __future__ import annotations

import torch

# Bit b of a 32-bit word: token 32 * word + b.
_BITS = torch.arange(32, dtype=torch.int32)


def apply_grammar_bitmask(logits: torch.Tensor, sampling_req_ids: list[str],
                          constrained_req_ids: list[str], bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, every token a request's grammar forbids.

    Args:
        logits: [num_sampling_reqs, vocab] float, row i for sampling_req_ids[i].
        sampling_req_ids: the requests sampling this step, in logits-row order.
        constrained_req_ids: the requests with a grammar, bitmask-row order (a subset of
            those sampling: unconstrained rows are not touched).
        bitmask: [len(constrained_req_ids), ceil(vocab / 32)] int32; bit t % 32 of word
            t // 32 set = token t allowed. E.g. allowing only tokens 0 and 33 of a 64-token
            vocabulary: [[0b1, 0b10]].
    """
    row_of = {req_id: row for row, req_id in enumerate(sampling_req_ids)}
    rows = torch.tensor([row_of[req_id] for req_id in constrained_req_ids],
                        dtype=torch.int64, device=logits.device)
    vocab = logits.shape[1]
    words = bitmask.to(logits.device, non_blocking=True)
    # [k, W] -> [k, W, 32] bits -> [k, W * 32] -> the vocabulary's columns.
    allowed = ((words.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).view(len(rows), -1)
    forbidden = allowed[:, :vocab] == 0
    logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
