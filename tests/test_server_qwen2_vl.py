"""`/v1/chat/completions` on a tiny Qwen2-VL through the openai client: `image_url` data:
URLs of two resolutions, the reply equal to transformers' greedy tokens; `image_embeds`
parts (transformers' vision tower output with each image's grid, vLLM's form) give the
image_url reply; a bad grid is a 400 naming it, and the server answers on."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.llava_reference import (
    MAX_TOKENS,
    chat_messages,
    data_url,
    embeds_part,
    random_image,
    served_chat,
)
from tests.qwen2_vl_reference import hf_chat_greedy, hf_image_embeds, load_reference
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


def _embeds_parts(rows: torch.Tensor, grid: torch.Tensor) -> list[dict]:
    """One image_embeds part per image: rows and grid as base64 of torch.save (vLLM's
    form), the second image's grid as a list."""
    parts = []
    for k, (r, g) in enumerate(zip(rows.split((grid.prod(-1) // 4).tolist()), grid,
                                   strict=True)):
        part = embeds_part(r)
        part["image_embeds"] = {"image_embeds": part["image_embeds"], "image_grid_thw":
                                embeds_part(g[None])["image_embeds"] if k == 0 else g.tolist()}
        parts.append(part)
    return parts


def test_image_embeds_reply_equals_the_image_url_reply(server, tiny_qwen2_vl_dir) -> None:
    hf = load_reference(tiny_qwen2_vl_dir)
    images = [random_image(23, (100, 300, 3)), random_image(24, (30, 60, 3))]
    by_url = served_chat(server.url, tiny_qwen2_vl_dir, images)
    messages = chat_messages([])
    messages[0]["content"] += _embeds_parts(*hf_image_embeds(hf, images))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    by_embeds = client.chat.completions.create(
        model=tiny_qwen2_vl_dir, messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    assert by_embeds.usage is not None and by_url.usage is not None
    assert by_embeds.usage.prompt_tokens == by_url.usage.prompt_tokens
    assert by_embeds.choices[0].message.content == by_url.choices[0].message.content
    assert by_url.choices[0].message.content == hf.tokenizer.decode(
        hf_chat_greedy(hf, images)[1], skip_special_tokens=True)


def test_bad_parts_are_400s_and_the_server_answers_on(server, tiny_qwen2_vl_dir) -> None:
    def post(content: list[dict]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "model": tiny_qwen2_vl_dir, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": content}]})

    odd = embeds_part(torch.zeros(6, 64))
    odd["image_embeds"] = {"image_embeds": odd["image_embeds"], "image_grid_thw": [1, 3, 8]}
    bad = post([{"type": "text", "text": "Hi"}, odd])
    assert bad.status_code == 400, bad.text
    assert ("image entry 0: image_grid_thw row 0 is (1, 3, 8): h and w must be multiples of "
            "the merge size 2" in bad.json()["error"]["message"]), bad.text
    empty = post([{"type": "text", "text": "Hi"},
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}])
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"], empty.text
    good = post([{"type": "text", "text": "Hi"},
                 {"type": "image_url", "image_url": {"url": data_url(random_image(3))}}])
    assert good.status_code == 200, good.text
