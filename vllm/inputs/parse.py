"""Turning a user prompt into token ids or validated prompt embeds."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class ParsedPrompt(NamedTuple):
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_embeds: torch.Tensor | None
    # Encoder/decoder models: the encoder's prompt (None for audio and embeds).
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    # A mixed prompt: text, token-id lists and embeds tensors, in order (see
    # `vllm.inputs.SegmentsPrompt`); the Processor turns it into ids, rows and a mask.
    prompt_segments: list | None = None
    # prompt_segments: start with the tokenizer's leading special tokens (BOS).
    add_special_tokens: bool = True


_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds", "prompt_segments")


def parse_prompt(prompt: Any) -> ParsedPrompt:
    """Accepts a str, {"prompt": str}, {"prompt_token_ids": [...]}, {"prompt_embeds": T},
    {"prompt_segments": [str | list[int] | T, ...]}."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None, None)
    if not isinstance(prompt, dict):
        raise ValueError("A prompt must be a str or a dict with one of "
                         f"{', '.join(_KEYS)}; got {type(prompt).__name__}.")
    present = [k for k in _KEYS if prompt.get(k) is not None]
    if "prompt_segments" in present:
        if len(present) > 1:
            raise ValueError("A prompt with prompt_segments cannot also carry "
                             f"{', '.join(k for k in present if k != 'prompt_segments')}.")
        segments = prompt["prompt_segments"]
        if not isinstance(segments, (list, tuple)) or not segments:
            raise ValueError("prompt_segments must be a non-empty list of text, token-id "
                             "lists and embeds tensors.")
        add_special = prompt.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise ValueError("add_special_tokens must be a bool.")
        return ParsedPrompt(None, None, None, prompt_segments=list(segments),
                            add_special_tokens=add_special)
    if "prompt_embeds" in present and len(present) > 1:
        raise ValueError("A prompt with prompt_embeds cannot also carry prompt or "
                         "prompt_token_ids.")
    if "prompt_embeds" in present:
        return ParsedPrompt(None, None, prompt["prompt_embeds"])
    if "prompt_token_ids" in present:
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return ParsedPrompt(prompt.get("prompt"), list(ids), None)
    if "prompt" in present:
        if not isinstance(prompt["prompt"], str):
            raise ValueError("prompt must be a str.")
        return ParsedPrompt(prompt["prompt"], None, None)
    raise ValueError(f"A prompt dict needs one of {', '.join(_KEYS)}; got keys "
                     f"{sorted(prompt)}.")


def validate_prompt_embeds(embeds: Any, hidden_size: int, dtype: torch.dtype,
                           max_model_len: int, what: str = "prompt") -> torch.Tensor:
    """Checks prompt embeds and returns them as a contiguous CPU tensor of `dtype`.

    A `[1, num_tokens, hidden_size]` tensor is squeezed to `[num_tokens, hidden_size]`.
    """
    if not isinstance(embeds, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}.")
    if embeds.is_meta:
        raise ValueError("prompt_embeds is a meta tensor: it has no data.")
    if embeds.layout != torch.strided:
        raise ValueError(f"prompt_embeds must be a dense tensor, got layout {embeds.layout}.")
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds.squeeze(0)
    if embeds.dim() != 2:
        raise ValueError("prompt_embeds must be 2-D [num_tokens, hidden_size] (or 3-D with a "
                         f"leading dimension of 1), got shape {tuple(embeds.shape)}.")
    if not embeds.is_floating_point():
        raise ValueError(f"prompt_embeds must have a floating dtype, got {embeds.dtype}.")
    if embeds.shape[0] == 0:
        raise ValueError("prompt_embeds is empty: it has 0 tokens.")
    if embeds.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds hidden size is {embeds.shape[1]}, but the model's "
                         f"hidden_size is {hidden_size}.")
    if embeds.shape[0] > max_model_len:
        limit = "encoder length" if what == "encoder prompt" else "model length"
        raise ValueError(f"The {what} (length {embeds.shape[0]}) is longer than the maximum "
                         f"{limit} of {max_model_len}.")
    embeds = embeds.detach().to(device="cpu", dtype=dtype).contiguous()
    if not torch.isfinite(embeds).all():
        raise ValueError("prompt_embeds contains non-finite values (NaN or inf), after the "
                         f"cast to {dtype}.")
    return embeds
