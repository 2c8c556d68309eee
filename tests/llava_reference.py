"""Tiny LLaVA test helpers: images, data: URLs, chat messages (offline and through a served
model's openai client), and transformers' own processor and model as the reference (greedy
tokens with the KV cache)."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.model_factory import TINY_PATCH_SIZE
from tests.multimodal_family import MAX_TOKENS


def random_image(seed: int, shape: tuple[int, int, int] = (40, 52, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def data_url(array: np.ndarray) -> str:
    png = io.BytesIO()
    Image.fromarray(array).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def load_reference(path: str, strategy: str = "default", class_token: bool = True):
    """(LlavaProcessor, LlavaForConditionalGeneration) of a tiny LLaVA directory (a SigLIP
    tower: `class_token=False`)."""
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
        num_additional_image_tokens=int(class_token))
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


@contextlib.contextmanager
def serve_media_model(model_dir: str, *args: str) -> Iterator[Any]:
    """`vllm serve` of a tiny multimodal model (the small engine's args, two images a
    prompt, then `args`), stopped on exit: the served tests' one setup."""
    from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer

    server = RemoteServer(model_dir, [*SMALL_ENGINE_ARGS, "--limit-mm-per-prompt",
                                      '{"image": 2}', *args])
    try:
        yield server
    finally:
        server.stop()


def chat_messages(images: list[np.ndarray]) -> list[dict]:
    parts: list[dict] = [{"type": "text", "text": "Compare these."}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts}]


def served_chat(server_url: str, model: str, images: list[np.ndarray]) -> Any:
    """The openai client's greedy chat completion (`MAX_TOKENS`, EOS ignored) of
    `chat_messages(images)`: the image parts as data: URLs."""
    import openai

    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none")
    return client.chat.completions.create(
        model=model, messages=chat_messages(images),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})


def hf_chat_greedy(hf, images: list[np.ndarray]) -> tuple[list[int], list[int]]:
    """transformers on the conversation its own chat template renders, each image part
    as "<image>" (the text parts and placeholders joined by newlines, as ours)."""
    processor, _ = hf
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": "\n".join(["Compare these."] + ["<image>"] * len(images))}],
        tokenize=False, add_generation_prompt=True)
    return hf_greedy(hf, text, images, add_special_tokens=False)


@torch.inference_mode()
def hf_image_embeds(hf, images: list[np.ndarray]) -> torch.Tensor:
    """transformers' rows of each image (vision tower + projector): [n, feature_size,
    hidden_size], what a user who runs the tower elsewhere sends as image_embeds."""
    processor, model = hf
    pixels = processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    return torch.stack(list(model.get_image_features(pixel_values=pixels).pooler_output))


def embeds_part(tensor: torch.Tensor) -> dict:
    """An image_embeds content part: base64 of torch.save(tensor), as vLLM takes it."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return {"type": "image_embeds", "image_embeds": base64.b64encode(buffer.getvalue()).decode()}


def save_png(array: np.ndarray, path: str) -> str:
    Image.fromarray(array).save(path, format="PNG")
    return path


@contextlib.contextmanager
def serve_directory(directory: str) -> Iterator[str]:
    """A local HTTP server of `directory`'s files, in a thread: its base URL
    ("http://127.0.0.1:PORT"); the stand-in for remote image hosts (no internet here)."""
    handler = functools.partial(_QuietHandler, directory=directory)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass
