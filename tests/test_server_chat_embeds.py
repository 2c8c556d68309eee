"""`prompt_embeds` content parts in `/v1/chat/completions`, served on the default model:
vLLM's chat prompt-embeds cases (one part plus text, two parts in one message, parts in
system and user messages, streamed equals non-streamed, aligned text vs embeds, missing
data and invalid base64), each checked against the same conversation sent as text, plus
n, logprobs, stop strings, cache_salt and the 400s for bad parts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from tests.server_utils import RemoteServer, encode_tensor
from vllm.transformers_utils.tokenizer import get_tokenizer

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
FRUIT = "Name a fruit that is red."
BRIEF = "Answer in one short sentence."


@pytest.fixture(scope="module")
def server(default_model_path: str):
    # Dense weights: with the file's Q4_1 blocks a step of few rows (a prompt's tail after a
    # prefix hit, say) takes `quant_gemv` with Q8-quantized activations and a longer one the
    # dense copy, whose logprobs differ by up to ~0.1; which one a request's tail gets
    # depends on the cache and on whether n=2's children share a step, not on its parts.
    srv = RemoteServer(default_model_path, [
        "--enable-prompt-embeds", "--dtype", "float32", "--kv-cache-memory-bytes", "64MiB",
        "--max-model-len", "512", "--seed", "0", "--enforce-eager", "--quantization", "none"])
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str):
    return get_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def embed(default_model_path: str, tokenizer):
    """Text -> the embedding-table rows of its tokens (no special tokens), float32."""
    from vllm.model_executor.model_loader.gguf_file import GGUFFile
    from vllm.model_executor.model_loader.gguf_loader import _dequantize

    table = next(t for t in GGUFFile(default_model_path).tensors
                 if t.name == "token_embd.weight")
    weights = torch.from_numpy(_dequantize(table))

    def rows(text: str) -> torch.Tensor:
        return weights[torch.tensor(tokenizer.encode(text, add_special_tokens=False))]

    return rows


def _part(rows: torch.Tensor) -> dict:
    return {"type": "prompt_embeds", "data": encode_tensor(rows)}


def _text(text: str) -> dict:
    return {"type": "text", "text": text}


def _reply(client: openai.OpenAI, model: str, messages: list[dict], **kwargs):
    kwargs.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                          temperature=0.0, **kwargs)


def test_parts_give_the_replies_of_the_same_text(client, default_model_path, embed) -> None:
    """Each embeds part holds the rows of some text: the reply (and prompt length) equals
    that of the conversation with the text in the part's place (parts join with "\\n",
    like text parts)."""
    cases = [
        # aligned: a message whose only part is a text's embeddings
        ([{"role": "user", "content": [_part(embed(QUESTION))]}],
         [{"role": "user", "content": QUESTION}]),
        # one part plus text
        ([{"role": "user", "content": [_text(BRIEF), _part(embed(QUESTION))]}],
         [{"role": "user", "content": f"{BRIEF}\n{QUESTION}"}]),
        # two parts in one message
        ([{"role": "user", "content": [_part(embed(QUESTION)), _part(embed(FRUIT))]}],
         [{"role": "user", "content": f"{QUESTION}\n{FRUIT}"}]),
        # parts in the system and the user messages, around text
        ([{"role": "system", "content": [_part(embed(BRIEF))]},
          {"role": "user", "content": [_text("Hi."), _part(embed(FRUIT)), _text("Thanks.")]}],
         [{"role": "system", "content": BRIEF},
          {"role": "user", "content": f"Hi.\n{FRUIT}\nThanks."}]),
    ]
    for with_parts, as_text in cases:
        got = _reply(client, default_model_path, with_parts)
        want = _reply(client, default_model_path, as_text)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.choices[0].message.content
        assert got.usage.prompt_tokens == want.usage.prompt_tokens


def test_streamed_equals_non_streamed_with_n_logprobs_stop(client, default_model_path,
                                                           embed) -> None:
    messages = [{"role": "user", "content": [_text(BRIEF), _part(embed(QUESTION))]}]
    as_text = [{"role": "user", "content": f"{BRIEF}\n{QUESTION}"}]
    kwargs = {"n": 2, "logprobs": True, "top_logprobs": 2, "stop": ["."], "max_tokens": 16}
    full = _reply(client, default_model_path, messages, **kwargs)
    text = _reply(client, default_model_path, as_text, **kwargs)
    assert [c.message.content for c in full.choices] == [c.message.content
                                                         for c in text.choices]
    assert full.choices[0].finish_reason == "stop" and "." not in full.choices[0].message.content
    for ours, theirs in zip(full.choices[0].logprobs.content, text.choices[0].logprobs.content,
                            strict=True):
        assert ours.token == theirs.token and abs(ours.logprob - theirs.logprob) < 1e-4
        assert len(ours.top_logprobs) == 2
    chunks = list(_reply(client, default_model_path, messages, stream=True, **kwargs))
    for index in range(2):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == index)
        assert streamed == full.choices[index].message.content


def test_cache_salt_keys_the_parts_blocks(server, default_model_path, embed) -> None:
    rows = embed(" ".join([QUESTION, FRUIT, BRIEF] * 4))
    body = {"model": default_model_path, "max_tokens": 2, "temperature": 0.0,
            "messages": [{"role": "user", "content": [_part(rows), _text(BRIEF)]}]}

    def cached(salt: str) -> int:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "cache_salt": salt},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= rows.shape[0] // 16 * 16
    assert cached("tenant-b") == 0


def test_bad_parts_are_400s(server, default_model_path, embed) -> None:
    hidden = embed("a").shape[1]
    bad = {
        "needs 'data'": {"type": "prompt_embeds"},
        "not valid base64": {"type": "prompt_embeds", "data": "not base64!"},
        "hidden size is 7": _part(torch.zeros(3, 7)),
        "floating dtype": _part(torch.zeros(3, hidden, dtype=torch.int32)),
        "longer than the maximum model length": _part(torch.zeros(600, hidden)),
    }
    for message, part in bad.items():
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": default_model_path, "max_tokens": 2,
            "messages": [{"role": "user", "content": [_text("Hi"), part]}]})
        assert r.status_code == 400, (message, r.text)
        assert message in r.json()["error"]["message"], (message, r.text)
    # The server still answers.
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": default_model_path, "max_tokens": 2,
        "messages": [{"role": "user", "content": [_part(embed(QUESTION))]}]})
    assert ok.status_code == 200


def test_parts_need_enable_prompt_embeds(tiny_llama_dir) -> None:
    """Refused before any decoding or engine work (no server needed)."""
    from vllm import EngineArgs
    from vllm.entrypoints.errors import OpenAIError
    from vllm.entrypoints.openai.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat

    config = EngineArgs(model=tiny_llama_dir, max_model_len=64).create_engine_config()
    engine = SimpleNamespace(vllm_config=config, tokenizer=get_tokenizer(tiny_llama_dir))
    chat = OpenAIServingChat(engine, ["m"])  # type: ignore[arg-type]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": [
        {"type": "prompt_embeds", "data": encode_tensor(torch.zeros(2, 64))}]}])
    with pytest.raises(OpenAIError, match="--enable-prompt-embeds"):
        asyncio.run(chat.create_chat_completion(request))


def test_placeholders_split_and_errors() -> None:
    from vllm.entrypoints.chat_utils import split_at_placeholders, take_embeds_parts

    messages = [{"role": "user", "content": [_text("A"), {"type": "prompt_embeds", "data": 1},
                                             {"type": "prompt_embeds", "data": 2}]}]
    parts = take_embeds_parts(messages)
    p0, p1 = parts.placeholders
    assert parts.data == [1, 2] and p0 != p1
    assert parts.messages[0]["content"] == [_text("A"), _text(p0), _text(p1)]
    assert split_at_placeholders(f"<s>A\n{p0}\n{p1}", [p0, p1]) == ["<s>A\n", 0, "\n", 1]
    assert split_at_placeholders(f"{p1}{p0}x", [p0, p1]) == [1, 0, "x"]
    # Another conversation's placeholders differ (a random nonce): text cannot forge them.
    assert take_embeds_parts(messages).placeholders[0] != p0
    with pytest.raises(ValueError, match="placed prompt_embeds part 1 2 times"):
        split_at_placeholders(f"{p0}{p1}{p1}", [p0, p1])
    with pytest.raises(ValueError, match="placed prompt_embeds part 0 0 times"):
        split_at_placeholders("dropped", [p0])
    with pytest.raises(ValueError, match=r"messages\[0\].content\[1\]: a prompt_embeds part "
                                         "needs 'data'"):
        take_embeds_parts([{"role": "user", "content": [_text("A"), {"type": "prompt_embeds"}]}])


def test_pieces_tokenize_as_the_templates_text(tokenizer) -> None:
    """Token by token: the pieces around parts holding a text's ids give exactly the ids of
    the conversation with that text in the parts' places (SmolLM2's template)."""
    from vllm.entrypoints.chat_utils import chat_prompt

    rows = {QUESTION: torch.zeros(1, 1), FRUIT: torch.ones(1, 1)}
    with_parts = [{"role": "system", "content": [{"type": "prompt_embeds", "data": rows[FRUIT]}]},
                  {"role": "user", "content": [_text(BRIEF), {"type": "prompt_embeds",
                                                              "data": rows[QUESTION]},
                                               _text("Thanks.")]}]
    as_text = [{"role": "system", "content": FRUIT},
               {"role": "user", "content": f"{BRIEF}\n{QUESTION}\nThanks."}]
    prompt = chat_prompt(tokenizer, with_parts, True, False, None, None, 512, 1)
    ids = []
    for segment in prompt["prompt_segments"]:
        if isinstance(segment, str):
            ids += tokenizer.encode(segment, add_special_tokens=False)
        else:
            text = next(t for t, r in rows.items() if r is segment)
            ids += tokenizer.encode(text, add_special_tokens=False)
    expected = chat_prompt(tokenizer, as_text, True, False, None, None, 512, 1)
    assert ids == expected["prompt_token_ids"]
