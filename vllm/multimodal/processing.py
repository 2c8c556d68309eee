"""A media prompt as the engine takes it: each item's placeholder token expanded to its run
of positions, and each item preprocessed into a `MediaInput` whose rows the engine core
computes (`vllm/v1/engine/media_rows.py`), or, for image embeddings (a float tensor
[feature_size, hidden_size] in place of an image, with `enable_mm_embeds`; Qwen2-VL's with
each image's grid, `vllm/multimodal/qwen2_vl.py`), whose rows the user gave. An image's run
has a fixed length (Qwen2-VL's follows its grid); an audio clip's follows its length.

Example (LLaVA, 4 rows per image, `<image>` = 32000):
    "USER: <image>\\nWhat is this?" -> ids [1, 3148, 32000, 13, ...]
    -> ids [1, 3148, 32000, 32000, 32000, 32000, 13, ...], is_token [T, T, F, F, F, F, T, ...],
       one MediaInput("image", offset=2, num_tokens=4).
Example (Qwen2-Audio, a 1 s clip = 25 rows): "<|audio_bos|><|AUDIO|><|audio_eos|>Say it" ->
    the <|AUDIO|> id repeated 25 times between the two markers.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from vllm.config import ModelConfig
from vllm.model_executor.models.registry import resolve_prompt_processor_cls
from vllm.multimodal.audio import AudioFeatureExtractor, num_audio_tokens
from vllm.multimodal.image import ImageProcessorConfig, load_image, preprocess
from vllm.v1.messages import MediaInput


class MediaPrompt(NamedTuple):
    token_ids: list[int]  # media positions hold the placeholder token id
    is_token: torch.Tensor  # bool [num_tokens]: False at media positions
    items: list[MediaInput]
    # M-RoPE models (Qwen2-VL): [3, num_tokens] int64 rotary positions; None for the others
    mrope_positions: torch.Tensor | None = None


def expand_placeholders(token_ids: list[int], placeholder: int, items: list[MediaInput],
                        what: str, max_len: int) -> MediaPrompt:
    """`token_ids` with the k-th `placeholder` token expanded to item k's run (setting its
    `offset`); `what` names the items in errors ("image", "audio clip").

    Example: ids [1, P, 5, P], items of 2 and 3 rows -> [1, P, P, 5, P, P, P], is_token
    [T, F, F, T, F, F, F], offsets 1 and 4.
    """
    starts = placeholder_starts(token_ids, placeholder, len(items), what)
    ids: list[int] = []
    is_token: list[bool] = []
    previous = 0
    for start, item in zip(starts, items, strict=True):
        ids += token_ids[previous:start]
        is_token += [True] * (start - previous)
        item.offset = len(ids)
        ids += [placeholder] * item.num_tokens
        is_token += [False] * item.num_tokens
        previous = start + 1
    ids += token_ids[previous:]
    is_token += [True] * (len(token_ids) - previous)
    if len(ids) > max_len:
        sizes = sorted({item.num_tokens for item in items})
        each = (f"of {sizes[0]} positions each" if len(sizes) == 1
                else f"of {sum(item.num_tokens for item in items)} positions in all")
        raise ValueError(f"The prompt (length {len(ids)}, with {len(items)} {what}(s) {each}) "
                         f"is longer than the maximum model length of {max_len}.")
    return MediaPrompt(ids, torch.tensor(is_token, dtype=torch.bool), items)


def placeholder_starts(token_ids: list[int], placeholder: int, count: int,
                       what: str) -> list[int]:
    """The positions of `placeholder` in `token_ids`, which must be `count` (checked before
    any item is decoded)."""
    starts = [i for i, t in enumerate(token_ids) if t == placeholder]
    if len(starts) != count:
        raise ValueError(f"The prompt has {len(starts)} {what} placeholder(s) ({what} token "
                         f"id {placeholder}) but {count} {what}(s) were given: put one "
                         f"placeholder where each {what} goes.")
    return starts


# LLaVA's vision towers -> whether the tower puts a class token before the patches.
LLAVA_TOWERS = {"clip_vision_model": True, "siglip_vision_model": False}


def num_image_tokens(config: Any) -> int:
    """Rows one image becomes in a LLaVA config: the tower's positions (its patches, and
    CLIP's class token), less the first under the `default` strategy. Example: CLIP, 336 px,
    patch 14 -> 24 * 24 = 576 (`default`), 577 (`full`); SigLIP 384 px, patch 14 -> 729
    (`full`), 728 (`default`)."""
    vision = config.vision_config
    positions = (vision.image_size // vision.patch_size) ** 2
    positions += int(LLAVA_TOWERS[vision.model_type])
    return positions - (1 if config.vision_feature_select_strategy == "default" else 0)


def check_vision_tower(config: Any) -> None:
    """LLaVA's tower must be CLIP's or SigLIP's."""
    kind = getattr(config.vision_config, "model_type", None)
    if kind not in LLAVA_TOWERS:
        raise ValueError(f"LLaVA with a {kind!r} vision tower is not supported "
                         f"({', '.join(LLAVA_TOWERS)}).")


