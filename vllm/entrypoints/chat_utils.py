"""Chat rendering, shared by `LLM.chat` and the server's `/v1/chat/completions` (and
`/tokenize`): message checks, the `chat_template_kwargs` rules, size bounds, tools shown to
the template, and `prompt_embeds` content parts. Nothing here imports the server.

`prompt_embeds` parts: each part is swapped for a unique placeholder text part (a random
nonce per conversation, so no message text can forge one); the rendered prompt is then cut
at the placeholders. The text pieces between them are tokenized one by one, so no token ever
spans a part's edge: the template's own text (role headers, end-of-turn markers) and the
message text tokenize as they would against any hard boundary (a special token, the prompt's
start).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from vllm.entrypoints.embeds_codec import decode_prompt_embeds, prompt_embeds_byte_budget
from vllm.entrypoints.errors import OpenAIError
from vllm.multimodal.media import MediaConnector


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Checks roles and flattens OpenAI content parts to text (only text parts exist here)."""
    result = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise OpenAIError(f"messages[{i}] needs a string 'role'.")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise OpenAIError(f"messages[{i}]: only text and prompt_embeds content "
                                      "parts are supported.")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string or a list of parts.")
        result.append({**message, "content": content})
    return result


# Arguments of `apply_chat_template` itself: template variables may not override them.
_RESERVED_TEMPLATE_KWARGS = (
    "chat_template", "conversation", "messages", "tools", "documents", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as template variables; raises OpenAIError for a template
    smuggled in (`chat_template`) or a key that would change how rendering works."""
    kwargs = dict(kwargs or {})
    if "chat_template" in kwargs:
        raise OpenAIError("chat_template is not allowed in chat_template_kwargs: a chat "
                          "template is code the server runs. Use the request's chat_template "
                          "field, honoured only by a server started with "
                          "--trust-request-chat-template.")
    for key in kwargs:
        if key in _RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise OpenAIError(f"chat_template_kwargs may not set {key!r}.")
    return kwargs


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None, max_chars: int | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """The prompt text the chat template makes of `messages` (and `tools`, OpenAI's
    function definitions, for templates that show them); raises OpenAIError.

    With `max_chars`, the messages' text and the rendered prompt must each fit in it.
    """
    if not messages:
        raise OpenAIError("messages must not be empty.")
    if add_generation_prompt and continue_final_message:
        raise OpenAIError("continue_final_message and add_generation_prompt cannot both be "
                          "true.")
    kwargs = check_template_kwargs(chat_template_kwargs)
    if continue_final_message:
        kwargs["continue_final_message"] = True
    messages = parse_message_arguments(normalize_messages(messages))
    size = sum(len(m["content"]) for m in messages) + len(json.dumps(tools or []))
    if max_chars is not None and size > max_chars:
        raise OpenAIError(f"The messages hold {size} characters, more than the {max_chars} "
                          "that could fit this model's maximum context length.")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, tools=tools,
                                             **kwargs)
    except OpenAIError:
        raise
    except Exception as e:  # jinja errors, a tokenizer without a template, bad kwargs
        raise OpenAIError(f"The chat template could not be applied: {e}") from None
    if max_chars is not None and len(text) > max_chars:
        raise OpenAIError(f"The chat template rendered {len(text)} characters, more than the "
                          f"{max_chars} that could fit this model's maximum context length.")
    return text


def parse_message_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant messages' `tool_calls` with their `arguments` JSON text parsed into objects,
    the form chat templates render; raises OpenAIError naming a malformed call."""
    result = []
    for i, message in enumerate(messages):
        tool_calls = message.get("tool_calls")
        if tool_calls is None:
            result.append(message)
            continue
        if not isinstance(tool_calls, list):
            raise OpenAIError(f"messages[{i}].tool_calls must be a list.")
        parsed = []
        for j, call in enumerate(tool_calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise OpenAIError(f"{where} needs a function with a name.")
            arguments = function.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError as e:
                    raise OpenAIError(f"{where}.function.arguments is not JSON: {e}") from None
            parsed.append({**call, "function": {**function, "arguments": arguments}})
        result.append({**message, "tool_calls": parsed})
    return result


EMBEDS_PART_TYPE = "prompt_embeds"


class EmbedsParts(NamedTuple):
    messages: list[dict[str, Any]]  # embeds parts replaced by their placeholders' text parts
    placeholders: list[str]
    data: list[Any]  # each part's `data` (a tensor offline, or base64 of torch.save)


def _replace_parts(messages: list[dict[str, Any]], part_types: tuple[str, ...],
                   to_text: Callable[[str, dict[str, Any]], str]) -> list[dict[str, Any]]:
    """`messages` with every content part whose type is in `part_types` replaced by a text
    part, its text `to_text(where, part)` (`where`: "messages[i].content[j]", for error
    messages), called in message and part order."""
    result = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            result.append(message)
            continue
        parts = [part if not isinstance(part, dict) or part.get("type") not in part_types
                 else {"type": "text", "text": to_text(f"messages[{i}].content[{j}]", part)}
                 for j, part in enumerate(content)]
        result.append({**message, "content": parts})
    return result


def take_embeds_parts(messages: list[dict[str, Any]]) -> EmbedsParts:
    """Replaces every `{"type": "prompt_embeds", "data": ...}` part of `messages` by a text
    part holding a placeholder; raises ValueError for a part without data."""
    nonce = secrets.token_hex(8)
    placeholders: list[str] = []
    data: list[Any] = []

    def placeholder(where: str, part: dict[str, Any]) -> str:
        if part.get("data") is None:
            raise ValueError(f"{where}: a prompt_embeds part needs 'data' (base64 of "
                             "torch.save(tensor [num_tokens, hidden_size])).")
        placeholders.append(f"<|prompt_embeds_{nonce}_{len(placeholders)}|>")
        data.append(part["data"])
        return placeholders[-1]

    result = _replace_parts(messages, (EMBEDS_PART_TYPE,), placeholder)
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


def segments_prompt(pieces: list[str | int], texts: Sequence[Any],
                    rows: Sequence[torch.Tensor]) -> dict[str, Any]:
    """The engine's mixed prompt of a rendered conversation with prompt_embeds parts:
    `pieces` (from `split_at_placeholders`) in order, the i-th text piece as `texts[i]` (its
    text, or its token ids) and part k as `rows[k]`. The template writes its own special
    tokens, so the engine adds none.

    Example: pieces ["<s>user: ", 0, "\\nassistant:"], texts [[1, 7], [9, 4]], rows [R0]
    -> {"prompt_segments": [[1, 7], R0, [9, 4]], "add_special_tokens": False}.
    """
    text_iter = iter(texts)
    segments = [rows[piece] if isinstance(piece, int) else next(text_iter) for piece in pieces]
    return {"prompt_segments": segments, "add_special_tokens": False}


# Content parts that stand for images: a URL (data:, file:, http(s):) or precomputed
# embeddings (base64 of torch.save(tensor [feature_size, hidden_size]), or a tensor offline).
IMAGE_PART_TYPES = ("image_url", "image_embeds")


class ImagePart(NamedTuple):
    where: str  # "messages[i].content[j]", for error messages
    kind: str  # "image_url" or "image_embeds"
    value: Any  # the URL, or the embeddings


def image_placeholder(model_config: Any, tokenizer: Any) -> str | None:
    """The text of an image model's image token ("<image>" for LLaVA), which each image of
    an image part becomes in the rendered prompt; None for a model without images."""
    if not model_config.is_image_model or tokenizer is None:
        return None
    from vllm.multimodal.processing import image_token_id

    return tokenizer.convert_ids_to_tokens(image_token_id(model_config.hf_config))


def image_parts(messages: list[dict[str, Any]], takes_images: bool) -> list[ImagePart]:
    """The `image_url` and `image_embeds` parts of `messages`, in order; raises ValueError
    for a model without images or a malformed part."""
    parts: list[ImagePart] = []

    def note(where: str, part: dict[str, Any]) -> str:
        kind = part["type"]
        if not takes_images:
            raise ValueError(f"{where}: this model takes no images.")
        if part.get("uuid") is not None:
            raise ValueError(f"{where}: 'uuid' on media parts is not supported (the engine "
                             "caches images by their content).")
        value = part.get(kind)
        if kind == "image_url":
            value = value.get("url") if isinstance(value, dict) else value
        elif isinstance(value, dict):  # {"image_embeds": ...}: no extra inputs for LLaVA
            extra = sorted(k for k in value if k != "image_embeds")
            if extra:
                raise ValueError(f"{where}: image_embeds takes no {extra[0]!r} for this "
                                 "model: send the embeddings alone.")
            value = value.get("image_embeds")
        if value is None and kind == "image_url":
            raise ValueError(f"{where}: an image_url part needs 'image_url': {{'url': "
                             "'data:image/...'}.")
        if value is None:
            raise ValueError(f"{where}: an image_embeds part needs 'image_embeds' (base64 of "
                             "torch.save(tensor [feature_size, hidden_size])).")
        parts.append(ImagePart(where, kind, value))
        return ""

    _replace_parts(messages, IMAGE_PART_TYPES, note)
    return parts


def load_image_part(part: ImagePart, media: MediaConnector, embeds_budget: int
                    ) -> bytes | torch.Tensor:
    """An image part's image offline: the encoded bytes its URL names, or its embeddings
    (a tensor, or base64 of torch.save decoded within `embeds_budget` bytes)."""
    try:
        if part.kind == "image_url":
            return media.image_bytes(part.value)
        if isinstance(part.value, str):
            return image_embeds_tensor(decode_prompt_embeds(part.value, embeds_budget,
                                                            "image_embeds"))
        return image_embeds_tensor(part.value)
    except ValueError as e:
        raise ValueError(f"{part.where}: {e}") from None


def image_embeds_tensor(value: Any) -> torch.Tensor:
    """An image_embeds part's value as embeddings: a floating-point tensor (a uint8 one
    would be taken for pixels)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"image_embeds must be a floating-point tensor [feature_size, "
                         f"hidden_size], got {got}.")
    return value


def with_image_placeholders(messages: list[dict[str, Any]], image_token: str,
                            images: Sequence[bytes | torch.Tensor]) -> list[dict[str, Any]]:
    """`messages` with image part k (as `image_parts` found them) replaced by the model's
    placeholder, once per image it holds (embeddings [n, feature_size, hidden_size]: n);
    the engine's processor expands each to its image's run."""
    counts = iter([image.shape[0] if isinstance(image, torch.Tensor) and image.dim() == 3
                   else 1 for image in images])
    return _replace_parts(messages, IMAGE_PART_TYPES, lambda _, __: image_token * next(counts))


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
                chat_template: str | None, max_model_len: int, hidden_size: int,
                tools: list[dict[str, Any]] | None = None,
                image_token: str | None = None,
                media: MediaConnector | None = None) -> dict[str, Any]:
    """The engine prompt of one conversation, offline (`LLM.chat`): its rendered text as
    ids, with image parts its images (`multi_modal_data`; URLs read by `media`, data: URLs
    only by default), or, with prompt_embeds parts, a `prompt_segments` prompt; raises
    ValueError."""
    budget = prompt_embeds_byte_budget(max_model_len, hidden_size)
    images = [load_image_part(part, media or MediaConnector(), budget)
              for part in image_parts(messages, image_token is not None)]
    if images:
        assert image_token is not None  # image_parts refuses images for other models
        messages = with_image_placeholders(messages, image_token, images)
    parts = take_embeds_parts(messages)
    if images and parts.data:
        raise ValueError("A conversation cannot mix image parts and prompt_embeds parts.")
    try:
        text = render_chat(tokenizer, parts.messages, add_generation_prompt,
                           continue_final_message, chat_template_kwargs, chat_template,
                           tools=tools)
    except OpenAIError as e:
        raise ValueError(str(e)) from None
    if not parts.data:
        prompt = {"prompt": text,
                  "prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}
        return {**prompt, "multi_modal_data": {"image": images}} if images else prompt
    pieces = split_at_placeholders(text, parts.placeholders)
    rows = [_offline_rows(data, budget) for data in parts.data]
    # Text pieces stay text: the engine tokenizes each on its own, without special tokens.
    return segments_prompt(pieces, [p for p in pieces if isinstance(p, str)], rows)


def _offline_rows(data: Any, budget: int) -> torch.Tensor:
    """A part's rows offline: a tensor as given, or base64 of torch.save decoded."""
    if isinstance(data, str):
        return decode_prompt_embeds(data, budget)
    if not isinstance(data, torch.Tensor):
        raise ValueError("A prompt_embeds part's data must be a tensor or base64 of "
                         f"torch.save(tensor), got {type(data).__name__}.")
    return data
