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

import base64
import binascii
import json
import secrets
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm.entrypoints.embeds_codec import decode_prompt_embeds, prompt_embeds_byte_budget
from vllm.entrypoints.errors import OpenAIError
from vllm.multimodal.media import MediaConnector
from vllm.multimodal.processing import audio_token_id, image_embeds_tensor, image_token_id


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


# Content parts that stand for media -> their modality: images by URL (data:, file:,
# http(s):) or as precomputed embeddings (base64 of torch.save(tensor [feature_size,
# hidden_size]), or a tensor offline; Qwen2-VL's with their grid, below); audio inline
# (`input_audio`: base64 and a format, OpenAI's form) or by URL (`audio_url`, vLLM's form).
MEDIA_PART_TYPES = {"image_url": "image", "image_embeds": "image", "input_audio": "audio",
                    "audio_url": "audio"}
# What an image_embeds part's object may hold (vLLM's names): the rows, and for models
# whose positions follow each image's grid (Qwen2-VL, Qwen2.5-VL) the grids, [num_images,
# 3] as a list or base64 of torch.save. The model's processor refuses what it does not take.
IMAGE_EMBEDS_KEYS = ("image_embeds", "image_grid_thw")
# `input_audio` formats the decoder reads (libsndfile's).
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")


class MediaPart(NamedTuple):
    where: str  # "messages[i].content[j]", for error messages
    kind: str  # a key of MEDIA_PART_TYPES
    # the URL, the embeddings (with a grid: {"image_embeds", "image_grid_thw"}), or
    # input_audio's {"data", "format"}
    value: Any

    @property
    def modality(self) -> str:
        return MEDIA_PART_TYPES[self.kind]


def chat_placeholders(model_config: Any, tokenizer: Any) -> dict[str, str]:
    """Modality -> the text each of its items becomes in the rendered prompt (`{k}`: the
    item's number among its modality's, from 1), for the media the model takes: LLaVA's
    image token ("<image>"), Qwen2-VL's "<|vision_start|><|image_pad|><|vision_end|>",
    Gemma 3's "\\n\\n<start_of_image>" + its run of "<image_soft_token>" + "<end_of_image>\\n\\n",
    Qwen2-Audio's "Audio {k}: <|audio_bos|><|AUDIO|><|audio_eos|>" (vLLM's). The engine's
    processor expands each placeholder token to its item's run."""
    if tokenizer is None:
        return {}
    placeholders: dict[str, str] = {}
    if "image" in model_config.mm_modalities:
        config = model_config.hf_config
        image = tokenizer.convert_ids_to_tokens(image_token_id(config))
        start, end = (getattr(config, f"vision_{edge}_token_id", None)
                      for edge in ("start", "end"))
        if start is not None and end is not None:  # Qwen2-VL: the image between markers
            image = (tokenizer.convert_ids_to_tokens(start) + image
                     + tokenizer.convert_ids_to_tokens(end))
        boi = getattr(config, "boi_token_index", None)
        if boi is not None:  # Gemma 3: the whole sequence, as its processor writes it
            image = (f"\n\n{tokenizer.convert_ids_to_tokens(boi)}"
                     f"{image * config.mm_tokens_per_image}"
                     f"{tokenizer.convert_ids_to_tokens(config.eoi_token_index)}\n\n")
        placeholders["image"] = image
    if "audio" in model_config.mm_modalities:
        audio = tokenizer.convert_ids_to_tokens(audio_token_id(model_config.hf_config))
        placeholders["audio"] = f"Audio {{k}}: <|audio_bos|>{audio}<|audio_eos|>"
    return placeholders


