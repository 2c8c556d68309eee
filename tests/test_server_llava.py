"""`/v1/chat/completions` on a tiny LLaVA, through the openai client: `image_url` parts
(data: URLs, files under --allowed-local-media-path, URLs of --allowed-media-domains served
by a local HTTP server) and `image_embeds` parts (--enable-mm-embeds); replies equal
transformers' greedy tokens; bad images, URLs and embeddings are 400s naming the problem,
and the server answers after them."""

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
    hf_chat_greedy,
    hf_image_embeds,
    load_reference,
    random_image,
    save_png,
    serve_directory,
    serve_media_model,
    served_chat,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("served_media"))


@pytest.fixture(scope="module")
def server(tiny_llava_dir, media_dir):
    with serve_media_model(tiny_llava_dir, "--enable-mm-embeds", "--allowed-local-media-path",
                           media_dir, "--allowed-media-domains", "127.0.0.1") as srv:
        yield srv


@pytest.fixture(scope="module")
def hf(tiny_llava_dir):
    return load_reference(tiny_llava_dir)


def _post(server, model: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "messages": messages})


def test_image_url_reply_equals_transformers(server, tiny_llava_dir, hf) -> None:
    images = [random_image(21), random_image(22, (30, 60, 3))]
    reply = served_chat(server.url, tiny_llava_dir, images)
    prompt_ids, expected = hf_chat_greedy(hf, images)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    tokenizer = hf[0].tokenizer
    assert reply.choices[0].message.content == tokenizer.decode(expected,
                                                                skip_special_tokens=True)


def test_files_urls_and_embeds_equal_transformers(server, tiny_llava_dir, media_dir, hf) -> None:
    """One image as a file under the allowed path, one fetched from an allowed host, then
    the same two as transformers' own rows in image_embeds parts: one reply."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    images = [random_image(24), random_image(25, (44, 30, 3))]
    save_png(images[0], f"{media_dir}/a.png")
    save_png(images[1], f"{media_dir}/b.png")
    rows = hf_image_embeds(hf, images)
    _, expected = hf_chat_greedy(hf, images)
    text = hf[0].tokenizer.decode(expected, skip_special_tokens=True)
    with serve_directory(media_dir) as host:
        for parts in ([{"type": "image_url", "image_url": {"url": f"file://{media_dir}/a.png"}},
                       {"type": "image_url", "image_url": {"url": f"{host}/b.png"}}],
                      [embeds_part(rows[0]), embeds_part(rows[1])]):
            messages = chat_messages([])
            messages[0]["content"] += parts
            reply = client.chat.completions.create(
                model=tiny_llava_dir, messages=messages,  # type: ignore[arg-type]
                max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
            assert reply.choices[0].message.content == text


def test_bad_images_are_400s_and_the_server_answers_on(server, tiny_llava_dir, media_dir) -> None:
    def part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    text = {"type": "text", "text": "Hi"}
    with open(f"{media_dir}/../outside.png", "wb") as f:
        f.write(b"secret")
    with serve_directory(media_dir) as host:
        bad = {
            "host 'example.com' is not in the allowed media domains":
                [text, part("https://example.com/a.png")],
            "HTTP 404": [text, part(f"{host}/missing.png")],
            "outside the allowed local media path":
                [text, part(f"file://{media_dir}/../outside.png")],
            "not valid base64": [text, part("data:image/png;base64,@@@")],
            "not an image": [text, part("data:image/png;base64,aGVsbG8=")],
            "At most 2 image(s)": [text] + [part(data_url(random_image(1)))] * 3,
            "image_embeds item 0 has shape (3, 64), but one image of "
            "LlavaForConditionalGeneration is (16, 64)":
                [text, embeds_part(torch.zeros(3, 64))],
            "image_embeds must be a floating-point tensor":
                [text, embeds_part(torch.zeros(16, 64, dtype=torch.int32))],
            "image_embeds is not valid base64": [text, {"type": "image_embeds",
                                                        "image_embeds": "@@"}],
            "image_embeds takes no 'image_grid_thw' for this model": [text, {
                "type": "image_embeds", "image_embeds": {
                    "image_embeds": embeds_part(torch.zeros(16, 64))["image_embeds"],
                    "image_grid_thw": [1, 8, 8]}}],
            "'uuid' on media parts is not supported":
                [text, {**part(data_url(random_image(1))), "uuid": "cat"}],
        }
        for message, content in bad.items():
            r = _post(server, tiny_llava_dir, [{"role": "user", "content": content}])
            assert r.status_code == 400, (message, r.text)
            assert message in r.json()["error"]["message"], (message, r.text)
    ok = _post(server, tiny_llava_dir, chat_messages([random_image(23)]))
    assert ok.status_code == 200, ok.text
