"""`/v1/chat/completions` on a tiny Gemma 3 through the openai client: `image_url` parts as
data: URLs; the reply equals transformers' `generate` on its own processor's prompt (each
image's positions attending both ways), its prompt_tokens the processor's length."""

from __future__ import annotations

import pytest

from tests.gemma3_reference import (
    blocky_image,
    chat_text,
    gemma3_generate,
    load_gemma3_reference,
)
from tests.llava_reference import random_image, serve_media_model, served_chat

pytestmark = pytest.mark.slow


def test_image_url_reply_equals_transformers(tiny_gemma3_dir) -> None:
    hf = load_gemma3_reference(tiny_gemma3_dir)
    tokenizer = hf[0].tokenizer
    with serve_media_model(tiny_gemma3_dir, "--max-num-batched-tokens", "20",
                           "--enable-chunked-prefill") as server:
        for images in ([random_image(11), random_image(12)], [blocky_image(31)]):
            reply = served_chat(server.url, tiny_gemma3_dir, images)
            prompt_ids, expected = gemma3_generate(hf, chat_text(hf, len(images)), images,
                                                   add_special_tokens=False)
            assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
            assert reply.choices[0].message.content == tokenizer.decode(
                expected, skip_special_tokens=True)
