"""Gemma 3's image prompts (pan-and-scan off), as transformers' `Gemma3Processor` builds them.

The user writes `<start_of_image>` (boi) where an image goes; each becomes

    "\\n\\n" <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> "\\n\\n"

and the soft tokens' run is the image's rows. transformers replaces the text before it
tokenizes, so newlines next to the image may merge with the inserted ones ("\\n" + "\\n\\n"
is one token "\\n\\n\\n" in Gemma's vocabulary): a text prompt is expanded as text
(`expand_text`, before tokenization; the chat template's image parts are rendered expanded),
and prompt ids with a bare boi (no run after it) get the sequence's ids in its place.

Example (4 rows per image, boi B, soft S, eoi E, "\\n\\n" N): ids [1, 7, B, 9] ->
[1, 7, N, B, S, S, S, S, E, N, 9], is_token [T, T, T, T, F, F, F, F, T, T, T], one image at
offset 4.

Images: resized to the tower's size (bilinear), rescaled and normalised (mean = std = 0.5);
`image.preprocess` with the processor's `preprocessor_config.json` (no crop).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from vllm.config import ModelConfig
from vllm.multimodal.image import ImageProcessorConfig
from vllm.multimodal.processing import (
    ImagePromptProcessor,
    MediaPrompt,
    check_limit,
    media_items,
    split_image_embeds,
)


class Gemma3PromptProcessor(ImagePromptProcessor):
    """Gemma 3's `ImagePromptProcessor`: the placeholder is boi, the run the soft tokens
    inside the sequence above; image embeddings and limits as LLaVA's."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any = None) -> None:
        if tokenizer is None:
            raise ValueError("Gemma 3's image prompts need its tokenizer (skip_tokenizer_init "
                             "is set).")
        super().__init__(model_config)
        config = model_config.hf_config
        self.boi_token_id = int(config.boi_token_index)
        self.eoi_token_id = int(config.eoi_token_index)
        self.newline_ids = list(tokenizer.encode("\n\n", add_special_tokens=False))
        boi, soft, eoi = tokenizer.convert_ids_to_tokens(
            [self.boi_token_id, self.image_token_id, self.eoi_token_id])
        self.boi_text = boi
        self.image_text = f"\n\n{boi}{soft * self.num_image_tokens}{eoi}\n\n"

    def image_run(self, config: Any) -> tuple[int, int]:
        """The soft token and `mm_tokens_per_image`."""
        return int(config.image_token_index), int(config.mm_tokens_per_image)

    def load_image_config(self, path: str) -> ImageProcessorConfig:
        return _image_config(path)

    def expand_text(self, text: str) -> str:
        """Each boi of a text prompt replaced by an image's whole sequence (transformers'
        `Gemma3Processor.full_image_sequence`)."""
        return text.replace(self.boi_text, self.image_text)

    def process(self, token_ids: list[int], data: Any) -> MediaPrompt:
        """`token_ids`: the prompt, each image as its expanded sequence or a bare boi."""
        images = media_items(data, "image", self.model_config.architecture)
        images = [item for image in images for item in split_image_embeds(image)]
        check_limit(len(images), "image", self.limit)
        ids = self._expand_bare_bois(token_ids)
        runs = self._runs(ids, len(images))
        items = [self._image_input(k, image) for k, image in enumerate(images)]
        is_token = torch.ones(len(ids), dtype=torch.bool)
        for item, start in zip(items, runs, strict=True):
            item.offset = start
            is_token[start:start + item.num_tokens] = False
        max_len = self.model_config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"The prompt (length {len(ids)}, with {len(items)} image(s) of "
                             f"{self.num_image_tokens} positions each) is longer than the "
                             f"maximum model length of {max_len}.")
        return MediaPrompt(ids, is_token, items)

    def _expand_bare_bois(self, token_ids: list[int]) -> list[int]:
        """A boi not followed by the soft token becomes the image's sequence of ids."""
        ids: list[int] = []
        for i, token in enumerate(token_ids):
            bare = (token == self.boi_token_id
                    and (i + 1 == len(token_ids) or token_ids[i + 1] != self.image_token_id))
            if not bare:
                ids.append(token)
                continue
            ids += [*self.newline_ids, self.boi_token_id,
                    *[self.image_token_id] * self.num_image_tokens, self.eoi_token_id,
                    *self.newline_ids]
        return ids

    def _runs(self, ids: list[int], count: int) -> list[int]:
        """The start of each run of soft tokens; `count` of them, each an image long."""
        starts = [i for i, t in enumerate(ids)
                  if t == self.image_token_id and (i == 0 or ids[i - 1] != t)]
        if len(starts) != count:
            raise ValueError(f"The prompt has {len(starts)} image placeholder(s) (<start_of"
                             f"_image>, token id {self.boi_token_id}) but {count} image(s) "
                             "were given: put one placeholder where each image goes.")
        for start in starts:
            end = start
            while end < len(ids) and ids[end] == self.image_token_id:
                end += 1
            if end - start != self.num_image_tokens:
                raise ValueError(f"An image's run of soft tokens (token id "
                                 f"{self.image_token_id}) at position {start} is "
                                 f"{end - start} long; Gemma 3 takes "
                                 f"{self.num_image_tokens} per image.")
        return starts


def _image_config(path: str) -> ImageProcessorConfig:
    """The directory's `preprocessor_config.json` (Gemma 3's: a fixed size, no crop)."""
    file = os.path.join(path, "preprocessor_config.json")
    settings: dict[str, Any] = {"size": {"height": 896, "width": 896}, "resample": 2,
                                "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    if os.path.isfile(file):
        with open(file) as f:
            settings.update(json.load(f))
    if settings.get("do_pan_and_scan"):
        raise ValueError("Gemma 3's pan-and-scan (do_pan_and_scan in "
                         "preprocessor_config.json) is not supported: turn it off.")
    return ImageProcessorConfig.from_dict({**settings, "do_center_crop": False})
