"""Tiny Qwen2-VL test helpers: transformers as the reference (its image processor, its
model's `generate`, with `get_rope_index`'s M-RoPE positions).

transformers' `Qwen2VLProcessor` cannot be built without torchvision (its video processor),
so `hf_inputs` does the processor's one step around the image processor itself: each
`<|image_pad|>` repeated grid_t * grid_h * grid_w / merge_size^2 times, and
`mm_token_type_ids` 1 on those positions. Precomputed rows go in as transformers takes
them (`mm_encoder_outputs`, with `image_grid_thw` for the positions)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from tests.multimodal_family import MAX_TOKENS, hf_generate

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


class Reference(NamedTuple):
    image_processor: Any  # Qwen2VLImageProcessorPil
    tokenizer: Any
    model: Any  # Qwen2VLForConditionalGeneration (or 2.5), float32


def load_reference(path: str) -> Reference:
    """Qwen2-VL or Qwen2.5-VL, whichever the directory holds."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return Reference(Qwen2VLImageProcessorPil.from_pretrained(path),
                     AutoTokenizer.from_pretrained(path), model.eval())


def hf_inputs(hf: Reference, text: str, images: list[np.ndarray],
              add_special_tokens: bool = True) -> dict[str, Any]:
    """transformers' model inputs of a prompt with one `<|image_pad|>` per image."""
    inputs: dict[str, Any] = {}
    if images:
        inputs = dict(hf.image_processor(images=images, return_tensors="pt"))
    return {**inputs, **_text_inputs(hf, text, inputs.get("image_grid_thw"),
                                     add_special_tokens)}


def _text_inputs(hf: Reference, text: str, grids: torch.Tensor | None,
                 add_special_tokens: bool = True) -> dict[str, torch.Tensor]:
    """The ids of `text` with its k-th `<|image_pad|>` repeated for `grids[k]` (t * h * w /
    merge_size^2 times), the attention mask and `mm_token_type_ids` (1 on image rows)."""
    if grids is not None:
        merge = hf.image_processor.merge_size
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(grids) + 1
        text = pieces[0] + "".join(
            "<|image_pad|>" * (int(grid.prod()) // merge**2) + piece
            for grid, piece in zip(grids, pieces[1:], strict=True))
    ids = hf.tokenizer(text, return_tensors="pt",
                       add_special_tokens=add_special_tokens)["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == hf.model.config.image_token_id).int()}


@torch.inference_mode()
def hf_image_embeds(hf: Reference, images: list[np.ndarray]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' vision tower output of `images` and their grids: (rows [sum of the
    images' rows, hidden_size], image_grid_thw [num_images, 3]), what a user who runs the
    tower elsewhere sends as image_embeds."""
    inputs = hf.image_processor(images=images, return_tensors="pt")
    rows = hf.model.model.get_image_features(inputs["pixel_values"],
                                             inputs["image_grid_thw"]).pooler_output
    return torch.cat(list(rows)), inputs["image_grid_thw"]


def hf_embeds_greedy(hf: Reference, text: str, rows: torch.Tensor, grids: torch.Tensor,
                     max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' `generate` given the vision tower's
    output (`mm_encoder_outputs`, transformers' own form of precomputed rows) with its
    grids: the positions follow `grids` whatever tower made the rows."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    sizes = (grids.prod(-1) // hf.image_processor.merge_size**2).tolist()
    inputs = {**_text_inputs(hf, text, grids), "image_grid_thw": grids,
              "mm_encoder_outputs": {"image": BaseModelOutputWithPooling(
                  pooler_output=rows.split(sizes))}}
    return hf_generate(hf.model, inputs, max_tokens)


def hf_greedy(hf: Reference, text: str, images: list[np.ndarray],
              add_special_tokens: bool = True, max_tokens: int = MAX_TOKENS
              ) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' `generate`."""
    return hf_generate(hf.model, hf_inputs(hf, text, images, add_special_tokens), max_tokens)


def hf_chat_greedy(hf: Reference, images: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """transformers on the conversation the tokenizer's chat template renders, each image
    part as `IMAGE` (the text and placeholders joined by newlines, as `llava_reference`'s
    `chat_messages` renders in the engine)."""
    text = hf.tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n".join(["Compare these."] + [IMAGE] * len(images))}],
        tokenize=False, add_generation_prompt=True)
    return hf_greedy(hf, text, images, add_special_tokens=False)
