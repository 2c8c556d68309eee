"""Chat messages with `prompt_embeds` content parts: the template renders as usual, and each
part's rows stand exactly where the part stood.

Each part is swapped for a unique placeholder text part (a random nonce per conversation,
so no message text can forge one); the rendered prompt is then cut at the placeholders.
The text pieces between them are tokenized one by one, so no token ever spans a part's
edge: the template's own text (role headers, end-of-turn markers) and the message text
tokenize as they would against any hard boundary (a special token, the prompt's start).
"""

from __future__ import annotations

import secrets
from typing import Any, NamedTuple

import torch

EMBEDS_PART_TYPE = "prompt_embeds"


class EmbedsParts(NamedTuple):
    messages: list[dict[str, Any]]  # embeds parts replaced by their placeholders' text parts
    placeholders: list[str]
    data: list[Any]  # each part's `data` (a tensor offline, or base64 of torch.save)


def take_embeds_parts(messages: list[dict[str, Any]]) -> EmbedsParts:
    """Replaces every `{"type": "prompt_embeds", "data": ...}` part of `messages` by a text
    part holding a placeholder; raises ValueError for a part without data."""
    nonce = secrets.token_hex(8)
    placeholders: list[str] = []
    data: list[Any] = []
    result = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            result.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != EMBEDS_PART_TYPE:
                parts.append(part)
                continue
            if part.get("data") is None:
                raise ValueError(f"messages[{i}].content[{j}]: a prompt_embeds part needs "
                                 "'data' (base64 of torch.save(tensor [num_tokens, "
                                 "hidden_size])).")
            placeholder = f"<|prompt_embeds_{nonce}_{len(placeholders)}|>"
            placeholders.append(placeholder)
            data.append(part["data"])
            parts.append({"type": "text", "text": placeholder})
        result.append({**message, "content": parts})
    return EmbedsParts(result, placeholders, data)


def split_at_placeholders(text: str, placeholders: list[str]) -> list[str | int]:
    """The rendered prompt as text pieces and part indices, in order; each placeholder must
    appear exactly once (a template that drops or repeats a message's content cannot place
    its rows). Empty pieces are left out.

    Example: "<s>user: A\\n<P0>\\n<P1>\\nassistant:" -> ["<s>user: A\\n", 0, "\\n", 1,
    "\\nassistant:"].
    """
    located = []
    for k, placeholder in enumerate(placeholders):
        count = text.count(placeholder)
        if count != 1:
            raise ValueError(f"The chat template placed prompt_embeds part {k} {count} times "
                             "(it must render each message's content exactly once).")
        located.append((text.index(placeholder), k))
    pieces: list[str | int] = []
    at = 0
    for start, k in sorted(located):
        if start > at:
            pieces.append(text[at:start])
        pieces.append(k)
        at = start + len(placeholders[k])
    if at < len(text):
        pieces.append(text[at:])
    return pieces


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
                chat_template: str | None, max_model_len: int, hidden_size: int,
                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The engine prompt of one conversation, offline (`LLM.chat`): its rendered text as
    ids, or, with prompt_embeds parts, a `prompt_segments` prompt; raises ValueError."""
    from vllm.entrypoints.openai.prompt_embeds import (
        decode_prompt_embeds,
        prompt_embeds_byte_budget,
    )
    from vllm.entrypoints.openai.serving_chat import render_chat
    from vllm.entrypoints.openai.serving_engine import OpenAIError

    parts = take_embeds_parts(messages)
    try:
        text = render_chat(tokenizer, parts.messages, add_generation_prompt,
                           continue_final_message, chat_template_kwargs, chat_template,
                           tools=tools)
    except OpenAIError as e:
        raise ValueError(str(e)) from None
    if not parts.data:
        return {"prompt": text,
                "prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}
    budget = prompt_embeds_byte_budget(max_model_len, hidden_size)
    segments: list[Any] = []
    for piece in split_at_placeholders(text, parts.placeholders):
        if isinstance(piece, str):
            segments.append(piece)
            continue
        data = parts.data[piece]
        if isinstance(data, str):
            data = decode_prompt_embeds(data, budget)
        elif not isinstance(data, torch.Tensor):
            raise ValueError("A prompt_embeds part's data must be a tensor or base64 of "
                             f"torch.save(tensor), got {type(data).__name__}.")
        segments.append(data)
    return {"prompt_segments": segments, "add_special_tokens": False}