def media_parts(messages: list[dict[str, Any]], modalities: Sequence[str]) -> list[MediaPart]:
    """The media parts of `messages`, in order; raises ValueError for media the model does
    not take (`modalities`) or a malformed part."""
    parts: list[MediaPart] = []

    def note(where: str, part: dict[str, Any]) -> str:
        kind = part["type"]
        modality = MEDIA_PART_TYPES[kind]
        if modality not in modalities:
            raise ValueError(f"{where}: this model takes no "
                             f"{'images' if modality == 'image' else modality}.")
        if part.get("uuid") is not None:
            raise ValueError(f"{where}: 'uuid' on media parts is not supported (the engine "
                             "caches media by their content).")
        parts.append(MediaPart(where, kind, _part_value(where, kind, part.get(kind))))
        return ""

    _replace_parts(messages, tuple(MEDIA_PART_TYPES), note)
    return parts


def _part_value(where: str, kind: str, value: Any) -> Any:
    """A media part's payload, checked for its form."""
    if kind in ("image_url", "audio_url"):
        value = value.get("url") if isinstance(value, dict) else value
        if value is None:
            what = kind.removesuffix("_url")
            raise ValueError(f"{where}: an {kind} part needs '{kind}': {{'url': "
                             f"'data:{what}/...'}}.")
        return value
    if kind == "input_audio":
        if not isinstance(value, dict) or not isinstance(value.get("data"), str):
            raise ValueError(f"{where}: an input_audio part needs 'input_audio': {{'data': "
                             "<base64 of the audio file>, 'format': 'wav'}.")
        audio_format = value.get("format")
        if not isinstance(audio_format, str) or audio_format.lower() not in AUDIO_FORMATS:
            raise ValueError(f"{where}: input_audio format {audio_format!r} is not supported "
                             f"({', '.join(AUDIO_FORMATS)}).")
        return value
    grid = None
    if isinstance(value, dict):  # {"image_embeds": ..., "image_grid_thw": ...}
        extra = sorted(k for k in value if k not in IMAGE_EMBEDS_KEYS)
        if extra:
            raise ValueError(f"{where}: image_embeds takes no {extra[0]!r} (only "
                             f"{' and '.join(map(repr, IMAGE_EMBEDS_KEYS))}).")
        value, grid = value.get("image_embeds"), value.get("image_grid_thw")
    if value is None:
        raise ValueError(f"{where}: an image_embeds part needs 'image_embeds' (base64 of "
                         "torch.save(tensor [feature_size, hidden_size])).")
    return value if grid is None else {"image_embeds": value, "image_grid_thw": grid}


def load_media_part(part: MediaPart, media: MediaConnector, embeds_budget: int
                    ) -> bytes | torch.Tensor | dict[str, Any]:
    """A media part's item offline: the encoded image or audio file its URL or data names,
    or its image embeddings (a tensor, or base64 of torch.save decoded within
    `embeds_budget` bytes; `image_embeds_item`)."""
    try:
        if part.kind == "image_url":
            return media.image_bytes(part.value)
        if part.kind == "audio_url":
            return media.audio_bytes(part.value)
        if part.kind == "input_audio":
            return input_audio_bytes(part.value["data"], media.max_audio_bytes)
        return image_embeds_item(
            part.value, lambda data, name: decode_prompt_embeds(data, embeds_budget, name))
    except ValueError as e:
        raise ValueError(f"{part.where}: {e}") from None


def image_embeds_item(value: Any, decode: Callable[[str, str], torch.Tensor]
                      ) -> torch.Tensor | dict[str, Any]:
    """An image_embeds part's item offline: its rows (a tensor, or base64 of torch.save
    that `decode(data, name)` decodes), and where the part has one its grid (a list or a
    tensor as given, base64 decoded), as `{"image_embeds": rows, "image_grid_thw": grid}`."""
    if isinstance(value, dict):
        grid = value["image_grid_thw"]
        return {"image_embeds": image_embeds_item(value["image_embeds"], decode),
                "image_grid_thw": decode(grid, "image_grid_thw") if isinstance(grid, str)
                else grid}
    return image_embeds_tensor(decode(value, "image_embeds") if isinstance(value, str)
                               else value)


