"""`/v1/responses` against `/v1/chat/completions`: the translation's cost, served.

    python benchmarks/benchmark_responses.py [MODEL] [--requests 64] [--max-tokens 64]
        [--repeats 2] [--stream] [--json-schema]

Starts `vllm serve` (default: the packaged SmolLM2-135M GGUF) and sends the same
`requests` conversations at once through each endpoint, every reply made to generate
`max-tokens` tokens (`ignore_eos`), optionally streamed and optionally constrained by a
JSON schema (`text.format` / `response_format`, compact). Interleaved repeats, the faster of
each kept; prints output tokens per second of each and their ratio (the target is >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai  # noqa: E402

from tests.server_utils import SMALL_ENGINE_ARGS, RemoteServer  # noqa: E402
from vllm.transformers_utils.default_model import default_model_path  # noqa: E402

MODEL = "bench"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


async def one(client: Any, api: str, i: int, args: argparse.Namespace) -> int:
    """Output tokens of one request."""
    text = f"Describe person number {i} in a sentence."
    extra = {"ignore_eos": True}
    if api == "chat":
        kwargs: dict[str, Any] = {"model": MODEL, "temperature": 0.0,
                                  "max_tokens": args.max_tokens,
                                  "messages": [{"role": "user", "content": text}],
                                  "extra_body": extra}
        if args.json_schema:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "person", "schema": SCHEMA, "strict": True}}
        if args.stream:
            count = 0
            stream = await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs)
            async for chunk in stream:
                count = chunk.usage.completion_tokens if chunk.usage else count
            return count
        return (await client.chat.completions.create(**kwargs)).usage.completion_tokens
    kwargs = {"model": MODEL, "temperature": 0.0, "max_output_tokens": args.max_tokens,
              "input": text, "extra_body": extra}
    if args.json_schema:
        kwargs["text"] = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                                     "strict": True}}
    if args.stream:
        count = 0
        async for event in await client.responses.create(stream=True, **kwargs):
            if event.type in ("response.completed", "response.incomplete"):
                count = event.response.usage.output_tokens
        return count
    return (await client.responses.create(**kwargs)).usage.output_tokens


async def batch(url: str, api: str, args: argparse.Namespace) -> tuple[float, int]:
    """Seconds for the batch, and its output tokens."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
    async with client:
        start = time.perf_counter()
        counts = await asyncio.gather(*[one(client, api, i, args)
                                        for i in range(args.requests)])
        return time.perf_counter() - start, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--json-schema", action="store_true")
    args = parser.parse_args()
    server = RemoteServer(args.model or default_model_path(), [
        "--served-model-name", MODEL, *SMALL_ENGINE_ARGS, "--max-model-len", "1024",
        "--kv-cache-memory-bytes", "256MiB"])
    try:
        asyncio.run(batch(server.url, "chat", argparse.Namespace(**{**vars(args),
                                                                    "requests": 4})))
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.repeats):  # interleaved, the faster of each kept
            for api in ("chat", "responses"):
                elapsed, tokens = asyncio.run(batch(server.url, api, args))
                if api not in best or elapsed < best[api][0]:
                    best[api] = (elapsed, tokens)
    finally:
        server.stop()
    rates = {api: tokens / elapsed for api, (elapsed, tokens) in best.items()}
    print(f"{args.requests} requests, {args.max_tokens} tokens each"
          f"{', streamed' if args.stream else ''}{', json schema' if args.json_schema else ''}")
    for api, (elapsed, tokens) in best.items():
        print(f"  {api:9s}: {tokens} tokens in {elapsed:.2f} s = {rates[api]:.1f} tok/s")
    print(f"  ratio (responses / chat): {rates['responses'] / rates['chat']:.3f}")


if __name__ == "__main__":
    main()
