"""`vllm serve` under failure and abuse: a request the engine fails on, client-supplied
templates, cache salts, the prompt-embeds bytes cap, reused request ids, and an API process
killed in the middle of a full batch.

One server for most tests (tiny random Llama, prompt embeds on, the runner's failure hook
armed for prompts holding token MARK, dev-mode `/server_info`); the kill test starts its own.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.server_utils import (
    SMALL_ENGINE_ARGS,
    RemoteServer,
    encode_tensor,
    process_gone,
    requests_running,
    rss_bytes,
)

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

MARK = 7
HIDDEN = 64
EMBEDS_CAP = 256 * 1024
# 400 rows of float32: ~100 KiB decoded, so about two such requests fit under the cap.
BIG_EMBEDS = encode_tensor(torch.randn(400, HIDDEN, generator=torch.Generator().manual_seed(0)))
# Prompts of 40 token ids (two full blocks of 16), none of them MARK.
GOOD = [[(13 * i + 5 * j) % 90 + 10 for j in range(40)] for i in range(3)]
BAD = [10, 20, MARK, 30] * 5


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str):
    srv = RemoteServer(tiny_llama_dir,
                       ["--enable-prompt-embeds", "--max-prompt-embeds-bytes-in-flight",
                        str(EMBEDS_CAP), *SMALL_ENGINE_ARGS],
                       env={"VLLM_TEST_FAIL_ON_TOKEN_ID": str(MARK),
                            "VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def complete(server: RemoteServer, prompt: list[int] | str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": 6, "temperature": 0.0,
                            "ignore_eos": True, **body})


def server_info(server: RemoteServer) -> dict:
    return httpx.get(f"{server.url}/server_info", timeout=10).json()


# ---- one bad request ----------------------------------------------------------------


def test_failed_request_does_not_take_others_down(server: RemoteServer) -> None:
    # Expected tokens, computed alone and salted so the batch below shares no blocks.
    expected = [complete(server, p, cache_salt="reference").json()["choices"][0]["text"]
                for p in GOOD]

    async def batch() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
                      for p in (GOOD[0], BAD, GOOD[1], GOOD[2])]
            return await asyncio.gather(*[http.post("/v1/completions", json=b)
                                          for b in bodies])

    responses = asyncio.run(batch())
    assert [r.status_code for r in responses] == [200, 500, 200, 200]
    error = responses[1].json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "engine failed" in error["message"]
    assert [r.json()["choices"][0]["text"] for r in responses[::2]] == expected[:2]
    assert responses[3].json()["choices"][0]["text"] == expected[2]
    # A stream that fails ends with the OpenAI error event.
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": BAD, "max_tokens": 4, "stream": True}) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert '"code":500' in events[-2] and events[-1] == "data: [DONE]"
    assert httpx.get(f"{server.url}/health").status_code == 200
    fresh = complete(server, GOOD[1], cache_salt="reference")
    assert fresh.json()["choices"][0]["text"] == expected[1]
    info = server_info(server)
    assert "engines" in info, info
    engine = info["engines"][0]
    assert engine["num_requests"] == 0 and engine["num_runner_requests"] == 0


# ---- templates ------------------------------------------------------------------------


def test_template_in_kwargs_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}})
    assert "chat_template is not allowed in chat_template_kwargs" in str(info.value)


def test_request_template_needs_trust(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id, max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
    assert "--trust-request-chat-template" in str(info.value)


def test_trusted_request_template_and_output_bound(tiny_llama_dir: str) -> None:
    """Behind the trust flag a request's template is used; rendering off the event loop
    refuses output longer than could fit the context (no server needed)."""
    from types import SimpleNamespace

    from vllm import EngineArgs
    from vllm.entrypoints.errors import OpenAIError
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.serving_engine import ServingOptions
    from vllm.transformers_utils.tokenizer import get_tokenizer

    config = EngineArgs(model=tiny_llama_dir, max_model_len=64).create_engine_config()
    engine = SimpleNamespace(vllm_config=config, tokenizer=get_tokenizer(tiny_llama_dir))
    chat = OpenAIServingChat(engine, ["m"], ServingOptions(trust_request_chat_template=True))
    messages = [{"role": "user", "content": "hi"}]
    template = "[{% for m in messages %}{{ m.content }}{% endfor %}]"
    request = ChatCompletionRequest(messages=messages, chat_template=template)
    assert asyncio.run(chat.render(request)) == "[hi]"
    huge = ChatCompletionRequest(messages=messages,
                                 chat_template="{% for i in range(9999) %}0123456789{% endfor %}")
    with pytest.raises(OpenAIError, match="rendered 99990 characters, more than the 4096"):
        asyncio.run(chat.render(huge))
    untrusted = OpenAIServingChat(engine, ["m"], ServingOptions())
    with pytest.raises(OpenAIError, match="--trust-request-chat-template"):
        asyncio.run(untrusted.render(request))


# ---- tenant isolation ---------------------------------------------------------------------


def test_cache_salt_separates_tenants(server: RemoteServer, client: openai.OpenAI) -> None:
    prompt = [(7 * j) % 80 + 12 for j in range(40)]

    def cached(salt: str | None) -> int:
        body = {"cache_salt": salt} if salt else {}
        usage = complete(server, prompt, max_tokens=1, **body).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, another salt: no hit
    assert cached(None) == 0  # no salt is a salt of its own
    assert cached("tenant-a") == 32  # same salt: both full blocks hit
    # Dev mode's /reset_prefix_cache forgets them (vLLM's route).
    assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=10).status_code == 200
    assert cached("tenant-a") == 0
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=1,
        messages=[{"role": "user", "content": "x " * 40}], extra_body={"cache_salt": "c"})
    again = client.chat.completions.create(
        model=client.models.list().data[0].id, max_tokens=1,
        messages=[{"role": "user", "content": "x " * 40}], extra_body={"cache_salt": "c"})
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


# ---- bounded memory ---------------------------------------------------------------------


def test_embeds_bytes_in_flight_are_capped(server: RemoteServer) -> None:
    body = {"prompt": "", "prompt_embeds": BIG_EMBEDS, "max_tokens": 2}
    embeds_body = {"prompt_embeds": BIG_EMBEDS, "max_tokens": 2}
    assert complete(server, "", **embeds_body).status_code == 200  # warm-up
    rss_before = rss_bytes(server.proc.pid)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=body)
                                          for _ in range(32)])

    for _ in range(3):
        responses = asyncio.run(burst())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
        refused = next(r for r in responses if r.status_code == 503)
        assert refused.headers["retry-after"] == "1"
        assert "--max-prompt-embeds-bytes-in-flight" in refused.json()["error"]["message"]
    assert server_info(server)["prompt_embeds_bytes_in_flight"] == 0
    assert rss_bytes(server.proc.pid) - rss_before < 64 * 2**20
    assert complete(server, "", **embeds_body).status_code == 200  # service resumes


def test_prompt_logprobs_with_embeds_wording(server: RemoteServer) -> None:
    response = complete(server, "", prompt_embeds=encode_tensor(torch.randn(3, HIDDEN)),
                        prompt_logprobs=1)
    assert response.status_code == 400
    assert "not compatible with prompt embeds" in response.json()["error"]["message"]


# ---- request ids ------------------------------------------------------------------------


def test_duplicate_live_request_id_refused(server: RemoteServer) -> None:
    first: dict[str, httpx.Response] = {}
    started = threading.Event()

    def long_stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"prompt": GOOD[0], "max_tokens": 300, "ignore_eos": True,
                                "stream": True, "request_id": "dup"}) as stream:
            lines = stream.iter_lines()
            next(lines)
            started.set()
            first["lines"] = [line for line in lines if line]

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(60)
    duplicate = complete(server, GOOD[1], request_id="dup")
    thread.join(60)
    assert duplicate.status_code == 400 and "already in use" in duplicate.text
    assert first["lines"][-1] == "data: [DONE]"
    reused = complete(server, GOOD[1], request_id="dup")  # the first one has finished
    assert reused.status_code == 200 and reused.json()["id"] == "cmpl-dup"


# ---- no orphan engine ---------------------------------------------------------------------


def test_engine_exits_when_api_process_is_killed(tiny_llama_dir: str) -> None:
    """SIGKILL the API process while 16 long requests (n=8: 128 sequences) run: the engine
    core, busy with a full batch, is gone within 10 s (it used to run the queued work to
    the end, then block forever sending to the dead peer)."""
    srv = RemoteServer(tiny_llama_dir, ["--dtype", "float32", "--max-model-len", "1024",
                                        "--kv-cache-memory-bytes", "256MiB", "--seed", "0",
                                        "--enforce-eager"])
    try:
        (engine_pid,) = srv.engine_core_pids()

        def long_request() -> None:
            try:
                httpx.post(f"{srv.url}/v1/completions", timeout=120,
                           json={"prompt": "hi", "max_tokens": 1000, "n": 8,
                                 "ignore_eos": True})
            except httpx.HTTPError:
                pass  # the server is killed under it

        threads = [threading.Thread(target=long_request, daemon=True) for _ in range(16)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and requests_running(srv) < 128:
            time.sleep(0.1)
        assert requests_running(srv) == 128
        os.kill(srv.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not process_gone(engine_pid) and time.monotonic() - killed_at < 10:
            time.sleep(0.1)
        assert process_gone(engine_pid), "the engine core outlived its API process"
    finally:
        srv.stop()
        if not process_gone(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
