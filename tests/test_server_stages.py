"""Stage outputs through the server with the official `openai` client: `return_hidden_states`
(extra body), hidden states fed back as `prompt_embeds`, and `vllm serve --pipeline`."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer
from vllm import LLM, Pipeline, SamplingParams

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox", "Once upon a time there was"]
HIDDEN_STATES = {"return_hidden_states": True}


def _decode(data: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(data)), weights_only=True)


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str):
    srv = RemoteServer(tiny_llama_dir, ["--enable-prompt-embeds",
                                        "--enable-return-hidden-states", *SMALL_ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_llama_dir: str) -> LLM:
    return LLM(tiny_llama_dir, enable_prompt_embeds=True, enable_return_hidden_states=True,
               dtype="float32", kv_cache_memory_bytes=64 * 1024**2, max_model_len=512, seed=0,
               enforce_eager=True)


def test_return_hidden_states_per_choice(client, offline, server):
    response = client.completions.create(model=server_model(client), prompt=TEXTS,
                                         max_tokens=6, temperature=0, extra_body=HIDDEN_STATES)
    expected = offline.generate(TEXTS, _greedy(6, return_hidden_states=True), use_tqdm=False)
    assert "Stage-output cache (hidden_states)" in server.read_log()
    for choice, out in zip(sorted(response.choices, key=lambda c: c.index), expected):
        assert choice.text == out.outputs[0].text
        rows = _decode(choice.model_extra["hidden_states"])
        assert rows.dtype == torch.float32
        assert rows.shape == (out.num_prompt_tokens + len(out.outputs[0].token_ids) - 1, 64)
        torch.testing.assert_close(rows, out.hidden_states, atol=1e-5, rtol=0)
    plain = client.completions.create(model=server_model(client), prompt=TEXTS[0],
                                      max_tokens=2)
    assert plain.choices[0].model_extra.get("hidden_states") is None


def test_streamed_hidden_states_come_with_the_final_chunk(client):
    kwargs = dict(model=server_model(client), prompt=TEXTS[1], max_tokens=5, temperature=0,
                  extra_body=HIDDEN_STATES)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c for chunk in client.completions.create(stream=True, **kwargs)
              for c in chunk.choices]
    with_rows = [c for c in chunks if c.model_extra.get("hidden_states")]
    assert len(with_rows) == 1 and with_rows[0].finish_reason == "length"
    assert with_rows[0] is chunks[-1]
    assert "".join(c.text for c in chunks) == whole.text
    torch.testing.assert_close(_decode(with_rows[0].model_extra["hidden_states"]),
                               _decode(whole.model_extra["hidden_states"]), atol=1e-5, rtol=0)


def test_hidden_states_are_the_next_servers_prompt_embeds(client, offline):
    first = client.completions.create(model=server_model(client), prompt=TEXTS[0],
                                      max_tokens=4, temperature=0, extra_body=HIDDEN_STATES)
    data = first.choices[0].model_extra["hidden_states"]
    second = client.completions.create(model=server_model(client), prompt="", max_tokens=5,
                                       temperature=0, extra_body={"prompt_embeds": data})
    expected = offline.generate({"prompt_embeds": _decode(data)}, _greedy(5), use_tqdm=False)
    assert second.choices[0].text == expected[0].outputs[0].text


def server_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---- vllm serve --pipeline ----------------------------------------------------------------


@pytest.fixture(scope="module")
def stages_yaml(tmp_path_factory, tiny_llama_dir: str, tiny_qwen2_dir: str) -> str:
    path = tmp_path_factory.mktemp("pipeline") / "stages.yaml"
    engine = ("    dtype: float32\n    max_model_len: 512\n    kv_cache_memory_bytes: 16777216\n"
              "    enforce_eager: true\n")
    path.write_text(
        "name: tiny-pipe\nstages:\n"
        f"  - model: {tiny_llama_dir}\n{engine}"
        "    sampling_params: {temperature: 0, max_tokens: 4, ignore_eos: true}\n"
        f"  - model: {tiny_qwen2_dir}\n{engine}"
        "connectors: [hidden_states_to_embeds]\n")
    return str(path)


@pytest.fixture(scope="module")
def pipeline_client(stages_yaml: str):
    srv = RemoteServer(None, ["--pipeline", stages_yaml])
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert srv.stop() == 0, srv.final_log


def test_served_pipeline_equals_the_offline_pipeline(pipeline_client, stages_yaml):
    expected = Pipeline.from_yaml(stages_yaml).generate(TEXTS, [None, _greedy(6)])
    response = pipeline_client.completions.create(model="tiny-pipe", prompt=TEXTS,
                                                  max_tokens=6, temperature=0)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.outputs[0].text for o in expected]
    # Usage counts the last stage: its prompt is stage A's rows.
    assert response.usage.prompt_tokens == sum(o.num_prompt_tokens for o in expected)
    streamed = pipeline_client.completions.create(model="tiny-pipe", prompt=TEXTS[0],
                                                  max_tokens=6, temperature=0, stream=True)
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == \
        expected[0].outputs[0].text


def test_served_pipeline_refuses_what_its_last_stage_cannot_do(pipeline_client):
    with pytest.raises(openai.BadRequestError, match="last stage"):
        pipeline_client.completions.create(model="tiny-pipe", prompt=TEXTS[0], max_tokens=2,
                                           extra_body=HIDDEN_STATES)
