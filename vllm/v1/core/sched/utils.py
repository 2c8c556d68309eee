"""The stop rules the scheduler applies to a request's sampled tokens (`check_stop`)."""

from __future__ import annotations

from vllm.v1.request import Request, RequestStatus


def append_until_stop(request: Request, token_ids: list[int], max_model_len: int
                      ) -> tuple[list[int], bool]:
    """Appends a step's sampled tokens one by one, cutting the run at the first that
    stops the request (several arrive at once with speculative decoding).

    Returns:
        The tokens appended, and whether the request stopped.

    Example: max_tokens 3, one token out, sampled [5, 6, 7] -> ([5, 6], True).
    """
    for i, token in enumerate(token_ids):
        request.append_output_token_ids([token])
        if check_stop(request, max_model_len):
            return token_ids[:i + 1], True
    return token_ids, False


def check_stop(request: Request, max_model_len: int) -> bool:
    """Whether `request` stops after its last token; if so, sets its finished status (and
    its stop_reason for a stop id)."""
    if request.stop_requested:  # a stop string the front end matched earlier
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if (request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    token = request.output_token_ids[-1]
    params = request.sampling_params
    if request.num_output_tokens < params.min_tokens:
        return False
    if token in params.stop_ids():
        request.status = RequestStatus.FINISHED_STOPPED
        # vLLM's stop_reason: None for the tokenizer's EOS, else the id that stopped.
        eos = not params.ignore_eos and token == params.eos_token_id
        request.stop_reason = None if eos else token
        return True
    return False
