"""Prompt types accepted by `LLM.generate` and the engine."""

from __future__ import annotations

from typing import TypedDict

import torch


class TextPrompt(TypedDict, total=False):
    prompt: str


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]


class EmbedsPrompt(TypedDict, total=False):
    prompt_embeds: torch.Tensor


class SegmentsPrompt(TypedDict, total=False):
    """A prompt mixing text, token ids and embeddings, in order; for example
    `{"prompt_segments": ["Describe: ", tensor, " in one line."]}`.

    - a `str` segment is tokenized on its own, without special tokens (text never merges
      into tokens across a segment boundary);
    - a `list[int]` segment is taken as token ids, as they are;
    - a tensor segment `[num_rows, hidden_size]` (or `[1, num_rows, hidden_size]`) puts its
      rows at its positions, as `prompt_embeds` would (cast to the model dtype).
    When `add_special_tokens` is true (the default, as for a text prompt) the tokenizer's
    leading special tokens (BOS for Llama-style tokenizers; none for Qwen2 or SmolLM2)
    start the prompt. Needs `enable_prompt_embeds=True` once a tensor segment is present.
    Text positions keep real token ids: they share prefix-cache blocks with text prompts.
    """

    prompt_segments: list[str | list[int] | torch.Tensor]
    add_special_tokens: bool


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt | SegmentsPrompt

__all__ = ["TextPrompt", "TokensPrompt", "EmbedsPrompt", "SegmentsPrompt", "PromptType"]
