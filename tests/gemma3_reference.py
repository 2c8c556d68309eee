"""The tiny Gemma 3's reference: transformers' own `Gemma3Processor` (pan-and-scan off) and
`Gemma3ForConditionalGeneration.generate` (greedy; the image positions attend to each other
both ways through the processor's `token_type_ids`)."""

from __future__ import annotations

import numpy as np
import torch

from tests.model_factory import GEMMA3_IMAGE_TOKENS, GEMMA3_TOKENS
from tests.multimodal_family import MAX_TOKENS, hf_generate


def blocky_image(seed: int, cells: int = 4, size: int = 56) -> np.ndarray:
    """A [size, size, 3] uint8 image of cells x cells random colour blocks: its content
    survives the tower's pooling (pixel noise averages out to about the same rows)."""
    colours = np.random.default_rng(seed).integers(0, 256, (cells, cells, 3), dtype=np.uint8)
    return np.kron(colours, np.ones((size // cells, size // cells, 1), dtype=np.uint8))


def load_gemma3_reference(path: str):
    """(Gemma3Processor, Gemma3ForConditionalGeneration) of a tiny Gemma 3 directory."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(path, extra_special_tokens=GEMMA3_TOKENS)
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(path),
                                tokenizer=tokenizer, image_seq_length=GEMMA3_IMAGE_TOKENS)
    model = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return processor, model.eval()


def chat_text(hf, num_images: int) -> str:
    """transformers' rendering of `llava_reference.chat_messages` for Gemma 3: the text and
    each image part as boi, joined by newlines (as the engine renders the parts)."""
    boi = GEMMA3_TOKENS["boi_token"]
    return hf[0].tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n".join(["Compare these."] + [boi] * num_images)}],
        tokenize=False, add_generation_prompt=True)


def gemma3_generate(hf, text: str, images: list[np.ndarray], add_special_tokens: bool = True,
                    max_tokens: int = MAX_TOKENS, bidirectional: bool = True
                    ) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' `generate`; `bidirectional=False` drops
    the processor's `token_type_ids`, so the image positions attend causally."""
    processor, model = hf
    inputs = processor(text=text, images=images or None, return_tensors="pt",
                       add_special_tokens=add_special_tokens)
    if not bidirectional:
        inputs.pop("token_type_ids", None)
    return hf_generate(model, inputs, max_tokens)
