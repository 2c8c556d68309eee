"""`vllm serve` with an API key, a served model name and prompt embeds off; and a server of
its own whose engine process is killed, which must report it."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server_utils import (
    SMALL_ENGINE_ARGS,
    RemoteServer,
    encode_tensor,
    requests_running,
)

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

API_KEY = "test-secret"
NAME = "tiny-qwen"


def _server(path: str):
    srv = RemoteServer(path, ["--api-key", API_KEY, "--served-model-name", NAME,
                              "--no-enable-prefix-caching", *SMALL_ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0, srv.final_log  # clean exit even with the engine dead


def _client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def server(tiny_qwen2_dir: str):
    yield from _server(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return _client(server)


@pytest.fixture
def doomed_server(tiny_qwen2_dir: str):
    """A server of the one test that kills its engine (the module's stays alive for the
    others, whatever order they run in)."""
    yield from _server(tiny_qwen2_dir)


def test_api_key_required_on_v1(server: RemoteServer, client: openai.OpenAI) -> None:
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert info.value.status_code == 401
    response = httpx.get(f"{server.url}/v1/models")
    assert response.status_code == 401 and response.json()["error"]["code"] == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # not behind the key
    assert [m.id for m in client.models.list().data] == [NAME]
    out = client.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0.0)
    assert out.usage.completion_tokens == 3


def test_served_model_name(client: openai.OpenAI, tiny_qwen2_dir: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=tiny_qwen2_dir, prompt="hi", max_tokens=2)
    out = client.chat.completions.create(model=NAME, max_tokens=3,
                                         messages=[{"role": "user", "content": "hi"}])
    assert out.model == NAME


def test_prompt_embeds_flag_off_is_400(client: openai.OpenAI) -> None:
    import torch

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=None, max_tokens=2,
                                  extra_body={"prompt_embeds": encode_tensor(torch.randn(3, 64))})
    assert "--enable-prompt-embeds" in str(info.value)


def test_engine_death_is_reported(doomed_server: RemoteServer) -> None:
    """Kill the engine-core process: the request in flight and later ones fail with 500
    instead of hanging, and /health turns non-200."""
    server, client = doomed_server, _client(doomed_server)
    pids = server.engine_core_pids()
    assert len(pids) == 1
    in_flight: dict[str, object] = {}

    def long_request() -> None:
        in_flight["response"] = httpx.post(
            f"{server.url}/v1/completions", timeout=60,
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": NAME, "prompt": "hi", "max_tokens": 496, "n": 8,
                  "ignore_eos": True})

    thread = threading.Thread(target=long_request)
    thread.start()
    for _ in range(200):  # bounded: until the request is running (at most ~10 s)
        if requests_running(server) > 0:
            break
        time.sleep(0.05)
    os.kill(pids[0], signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive()
    assert in_flight["response"].status_code == 500
    assert "engine" in in_flight["response"].json()["error"]["message"].lower()
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert info.value.status_code == 500
    with pytest.raises(openai.InternalServerError):
        list(client.completions.create(model=NAME, prompt="hi", max_tokens=2, stream=True))
