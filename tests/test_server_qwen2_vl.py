"""`/v1/chat/completions` on a tiny Qwen2-VL through the openai client: `image_url` data:
URLs of two resolutions, the reply equal to transformers' greedy tokens; image embeddings
without their grid (for the M-RoPE positions) are a 400 naming why."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.llava_reference import (
    MAX_TOKENS,
    data_url,
    embeds_part,
    random_image,
    served_chat,
)
from tests.qwen2_vl_reference import hf_chat_greedy, load_reference
from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl_dir):
    srv = RemoteServer(tiny_qwen2_vl_dir, [*SMALL_ENGINE_ARGS, "--enable-mm-embeds"])
    try:
        yield srv
    finally:
        srv.stop()


def test_image_url_reply_equals_transformers(server, tiny_qwen2_vl_dir) -> None:
    hf = load_reference(tiny_qwen2_vl_dir)
    images = [random_image(21, (100, 300, 3)), random_image(22, (30, 60, 3))]
    reply = served_chat(server.url, tiny_qwen2_vl_dir, images)
    prompt_ids, expected = hf_chat_greedy(hf, images)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].message.content == hf.tokenizer.decode(expected,
                                                                   skip_special_tokens=True)


def test_image_embeds_are_a_400_and_the_server_answers_on(server, tiny_qwen2_vl_dir) -> None:
    def post(content: list[dict]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": tiny_qwen2_vl_dir, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": content}]})

    bad = post([{"type": "text", "text": "Hi"}, embeds_part(torch.zeros(6, 64))])
    assert bad.status_code == 400, bad.text
    assert ("image_embeds for Qwen2VLForConditionalGeneration need each image's grid"
            in bad.json()["error"]["message"])
    empty = post([{"type": "text", "text": "Hi"},
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}])
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"], empty.text
    good = post([{"type": "text", "text": "Hi"},
                 {"type": "image_url", "image_url": {"url": data_url(random_image(3))}}])
    assert good.status_code == 200, good.text