def image_token_id(config: Any) -> int:
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError("The model's config names no image token (image_token_index).")
    return int(token)


class MediaPromptProcessor(Protocol):
    """A multimodal model's prompt processor, declared in the model registry
    (`registry.resolve_prompt_processor_cls`) and built with (model_config, tokenizer)."""

    def expand_text(self, text: str) -> str:
        """A text prompt before tokenization (placeholders the model writes as text)."""
        ...

    def process(self, token_ids: list[int], data: Any) -> MediaPrompt:
        """`token_ids`: the tokenized prompt; `data`: its multi_modal_data."""
        ...


class ImagePromptProcessor:
    """Turns `{"prompt" | "prompt_token_ids", "multi_modal_data": {"image": ...}}` into an
    `MediaPrompt`, with the model's own image processor settings and the engine's limits.
    LLaVA's; a model whose placeholder, run or image settings differ overrides
    `image_run` and `load_image_config` (Gemma 3)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        """`tokenizer`: unused (LLaVA's placeholder is one token, written as the user did)."""
        config = model_config.hf_config
        self.model_config = model_config
        self.image_token_id, self.num_image_tokens = self.image_run(config)
        self.image_config = self.load_image_config(model_config.model)
        side = config.vision_config.image_size
        if self.image_config.output_size != (side, side):
            raise ValueError(f"The image processor gives {self.image_config.output_size} "
                             f"images, but the vision tower takes {side}x{side}.")
        self.limit = model_config.mm_limit("image")

    def image_run(self, config: Any) -> tuple[int, int]:
        """(the placeholder token id of an image's run, the run's length)."""
        check_vision_tower(config)
        return image_token_id(config), num_image_tokens(config)

    def load_image_config(self, path: str) -> ImageProcessorConfig:
        """The image processor's settings from the model's directory."""
        return ImageProcessorConfig.from_model_dir(path)

    def expand_text(self, text: str) -> str:
        """A text prompt before tokenization: LLaVA's placeholders stay as written."""
        return text

    def process(self, token_ids: list[int], data: Any) -> MediaPrompt:
        """`token_ids`: the prompt, one image token per image; `data`: multi_modal_data."""
        images = media_items(data, "image", self.model_config.architecture)
        images = [item for image in images for item in split_image_embeds(image)]
        check_limit(len(images), "image", self.limit)
        placeholder_starts(token_ids, self.image_token_id, len(images), "image")
        inputs = [self._image_input(k, image) for k, image in enumerate(images)]
        return expand_placeholders(token_ids, self.image_token_id, inputs, "image",
                                   self.model_config.max_model_len)

    def _image_input(self, k: int, image: Any) -> MediaInput:
        """Image k of the prompt: pixels for the vision encoder, or the user's rows."""
        if is_image_embeds(image):
            embeds = self._check_embeds(k, image)
            return MediaInput("image", None, 0, self.num_image_tokens,
                              tensor_hash(b"E", embeds), embeds=embeds)
        pixels = preprocess(load_image(image), self.image_config)
        return MediaInput("image", pixels, 0, self.num_image_tokens,
                          tensor_hash(b"P", pixels))

    def _check_embeds(self, k: int, embeds: torch.Tensor) -> torch.Tensor:
        """image_embeds item k as [num_image_tokens, hidden_size] in the model's dtype."""
        mc = self.model_config
        check_mm_embeds_enabled(mc)
        want = (self.num_image_tokens, mc.hidden_size)
        check_dense(embeds, f"image_embeds item {k}")
        if tuple(embeds.shape) != want:
            raise ValueError(f"image_embeds item {k} has shape {tuple(embeds.shape)}, but one "
                             f"image of {mc.architecture} is {want} [feature_size, "
                             "hidden_size] (several images: [num_images, feature_size, "
                             "hidden_size]).")
        return finite_rows(embeds, mc.dtype, f"image_embeds item {k}")


def check_mm_embeds_enabled(model_config: ModelConfig) -> None:
    if not model_config.enable_mm_embeds:
        raise ValueError("image_embeds given, but image embeddings are disabled: create "
                         "the engine with enable_mm_embeds=True (server: "
                         "--enable-mm-embeds).")


def check_dense(embeds: torch.Tensor, what: str) -> None:
    if embeds.layout != torch.strided or embeds.is_meta:
        raise ValueError(f"{what} must be a dense tensor with data, got layout "
                         f"{embeds.layout}.")


def finite_rows(embeds: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    """`embeds` on the CPU in `dtype`, contiguous; raises ValueError naming `what` if a
    value is not finite after the cast."""
    embeds = embeds.detach().to(device="cpu", dtype=dtype).contiguous()
    if not torch.isfinite(embeds).all():
        raise ValueError(f"{what} contains non-finite values (NaN or inf), after the cast "
                         f"to {dtype}.")
    return embeds


class AudioPromptProcessor:
    """Turns `{"prompt" | "prompt_token_ids", "multi_modal_data": {"audio": clip | [clips]}}`
    into a `MediaPrompt` for Qwen2-Audio: each `<|AUDIO|>` token (one per clip, as the user
    or the chat template writes it) becomes the clip's run of `num_audio_tokens` positions,
    with the model's own feature extractor settings and the engine's limits. A clip is
    `(waveform, sample_rate)`, a waveform at the extractor's rate, or audio file bytes."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        """`tokenizer`: unused (the placeholder is one token, written as the user did)."""
        config = model_config.hf_config
        audio = config.audio_config
        self.model_config = model_config
        self.audio_token_id = audio_token_id(config)
        self.extractor = AudioFeatureExtractor(model_config.model, audio.num_mel_bins,
                                               2 * audio.max_source_positions)
        self.limit = model_config.mm_limit("audio")

    def expand_text(self, text: str) -> str:
        """A text prompt before tokenization: placeholders stay as written."""
        return text

    def process(self, token_ids: list[int], data: Any) -> MediaPrompt:
        """`token_ids`: the prompt, one audio token per clip; `data`: multi_modal_data."""
        clips = media_items(data, "audio", self.model_config.architecture)
        check_limit(len(clips), "audio clip", self.limit)
        placeholder_starts(token_ids, self.audio_token_id, len(clips), "audio clip")
        inputs = [self._clip_input(k, clip) for k, clip in enumerate(clips)]
        return expand_placeholders(token_ids, self.audio_token_id, inputs, "audio clip",
                                   self.model_config.max_model_len)

    def _clip_input(self, k: int, clip: Any) -> MediaInput:
        try:
            features, num_frames = self.extractor.features(clip)
        except ValueError as e:
            raise ValueError(f"Audio clip {k}: {e}") from None
        return MediaInput("audio", features, 0, num_audio_tokens(num_frames),
                          tensor_hash(b"A", features))


def audio_token_id(config: Any) -> int:
    token = getattr(config, "audio_token_id", None)
    if token is None:
        token = getattr(config, "audio_token_index", None)
    if token is None:
        raise ValueError("The model's config names no audio token (audio_token_index).")
    return int(token)


def media_prompt_processor(model_config: ModelConfig, tokenizer: Any = None
                           ) -> MediaPromptProcessor | None:
    """The processor of a multimodal model's prompts (the one its registry entry names);
    None for a model of text."""
    cls = resolve_prompt_processor_cls(model_config.architecture)
    return None if cls is None else cls(model_config, tokenizer)


def media_items(data: Any, modality: str, architecture: str) -> list[Any]:
    """The `modality` items of `multi_modal_data`: a list of items, or one item. For audio,
    a `(waveform, sample_rate)` pair is one clip."""
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict such as {{{modality!r}: ...}}, got "
                         f"{type(data).__name__}.")
    other = sorted(k for k in data if k != modality)
    if other:
        only = "images" if modality == "image" else modality
        raise ValueError(f"multi_modal_data: {architecture} takes {only} only, not "
                         f"{other[0]!r}.")
    items = data.get(modality)
    if items is None:
        raise ValueError(f"multi_modal_data has no {modality!r}.")
    if modality == "audio" and _is_rate_pair(items):
        return [items]
    return list(items) if isinstance(items, (list, tuple)) else [items]


def _is_rate_pair(item: Any) -> bool:
    """(waveform, sample_rate): one clip, not a list of two."""
    return (isinstance(item, (tuple, list)) and len(item) == 2
            and isinstance(item[0], (np.ndarray, torch.Tensor))
            and not isinstance(item[1], bool) and isinstance(item[1], (int, float)))


def check_limit(count: int, what: str, limit: int) -> None:
    if count > limit:
        raise ValueError(f"At most {limit} {what}(s) may be provided in one prompt, got "
                         f"{count} (limit_mm_per_prompt).")


def is_image_embeds(item: Any) -> bool:
    """A floating-point tensor stands for image embeddings (uint8 tensors are pixels)."""
    return isinstance(item, torch.Tensor) and item.is_floating_point()


def image_embeds_tensor(value: Any, shape: str = "[feature_size, hidden_size]",
                        what: str = "") -> torch.Tensor:
    """`value` as image embeddings, or a ValueError naming what it is instead: they must be
    a floating-point tensor (a uint8 one would be taken for pixels). `shape` is the form the
    caller takes, `what` prefixes the message (which request part)."""
    if not is_image_embeds(value):
        got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        prefix = f"{what}: " if what else ""
        raise ValueError(f"{prefix}image_embeds must be a floating-point tensor {shape}, "
                         f"got {got}.")
    return value


def split_image_embeds(item: Any) -> list[Any]:
    """One `multi_modal_data` image entry as images: embeddings [num_images, feature_size,
    hidden_size] are num_images of them (vLLM's form; also as `{"image_embeds": ...}`),
    anything else is one. A grid (`image_grid_thw`, Qwen2-VL's) is refused: these models'
    images all have one size."""
    if isinstance(item, dict):
        extra = sorted(k for k in item if k != "image_embeds")
        if extra:
            raise ValueError(f"image_embeds takes no {extra[0]!r} for this model: send the "
                             "embeddings alone.")
        item = image_embeds_tensor(item.get("image_embeds"))
    if is_image_embeds(item) and item.dim() == 3:
        return list(item.unbind(0))
    if is_image_embeds(item) and item.dim() != 2:
        raise ValueError("image_embeds must be [feature_size, hidden_size] or [num_images, "
                         f"feature_size, hidden_size], got shape {tuple(item.shape)}.")
    return [item]


def tensor_hash(tag: bytes, tensor: torch.Tensor, extra: bytes = b"") -> bytes:
    """An image's key (tag P: preprocessed pixels, the encoder cache's key, so an image
    sent as a PIL image, an array or file bytes hashes alike when it decodes alike; E: the
    user's embeddings, never cached), with `extra` (Qwen2-VL's embeddings: their grid)."""
    h = hashlib.sha256(tag + str((tensor.dtype, tuple(tensor.shape))).encode() + extra)
    h.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()
