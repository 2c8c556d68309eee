"""`vllm serve` and `vllm generate` on a BART model: the prompt goes to the encoder.

One server (tiny random BART, prompt embeds on) driven by the `openai` client, against an
offline `LLM` with the same engine settings.
"""

from __future__ import annotations

import contextlib
import io

import openai
import pytest
import torch

from tests.model_factory import make_tiny_bart
from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer, encode_tensor
from vllm import LLM, SamplingParams
from vllm.entrypoints.cli import main as cli_main

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox", "Once upon a time there was a little robot",
         "What is the capital of France?"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def bart_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_bart(str(tmp_path_factory.mktemp("server_bart")))


@pytest.fixture(scope="module")
def server(bart_dir: str):
    srv = RemoteServer(bart_dir, ["--enable-prompt-embeds", *SMALL_ENGINE_ARGS])
    yield srv
    assert srv.stop() == 0, srv.final_log


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(bart_dir: str) -> LLM:
    return LLM(bart_dir, dtype="float32", kv_cache_memory_bytes=64 * 1024**2,
               max_model_len=512, seed=0, enable_prompt_embeds=True, enforce_eager=True)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_completions_send_the_prompt_to_the_encoder(client, offline, bart_dir) -> None:
    expected = offline.generate(TEXTS, _greedy(), use_tqdm=False)
    response = client.completions.create(model=bart_dir, prompt=TEXTS, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"ignore_eos": True})
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [o.outputs[0].text for o in expected]
    # The decoder prompt is BART's default <DEC><BOS>, whatever the text.
    assert all(o.prompt_token_ids == [2, 1] for o in expected)
    assert len({o.outputs[0].text for o in expected}) > 1  # the encoder input matters


def test_encoder_prompt_embeds_over_the_wire(client, offline, bart_dir) -> None:
    runner = offline.llm_engine.engine_core.model_executor.model_runner
    ids = offline.get_tokenizer().encode(TEXTS[1])
    with torch.inference_mode():
        embeds = runner.model.get_input_embeddings(torch.tensor(ids)).clone()
    expected = offline.generate({"prompt_token_ids": ids}, _greedy(), use_tqdm=False)[0]
    response = client.completions.create(
        model=bart_dir, prompt="", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"prompt_embeds": encode_tensor(embeds), "ignore_eos": True})
    assert response.choices[0].text == expected.outputs[0].text


def test_too_long_encoder_prompt_is_400_and_serving_goes_on(client, bart_dir) -> None:
    with pytest.raises(openai.BadRequestError, match="encoder"):
        client.completions.create(model=bart_dir, prompt=[5] * 1100, max_tokens=4)
    response = client.completions.create(model=bart_dir, prompt=TEXTS[0], max_tokens=4)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_vllm_generate_with_bart(bart_dir, offline) -> None:
    expected = offline.generate(TEXTS[0], SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0].text
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli_main(["generate", TEXTS[0], "--model", bart_dir, "--max-tokens", "6",
                         "--dtype", "float32"])
    assert code == 0
    assert stdout.getvalue() == expected + "\n"
