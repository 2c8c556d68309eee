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


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt

__all__ = ["TextPrompt", "TokensPrompt", "EmbedsPrompt", "PromptType"]
