"""The model runner's side of structured outputs: one batched masking of the step's
constrained logits rows by the scheduler's packed grammar bitmask, read in its packed form."""

from __future__ import annotations

import torch

from vllm._custom_ops import native_ops


def apply_grammar_bitmask(logits: torch.Tensor, sampling_req_ids: list[str],
                          constrained_req_ids: list[str], bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, every token a request's grammar forbids.

    Args:
        logits: [num_sampling_reqs, vocab] float, row i for sampling_req_ids[i].
        sampling_req_ids: the requests sampling this step, in logits-row order.
        constrained_req_ids: the requests with a grammar, bitmask-row order (a subset of
            those sampling, in any order: unconstrained rows are not touched).
        bitmask: [len(constrained_req_ids), ceil(vocab / 32)] int32 on CPU; bit t % 32 of
            word t // 32 set = token t allowed. E.g. allowing only tokens 0 and 33 of a
            64-token vocabulary: [[0b1, 0b10]].
    """
    rows = None  # every sampling row, in order
    if constrained_req_ids != sampling_req_ids:
        row_of = {req_id: row for row, req_id in enumerate(sampling_req_ids)}
        rows = torch.tensor([row_of[req_id] for req_id in constrained_req_ids],
                            dtype=torch.int64)
    ops = native_ops(logits.device)
    if ops is not None and logits.stride(-1) == 1 and logits.dtype in (
            torch.float32, torch.bfloat16, torch.float16):
        # Writes only the forbidden tokens, reading each packed word once.
        ops.apply_token_bitmask(logits, bitmask, torch.arange(len(constrained_req_ids))
                                if rows is None else rows)
        return
    apply_bitmask_torch(logits, rows, bitmask.to(logits.device, non_blocking=True))


def apply_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor | None,
                        bitmask: torch.Tensor) -> None:
    """The same on any device (`rows`: the logits row of each bitmask row; None: all, in
    order), the words unpacked there, 8 bits a byte.

    Little-endian words: byte j of word w holds tokens 32w + 8j ... 32w + 8j + 7, lowest
    bit first. E.g. word 0b101 -> bytes [0b101, 0, 0, 0] -> bits [1, 0, 1, 0, ..., 0]:
    tokens 0 and 2 allowed.
    """
    vocab = logits.shape[1]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab]
    if rows is None:
        logits.masked_fill_(allowed == 0, float("-inf"))
        return
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))
