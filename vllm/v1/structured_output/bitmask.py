"""The model runner's side of structured outputs: one batched masking of the step's
constrained logits rows by the scheduler's packed grammar bitmask."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(logits: torch.Tensor, sampling_req_ids: list[str],
                          constrained_req_ids: list[str], bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, every token a request's grammar forbids.

    Args:
        logits: [num_sampling_reqs, vocab] float, row i for sampling_req_ids[i].
        sampling_req_ids: the requests sampling this step, in logits-row order.
        constrained_req_ids: the requests with a grammar, bitmask-row order (a subset of
            those sampling: unconstrained rows are not touched).
        bitmask: [len(constrained_req_ids), ceil(vocab / 32)] int32 on CPU; bit t % 32 of
            word t // 32 set = token t allowed. E.g. allowing only tokens 0 and 33 of a
            64-token vocabulary: [[0b1, 0b10]].
    """
    vocab = logits.shape[1]
    # Little-endian words: byte j of word w holds tokens 32w + 8j ... 32w + 8j + 7, lowest
    # bit first, so unpacking the bytes lowest bit first gives one 0/1 per token in order.
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab,
                            bitorder="little")
    forbidden = torch.from_numpy(allowed).to(logits.device, non_blocking=True) == 0
    if constrained_req_ids == sampling_req_ids:  # every sampling row: mask in place
        logits.masked_fill_(forbidden, float("-inf"))
        return
    row_of = {req_id: row for row, req_id in enumerate(sampling_req_ids)}
    rows = torch.tensor([row_of[req_id] for req_id in constrained_req_ids],
                        dtype=torch.int64, device=logits.device)
    logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
