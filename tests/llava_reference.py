"""Tiny LLaVA test helpers: images, data: URLs, chat messages, and transformers' own
processor and model as the reference (greedy tokens with the KV cache)."""

from __future__ import annotations

import base64
import io

import numpy as np
import torch
from PIL import Image

from tests.model_factory import TINY_PATCH_SIZE

MAX_TOKENS = 8


def random_image(seed: int, shape: tuple[int, int, int] = (40, 52, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def data_url(array: np.ndarray) -> str:
    png = io.BytesIO()
    Image.fromarray(array).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def load_reference(path: str, strategy: str = "default"):
    """(LlavaProcessor, LlavaForConditionalGeneration) of a tiny LLaVA directory."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessorPil,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil.from_pretrained(path),
        tokenizer=AutoTokenizer.from_pretrained(path), patch_size=TINY_PATCH_SIZE,
        vision_feature_select_strategy=strategy, image_token="<image>",
        num_additional_image_tokens=1)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return processor, model.eval()


@torch.inference_mode()
def hf_greedy(hf, text: str, images: list[np.ndarray], add_special_tokens: bool = True,
              max_tokens: int = MAX_TOKENS) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) from transformers: its processor expands the
    placeholders, its model runs the vision tower and the language model."""
    processor, model = hf
    inputs = processor(text=text, images=images or None, return_tensors="pt",
                       add_special_tokens=add_special_tokens)
    out = model(**inputs, use_cache=True)
    tokens = []
    for _ in range(max_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                    use_cache=True)
    return inputs["input_ids"][0].tolist(), tokens


def chat_messages(images: list[np.ndarray]) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "Compare these."}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts}]


def hf_chat_greedy(hf, images: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """transformers on the conversation its own chat template renders, each image part
    as "<image>" (the text parts and placeholders joined by newlines, as ours)."""
    processor, _ = hf
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n".join(["Compare these."] + ["<image>"] * len(images))}],
        tokenize=False, add_generation_prompt=True)
    return hf_greedy(hf, text, images, add_special_tokens=False)
