"""`/v1/chat/completions` with `image_url` data: URLs on a tiny LLaVA, through the openai
client: the reply equals transformers' greedy tokens; bad images and URLs are 400s naming
the problem, and the server answers after them."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.llava_reference import (
    MAX_TOKENS,
    chat_messages,
    data_url,
    hf_chat_greedy,
    load_reference,
    random_image,
)
from tests.model_factory import make_tiny_llava
from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava_served")))


@pytest.fixture(scope="module")
def server(llava_dir):
    srv = RemoteServer(llava_dir, [*SMALL_ENGINE_ARGS, "--limit-mm-per-prompt",
                                   '{"image": 2}'])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def hf(llava_dir):
    return load_reference(llava_dir)


def _post(server, model: str, messages: list[dict]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "messages": messages})


def test_image_url_reply_equals_transformers(server, llava_dir, hf) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    images = [random_image(21), random_image(22, (30, 60, 3))]
    reply = client.chat.completions.create(
        model=llava_dir, messages=chat_messages(images),  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    prompt_ids, expected = hf_chat_greedy(hf, images)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt_ids)
    tokenizer = hf[0].tokenizer
    assert reply.choices[0].message.content == tokenizer.decode(expected,
                                                                skip_special_tokens=True)


def test_bad_images_are_400s_and_the_server_answers_on(server, llava_dir) -> None:
    def part(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    text = {"type": "text", "text": "Hi"}
    bad = {
        "Remote image URLs are not fetched": [text, part("https://example.com/a.png")],
        "not valid base64": [text, part("data:image/png;base64,@@@")],
        "not an image": [text, part("data:image/png;base64,aGVsbG8=")],
        "At most 2 image(s)": [text] + [part(data_url(random_image(1)))] * 3,
    }
    for message, content in bad.items():
        r = _post(server, llava_dir, [{"role": "user", "content": content}])
        assert r.status_code == 400, (message, r.text)
        assert message in r.json()["error"]["message"], (message, r.text)
    ok = _post(server, llava_dir, chat_messages([random_image(23)]))
    assert ok.status_code == 200, ok.text