def input_audio_bytes(data: str, max_bytes: int) -> bytes:
    """An input_audio part's file bytes from its base64 `data` (at most `max_bytes`)."""
    if len(data) > (max_bytes + 2) // 3 * 4 + 4:
        raise ValueError(f"The input_audio data is over the limit of {max_bytes} bytes.")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("The input_audio data is not valid base64.") from None


def _num_images(item: Any) -> int:
    """Images one loaded media part holds: embeddings [n, feature_size, hidden_size], or
    with a grid [n, 3], hold n (a malformed grid counts one: the processor refuses it)."""
    if isinstance(item, dict):
        grid = item["image_grid_thw"]
        if isinstance(grid, (torch.Tensor, np.ndarray)):
            return grid.shape[0] if grid.ndim == 2 else 1
        nested = isinstance(grid, (list, tuple)) and grid and isinstance(grid[0], (list, tuple))
        return len(grid) if nested else 1
    return item.shape[0] if isinstance(item, torch.Tensor) and item.dim() == 3 else 1


class MediaItems(NamedTuple):
    messages: list[dict[str, Any]]  # media parts replaced by their placeholders' text parts
    data: dict[str, list[Any]]  # modality -> its items in order (the `multi_modal_data`)


def with_media_placeholders(messages: list[dict[str, Any]], placeholders: dict[str, str],
                            parts: Sequence[MediaPart],
                            items: Sequence[bytes | torch.Tensor | dict[str, Any]]
                            ) -> MediaItems:
    """`messages` with media part k (as `media_parts` found them, loaded as `items[k]`)
    replaced by its modality's placeholder, once per image or clip it holds (`_num_images`),
    and the items by modality; the engine's processor expands each placeholder to its
    item's run.

    Example (Qwen2-Audio): two input_audio parts -> "Audio 1: <|audio_bos|><|AUDIO|>
    <|audio_eos|>" and "Audio 2: ..." text parts, data {"audio": [bytes0, bytes1]}.
    """
    data: dict[str, list[Any]] = {}
    texts = []
    for part, item in zip(parts, items, strict=True):
        count = _num_images(item)
        done = data.setdefault(part.modality, [])
        template = placeholders[part.modality]
        texts.append("".join(template.replace("{k}", str(len(done) + i + 1))
                             for i in range(count)))
        done.append(item)
    text_iter = iter(texts)
    messages = _replace_parts(messages, tuple(MEDIA_PART_TYPES), lambda _, __: next(text_iter))
    return MediaItems(messages, data)


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool, chat_template_kwargs: dict[str, Any] | None,
                chat_template: str | None, max_model_len: int, hidden_size: int,
                tools: list[dict[str, Any]] | None = None,
                placeholders: dict[str, str] | None = None,
                media: MediaConnector | None = None) -> dict[str, Any]:
    """The engine prompt of one conversation, offline (`LLM.chat`): its rendered text as
    ids, with media parts their items (`multi_modal_data`; URLs read by `media`, data: URLs
    only by default; `placeholders` from `chat_placeholders`), or, with prompt_embeds parts,
    a `prompt_segments` prompt; raises ValueError."""
    budget = prompt_embeds_byte_budget(max_model_len, hidden_size)
    placeholders = placeholders or {}
    found = media_parts(messages, tuple(placeholders))
    items = [load_media_part(part, media or MediaConnector(), budget) for part in found]
    mm_data: dict[str, list[Any]] = {}
    if found:
        messages, mm_data = with_media_placeholders(messages, placeholders, found, items)
    parts = take_embeds_parts(messages)
    if found and parts.data:
        raise ValueError("A conversation cannot mix media parts and prompt_embeds parts.")
    try:
        text = render_chat(tokenizer, parts.messages, add_generation_prompt,
                           continue_final_message, chat_template_kwargs, chat_template,
                           tools=tools)
    except OpenAIError as e:
        raise ValueError(str(e)) from None
    if not parts.data:
        prompt = {"prompt": text,
                  "prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}
        return {**prompt, "multi_modal_data": mm_data} if mm_data else prompt
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
