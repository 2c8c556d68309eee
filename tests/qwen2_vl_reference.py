"""Tiny Qwen2-VL test helpers: transformers as the reference (its image processor, its
model's `generate`, with `get_rope_index`'s M-RoPE positions).

transformers' `Qwen2VLProcessor` cannot be built without torchvision (its video processor),
so `hf_inputs` does the processor's one step around the image processor itself: each
`<|image_pad|>` repeated grid_t * grid_h * grid_w / merge_size^2 times, and
`mm_token_type_ids` 1 on those positions."""

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
              add_special_tokens: bool = True) -> dict[str, torch.Tensor]:
    """transformers' model inputs of a prompt with one `<|image_pad|>` per image."""
    inputs: dict[str, torch.Tensor] = {}
    if images:
        inputs = dict(hf.image_processor(images=images, return_tensors="pt"))
        merge = hf.image_processor.merge_size
        pieces = text.split("<|image_pad|>")
        assert len(pieces) == len(images) + 1
        text = pieces[0] + "".join(
            "<|image_pad|>" * (int(grid.prod()) // merge**2) + piece
            for grid, piece in zip(inputs["image_grid_thw"], pieces[1:], strict=True))
    ids = hf.tokenizer(text, return_tensors="pt",
                       add_special_tokens=add_special_tokens)["input_ids"]
    inputs["input_ids"] = ids
    inputs["attention_mask"] = torch.ones_like(ids)
    inputs["mm_token_type_ids"] = (ids == hf.model.config.image_token_id).int()
    return inputs


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
