"""`vllm serve --enable-lora --lora-modules`: a request's `model` picks the adapter (outputs
equal the offline run with it), vLLM's prompt-embeds cases with the adapter as the model,
`/v1/models` parents, runtime load/unload, 404 for unknown names."""

from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
import torch

from tests.lora_utils import make_adapter
from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer, encode_tensor
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

HIDDEN = 64  # tests/model_factory.py tiny configs


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("server_loras")
    return {
        "alpha": make_adapter(tiny_llama_dir, str(root / "alpha"), rank=8,
                              targets=("q_proj", "v_proj", "down_proj"), seed=1),
        "beta": make_adapter(tiny_llama_dir, str(root / "beta"), rank=4, use_rslora=True,
                             targets=("k_proj", "o_proj", "gate_proj", "up_proj"), seed=2),
        "gamma": make_adapter(tiny_llama_dir, str(root / "gamma"), rank=2, seed=3),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, adapters: dict[str, str]):
    beta = json.dumps({"name": "beta", "path": adapters["beta"], "base_model_name": "tiny"})
    srv = RemoteServer(tiny_llama_dir, [
        "--enable-prompt-embeds", "--enable-lora", "--lora-modules",
        f"alpha={adapters['alpha']}", beta, "--max-loras", "2", "--max-lora-rank", "8",
        *SMALL_ENGINE_ARGS], env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, enable_prompt_embeds=True, dtype="float32", enable_lora=True,
               max_loras=2, max_lora_rank=8, kv_cache_memory_bytes=64 * 1024**2,
               max_model_len=512, seed=0, enforce_eager=True)


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _embeds(seed: int, num_tokens: int = 6) -> torch.Tensor:
    return torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _offline(offline: LLM, prompts: list, lora: LoRARequest | None, max_tokens: int = 8,
             **kwargs) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    return [o.outputs[0] for o in offline.generate(prompts, params, use_tqdm=False,
                                                   lora_request=lora)]


def test_models_lists_adapters_with_parents(server: RemoteServer, tiny_llama_dir: str,
                                            adapters: dict[str, str]) -> None:
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["alpha"]["parent"] == tiny_llama_dir  # the served base model's name
    assert cards["alpha"]["root"] == adapters["alpha"]
    assert cards["beta"]["parent"] == "tiny"  # its base_model_name
    assert cards[tiny_llama_dir]["parent"] is None


def test_adapter_by_model_name_matches_offline(client: openai.OpenAI, offline: LLM,
                                               adapters: dict[str, str],
                                               tiny_llama_dir: str) -> None:
    alpha = LoRARequest("alpha", 1, adapters["alpha"])
    text = "The quick brown fox"
    for model, lora in ((tiny_llama_dir, None), ("alpha", alpha)):
        expected = _offline(offline, [text], lora)[0].text
        out = client.completions.create(model=model, prompt=text, max_tokens=8,
                                        temperature=0.0)
        assert out.choices[0].text == expected, model
        assert out.model == model  # the adapter's name, as vLLM replies
    base_text = _offline(offline, [text], None)[0].text
    assert _offline(offline, [text], alpha)[0].text != base_text  # the adapter matters
    # Chat, streamed, through the other adapter.
    beta = LoRARequest("beta", 2, adapters["beta"])
    messages = [{"role": "user", "content": "Hello there"}]
    expected = offline.chat(messages, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False, lora_request=beta)[0].outputs[0].text
    stream = client.chat.completions.create(model="beta", messages=messages,  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


def test_prompt_embeds_cases_with_the_adapter_as_model(client: openai.OpenAI, offline: LLM,
                                                       adapters: dict[str, str]) -> None:
    """vLLM's prompt-embeds server cases, the adapter named as the model."""
    alpha = LoRARequest("alpha", 1, adapters["alpha"])
    one, two = _embeds(1), _embeds(2, 4)
    expected = _offline(offline, [{"prompt_embeds": one}, {"prompt_embeds": two}], alpha,
                        logprobs=1)
    single = client.completions.create(model="alpha", prompt=None, max_tokens=8,
                                       temperature=0.0,
                                       extra_body={"prompt_embeds": encode_tensor(one)})
    assert single.choices[0].text == expected[0].text
    batch = client.completions.create(model="alpha", prompt=None, max_tokens=8,
                                      temperature=0.0, logprobs=1, extra_body={
                                          "prompt_embeds": [encode_tensor(one),
                                                            encode_tensor(two)]})
    assert [c.text for c in batch.choices] == [e.text for e in expected]
    for choice, exp in zip(batch.choices, expected):
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        ours = choice.logprobs.token_logprobs
        theirs = [lp[t].logprob for lp, t in zip(exp.logprobs, exp.token_ids)]
        assert ours == pytest.approx(theirs, abs=1e-4)
    stream = client.completions.create(model="alpha", prompt=None, max_tokens=8,
                                       temperature=0.0, stream=True,
                                       extra_body={"prompt_embeds": encode_tensor(one)})
    assert "".join(c.choices[0].text for c in stream) == expected[0].text
    # Embeds and text in one batch.
    mixed = client.completions.create(model="alpha", prompt="Once upon", max_tokens=8,
                                      temperature=0.0,
                                      extra_body={"prompt_embeds": encode_tensor(two)})
    expected_mixed = _offline(offline, [{"prompt_embeds": two}, "Once upon"], alpha)
    assert [c.text for c in mixed.choices] == [e.text for e in expected_mixed]


def test_unknown_adapter_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    assert info.value.status_code == 404
    assert "The model `no-such-adapter` does not exist." in str(info.value)


def test_runtime_load_and_unload(server: RemoteServer, client: openai.OpenAI, offline: LLM,
                                 adapters: dict[str, str], tmp_path) -> None:
    url = server.url
    body = {"lora_name": "gamma", "lora_path": adapters["gamma"]}
    reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.text == "Success: LoRA adapter 'gamma' added successfully."
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body)
    assert again.status_code == 400
    assert "The lora adapter 'gamma' has already been loaded." in again.text
    # Three adapters over two slots, one request each, at once.
    gamma = LoRARequest("gamma", 3, adapters["gamma"])
    out = client.completions.create(model="gamma", prompt="What is", max_tokens=8,
                                    temperature=0.0)
    assert out.choices[0].text == _offline(offline, ["What is"], gamma)[0].text
    bad = httpx.post(f"{url}/v1/load_lora_adapter",
                     json={"lora_name": "nowhere", "lora_path": str(tmp_path / "none")})
    assert bad.status_code == 400 and "does not exist" in bad.text
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert gone.status_code == 200
    assert gone.text == "Success: LoRA adapter 'gamma' removed successfully."
    missing = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
    assert missing.status_code == 404
    assert "The lora adapter 'gamma' cannot be found." in missing.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    assert os.path.isdir(adapters["gamma"])
