"""`vllm serve` end to end with the official `openai` client, against offline `LLM` results.

One server per module (tiny random Llama, prompt embeds on); an offline `LLM` with the same
engine settings gives the expected tokens.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import GRAPHS_ENGINE_ARGS, RemoteServer, encode_tensor
from vllm import LLM, SamplingParams

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

HIDDEN = 64  # tests/model_factory.py tiny configs
MAX_MODEL_LEN = 512
TEXTS = ["The quick brown fox", "Once upon a time there was", "What is the capital of France?",
         "def greet(name):"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str):
    srv = RemoteServer(tiny_llama_dir, ["--enable-prompt-embeds", *GRAPHS_ENGINE_ARGS])
    yield srv
    engine_pids = srv.engine_core_pids()
    assert srv.stop() == 0, srv.final_log
    for pid in engine_pids:  # the engine process went down with the server
        assert not os.path.exists(f"/proc/{pid}") or "spawn_main" not in open(
            f"/proc/{pid}/cmdline").read()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, enable_prompt_embeds=True, dtype="float32",
               kv_cache_memory_bytes=64 * 1024**2, max_model_len=MAX_MODEL_LEN, seed=0)


@pytest.fixture(scope="module")
def client(server: RemoteServer, tiny_llama_dir: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def embeds(seed: int, num_tokens: int = 7, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def offline_texts(offline: LLM, prompts: list, params: SamplingParams) -> list[str]:
    return [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]


# ---- basic endpoints ------------------------------------------------------------------


def test_models_version_health(server: RemoteServer, client: openai.OpenAI,
                               tiny_llama_dir: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_llama_dir]
    assert httpx.get(f"{server.url}/health").status_code == 200
    version = httpx.get(f"{server.url}/version").json()["version"]
    import vllm

    assert version == vllm.__version__


def test_completion_text_and_token_ids_match_offline(client, offline, tiny_llama_dir) -> None:
    text = client.completions.create(model=tiny_llama_dir, prompt=TEXTS[0], max_tokens=12,
                                     temperature=0.0)
    expected = offline.generate(TEXTS[0], greedy(), use_tqdm=False)[0]
    assert text.choices[0].text == expected.outputs[0].text
    assert text.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert text.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert text.usage.completion_tokens == len(expected.outputs[0].token_ids)

    ids = expected.prompt_token_ids
    by_ids = client.completions.create(model=tiny_llama_dir, prompt=ids, max_tokens=12,
                                       temperature=0.0)
    assert by_ids.choices[0].text == expected.outputs[0].text


def test_completion_embeds_match_offline(client, offline, tiny_llama_dir) -> None:
    tensor = embeds(1)
    expected = offline_texts(offline, [{"prompt_embeds": tensor}], greedy())[0]
    for sent in (tensor, tensor.unsqueeze(0)):  # a leading dimension of 1 is squeezed
        out = client.completions.create(model=tiny_llama_dir, prompt=None, max_tokens=12,
                                        temperature=0.0,
                                        extra_body={"prompt_embeds": encode_tensor(sent)})
        assert out.choices[0].text == expected
        assert out.usage.prompt_tokens == tensor.shape[0]
    sparse = tensor.to_sparse()  # a valid sparse tensor is densified (within the cap)
    out = client.completions.create(model=tiny_llama_dir, prompt=None, max_tokens=12,
                                    temperature=0.0,
                                    extra_body={"prompt_embeds": encode_tensor(sparse)})
    assert out.choices[0].text == expected
    # vLLM's convention with the openai client: prompt="" means "embeds only".
    out = client.completions.create(model=tiny_llama_dir, prompt="", max_tokens=12,
                                    temperature=0.0,
                                    extra_body={"prompt_embeds": encode_tensor(tensor)})
    assert [c.text for c in out.choices] == [expected]
    bf16 = embeds(2, dtype=torch.bfloat16)  # cast to the model dtype, as offline
    out = client.completions.create(model=tiny_llama_dir, prompt=None, max_tokens=12,
                                    temperature=0.0,
                                    extra_body={"prompt_embeds": encode_tensor(bf16)})
    assert out.choices[0].text == offline_texts(offline, [{"prompt_embeds": bf16}], greedy())[0]


def test_batched_mixed_prompts_order(client, offline, tiny_llama_dir) -> None:
    tensors = [embeds(3), embeds(4, num_tokens=11)]
    out = client.completions.create(
        model=tiny_llama_dir, prompt=TEXTS[1:3], max_tokens=10, temperature=0.0,
        extra_body={"prompt_embeds": [encode_tensor(t) for t in tensors]})
    expected = offline_texts(offline, [{"prompt_embeds": t} for t in tensors] + TEXTS[1:3],
                             greedy(10))
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == expected  # embeds prompts first
    assert out.usage.prompt_tokens == 7 + 11 + sum(
        len(offline.get_tokenizer().encode(t)) for t in TEXTS[1:3])


def test_n_with_seed_matches_offline(client, offline, tiny_llama_dir) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    expected = [c.text for c in offline.generate(TEXTS[3], params, use_tqdm=False)[0].outputs]
    out = client.completions.create(model=tiny_llama_dir, prompt=TEXTS[3], n=3, seed=7,
                                    temperature=1.0, max_tokens=8)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected


def test_streamed_n_over_two_prompts(client, offline, tiny_llama_dir) -> None:
    """Choice index = prompt index * n + sample index; streamed deltas rebuild each text."""
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6)
    expected = [c.text for o in offline.generate(TEXTS[:2], params, use_tqdm=False)
                for c in o.outputs]
    chunks = list(client.completions.create(model=tiny_llama_dir, prompt=TEXTS[:2], n=2,
                                            seed=3, temperature=1.0, max_tokens=6,
                                            stream=True))
    texts = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == expected
    chat = list(client.chat.completions.create(
        model=tiny_llama_dir, messages=[{"role": "user", "content": "hi"}], n=2, seed=3,
        temperature=1.0, max_tokens=6, stream=True))
    finished = [c.choices[0].index for c in chat if c.choices and c.choices[0].finish_reason]
    assert sorted(finished) == [0, 1]


def test_stop_string_and_echo(client, offline, tiny_llama_dir) -> None:
    full = offline_texts(offline, [TEXTS[2]], greedy(20))[0]
    stop = full[5:8]
    assert stop.strip(), full
    expected = offline_texts(offline, [TEXTS[2]], greedy(20, stop=[stop]))[0]
    for stream in (False, True):
        out = client.completions.create(model=tiny_llama_dir, prompt=TEXTS[2], max_tokens=20,
                                        temperature=0.0, stop=[stop], stream=stream)
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert text == expected and stop not in text and reason == "stop"
    echoed = client.completions.create(model=tiny_llama_dir, prompt=TEXTS[2], max_tokens=5,
                                       temperature=0.0, echo=True)
    assert echoed.choices[0].text == TEXTS[2] + offline_texts(offline, [TEXTS[2]],
                                                              greedy(5))[0]


def _stream_text(client, model: str, **kwargs) -> tuple[str, object]:
    chunks = list(client.completions.create(model=model, stream=True,
                                            stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, chunks[-1].usage


def test_streaming_equals_non_streaming(client, tiny_llama_dir) -> None:
    cases = [dict(prompt=TEXTS[0]),
             dict(prompt=None, extra_body={"prompt_embeds": encode_tensor(embeds(5))})]
    for case in cases:
        full = client.completions.create(model=tiny_llama_dir, max_tokens=16, temperature=0.0,
                                         **case)
        text, usage = _stream_text(client, tiny_llama_dir, max_tokens=16, temperature=0.0,
                                   **case)
        assert text == full.choices[0].text
        assert usage.completion_tokens == full.usage.completion_tokens
        assert usage.prompt_tokens == full.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_logprobs_shapes(client, tiny_llama_dir) -> None:
    for case in (dict(prompt=TEXTS[1]),
                 dict(prompt=None, extra_body={"prompt_embeds": encode_tensor(embeds(6))})):
        out = client.completions.create(model=tiny_llama_dir, max_tokens=9, temperature=0.0,
                                        logprobs=3, **case)
        lp, n = out.choices[0].logprobs, out.usage.completion_tokens
        assert n == 9
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
        assert len(lp.text_offset) == n and lp.text_offset == sorted(lp.text_offset)
        assert all(v <= 0.0 for v in lp.token_logprobs)
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert 1 <= len(top) <= 4
            assert top[token] == pytest.approx(value)
            assert max(top.values()) == pytest.approx(value)  # greedy: sampled is the top


def _chat_prompt(offline: LLM, messages: list[dict]) -> dict:
    tokenizer = offline.get_tokenizer()
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}


def test_chat_plain_and_streamed(client, offline, tiny_llama_dir) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Can you help me plan a trip?"}]
    expected = offline_texts(offline, [_chat_prompt(offline, messages)], greedy(12))[0]
    out = client.chat.completions.create(model=tiny_llama_dir, messages=messages,
                                         max_tokens=12, temperature=0.0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(
        model=tiny_llama_dir, messages=messages, max_tokens=12, temperature=0.0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    with_lp = client.chat.completions.create(model=tiny_llama_dir, messages=messages,
                                             max_tokens=5, temperature=0.0, logprobs=True,
                                             top_logprobs=2)
    content = with_lp.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)


def test_metrics_parse(server: RemoteServer, client: openai.OpenAI,
                       tiny_llama_dir: str) -> None:
    # A request of its own, so that the counters below have counted something whatever
    # ran before.
    client.completions.create(model=tiny_llama_dir, prompt="hi", max_tokens=2)
    text = httpx.get(f"{server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hit_rate",
                 "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert name in families, sorted(families)
    generated = families["vllm:generation_tokens"].samples[0].value
    assert generated > 0
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"


def test_tokenize_detokenize_round_trip(server: RemoteServer, offline: LLM) -> None:
    text = "Hello, world! Zürich → 東京"
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == offline.get_tokenizer().encode(text)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    detok = httpx.post(f"{server.url}/detokenize",
                       json={"tokens": tok["tokens"][1:]}).json()  # without the BOS
    assert detok["prompt"] == text
    chat = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == _chat_prompt(offline, [{"role": "user", "content": "hi"}])[
        "prompt_token_ids"]


# ---- bad input ------------------------------------------------------------------------


def _sparse(indices: list[list[int]]) -> torch.Tensor:
    values = torch.ones(len(indices[0]), dtype=torch.float32)
    return torch.sparse_coo_tensor(torch.tensor(indices), values, (4, HIDDEN),
                                   check_invariants=False)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/vllm-test-pwned",))


def _torch_save_bytes(obj: object) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


BAD_EMBEDS = {
    "invalid base64": "not base64 at all!!",
    "base64 with junk": encode_tensor(embeds(0))[:-4] + "@@@@",
    "a raw pickle": base64.b64encode(pickle.dumps({"not": "a tensor"})).decode(),
    "torch.save of a dict": encode_tensor({"embeds": embeds(0)}),
    "a malicious pickle": _torch_save_bytes(_Evil()),
    "wrong hidden size": encode_tensor(torch.randn(4, HIDDEN + 1)),
    "1-D tensor": encode_tensor(torch.randn(HIDDEN)),
    "3-D tensor, first dim 2": encode_tensor(torch.randn(2, 4, HIDDEN)),
    "integer tensor": encode_tensor(torch.ones(4, HIDDEN, dtype=torch.int64)),
    "empty tensor": encode_tensor(torch.empty(0, HIDDEN)),
    "non-finite tensor": encode_tensor(torch.full((4, HIDDEN), float("nan"))),
    "too long": encode_tensor(torch.randn(MAX_MODEL_LEN + 1, HIDDEN)),
    "sparse, index out of range": encode_tensor(_sparse([[0, 9], [0, 1]])),
    "sparse, negative index": encode_tensor(_sparse([[0, -1], [0, 1]])),
    "oversized payload": "A" * (MAX_MODEL_LEN * HIDDEN * 16),
    "not a string": 12345,
    "meta tensor": encode_tensor(torch.empty(4, HIDDEN, device="meta")),
}


def _bad_requests(model: str) -> dict[str, dict]:
    cases = {f"prompt_embeds: {k}": {"prompt_embeds": v} for k, v in BAD_EMBEDS.items()}
    good = encode_tensor(embeds(0))
    cases.update({
        "prompt_logprobs with embeds": {"prompt_embeds": good, "prompt_logprobs": 1},
        "echo with embeds": {"prompt_embeds": good, "echo": True},
        "too many prompt_embeds bytes in one request": {"prompt_embeds": ["A" * 400_000] * 9},
        "too long text prompt": {"prompt": "fox " * (MAX_MODEL_LEN + 5)},
        "prompt plus max_tokens over the context": {"prompt": "hi", "max_tokens": MAX_MODEL_LEN},
        "token id out of vocabulary": {"prompt": [1, 10**6]},
        "no prompt": {},
        "negative temperature": {"prompt": "hi", "temperature": -1.0},
        "prompt of the wrong type": {"prompt": {"a": 1}},
        "huge text prompt (rejected before tokenizing)": {"prompt": "x" * (65 * MAX_MODEL_LEN)},
        "top_k beyond the vocabulary": {"prompt": "hi", "top_k": 2**31},
        "stop_token_ids beyond the vocabulary": {"prompt": "hi", "stop_token_ids": [10**6],
                                                 "min_tokens": 1},
        "seed out of range": {"prompt": "hi", "seed": 2**64},
        "n too large": {"prompt": "hi", "n": 1000},
        "embeds times n over the byte budget": {"prompt_embeds": ["A" * 400_000] * 2,
                                                "n": 8},
    })
    for body in cases.values():
        body.setdefault("model", model)
        body.setdefault("max_tokens", 4)
    return cases


def test_bad_inputs_are_400_while_serving_others(server, offline, tiny_llama_dir) -> None:
    """A long streaming request runs while every bad request gets a 400; it completes with
    the offline tokens, and the engine still serves afterwards."""
    if os.path.exists("/tmp/vllm-test-pwned"):
        os.remove("/tmp/vllm-test-pwned")
    expected = offline_texts(offline, [TEXTS[0]], greedy(200, ignore_eos=True))[0]

    async def run() -> tuple[str, dict[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def long_stream() -> str:
                body = {"model": tiny_llama_dir, "prompt": TEXTS[0], "max_tokens": 200,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}
                text = ""
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            streaming = asyncio.ensure_future(long_stream())
            answers = {}
            for name, body in _bad_requests(tiny_llama_dir).items():
                answers[name] = await http.post("/v1/completions", json=body)
            answers["malformed JSON"] = await http.post(
                "/v1/completions", content=b"{not json",
                headers={"content-type": "application/json"})
            return await streaming, answers

    streamed, answers = asyncio.run(run())
    for name, response in answers.items():
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert error["code"] == 400 and error["type"] and error["message"], name
    assert "hidden size" in answers["prompt_embeds: wrong hidden size"].json()["error"][
        "message"]
    assert "split the batch" in answers["too many prompt_embeds bytes in one request"].json()[
        "error"]["message"]
    assert not os.path.exists("/tmp/vllm-test-pwned")
    assert streamed == expected
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert info.value.status_code == 404
    assert "The model `no-such-model` does not exist." in str(info.value)


# ---- concurrency and disconnects ------------------------------------------------------


def test_32_concurrent_streams_match_serial(server, offline, tiny_llama_dir) -> None:
    prompts: list = []
    for i in range(32):
        if i % 2:
            prompts.append(f"{TEXTS[i % 4]} {i}")
        else:
            prompts.append({"prompt_embeds": embeds(100 + i, num_tokens=3 + i % 9)})
    expected = [offline_texts(offline, [p], greedy(16))[0] for p in prompts]  # serially

    async def one(aclient: openai.AsyncOpenAI, prompt) -> str:
        if isinstance(prompt, str):
            kwargs = dict(prompt=prompt)
        else:
            kwargs = dict(prompt=None,
                          extra_body={"prompt_embeds": encode_tensor(prompt["prompt_embeds"])})
        stream = await aclient.completions.create(model=tiny_llama_dir, max_tokens=16,
                                                  temperature=0.0, stream=True, **kwargs)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*[one(aclient, p) for p in prompts])

    assert asyncio.run(run()) == expected


def _metric_values(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            values[sample.name + (f"[{reason}]" if reason else "")] = sample.value
    return values


def _wait_idle(server: RemoteServer) -> dict[str, float]:
    for _ in range(200):  # bounded: at most ~10 s
        values = _metric_values(server)
        if values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0:
            return values
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {values}")


def test_client_disconnect_frees_blocks(server, tiny_llama_dir) -> None:
    """Streaming and non-streaming clients that go away abort their requests: the engine
    goes idle with no KV blocks in use, long before the requests could have finished."""
    n, max_tokens = 8, MAX_MODEL_LEN - 16
    before = _wait_idle(server)
    body = {"model": tiny_llama_dir, "prompt": TEXTS[1], "max_tokens": max_tokens, "n": n,
            "temperature": 0.0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ")
                next(lines)  # the blank line after each event
            usage = _metric_values(server)["vllm:kv_cache_usage_perc"]
            assert usage > 0  # the request holds blocks
    # Non-streaming: the client gives up waiting; the server notices the disconnect.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False},
                   timeout=0.3)
    after = _wait_idle(server)
    aborted = after["vllm:request_success_total[abort]"] - before[
        "vllm:request_success_total[abort]"]
    assert aborted == 2 * n  # every child sequence of both requests
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < n * max_tokens  # far from the 2 * n * max_tokens of a full run


def test_oversized_request_body_is_413_before_parsing(server, tiny_llama_dir) -> None:
    # 8 embeds budgets of (512 * 64 * 8 + 64 KiB) bytes, as base64, plus 1 MiB of slack.
    limit = 8 * (MAX_MODEL_LEN * HIDDEN * 8 + 64 * 1024) * 4 // 3 + 2**20
    body = b'{"model": "x", "prompt": "' + b"a" * (limit + 10) + b'"}'
    response = httpx.post(f"{server.url}/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=60)
    assert response.status_code == 413
    assert "larger than" in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
