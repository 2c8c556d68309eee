"""Online serving benchmark: replay a fixed workload against `vllm serve` at a request rate.

Workload (seeded, identical across runs): `--num-prompts` requests per kind; text prompts are
random token ids (drawn from [100, vocab)) decoded to text by the server's /detokenize,
embeds prompts are random N(0, 0.02) tensors of `--input-len` rows, sent as base64 of
torch.save. Every request streams exactly `--output-len` tokens (ignore_eos); arrivals
follow a Poisson process at `--request-rate` (inf: all at once); kinds are interleaved.

    vllm serve MODEL --enable-prompt-embeds &            # then:
    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000
    python benchmarks/benchmark_serving.py --launch --model MODEL --request-rate 4

Reports, per kind and overall: throughput (requests/s, output tokens/s), time to first
token and inter-token latency (median and p99, milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import torch


@dataclass
class Result:
    kind: str
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0


def build_workload(args: argparse.Namespace, vocab_size: int, hidden_size: int
                   ) -> list[tuple[str, list[int] | torch.Tensor]]:
    """(kind, token ids or embeds) per request, kinds interleaved; seeded."""
    rng = np.random.default_rng(args.seed)
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind not in ("text", "embeds"):
            raise SystemExit(f"unknown kind {kind!r}: use text and/or embeds")
    workload: list[tuple[str, list[int] | torch.Tensor]] = []
    for _ in range(args.num_prompts):
        for kind in kinds:
            if kind == "text":
                workload.append((kind, rng.integers(100, vocab_size,
                                                    size=args.input_len).tolist()))
            else:
                rows = rng.normal(0.0, 0.02, size=(args.input_len, hidden_size))
                workload.append((kind, torch.tensor(rows, dtype=torch.float32)))
    return workload


async def to_bodies(http: httpx.AsyncClient, workload: list) -> list[tuple[str, dict]]:
    """Text prompts: the ids decoded by the server; embeds: base64 of torch.save."""
    bodies = []
    for kind, data in workload:
        if kind == "text":
            text = (await http.post("/detokenize", json={"tokens": data})).json()["prompt"]
            bodies.append((kind, {"prompt": text}))
        else:
            buffer = io.BytesIO()
            torch.save(data, buffer)
            bodies.append((kind, {"prompt": None, "prompt_embeds":
                                  base64.b64encode(buffer.getvalue()).decode()}))
    return bodies


async def send(http: httpx.AsyncClient, model: str, kind: str, body: dict,
               output_len: int) -> Result:
    result = Result(kind, start=time.perf_counter())
    payload = {"model": model, **body, "max_tokens": output_len, "temperature": 0.0,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    last = result.start
    try:
        async with http.stream("POST", "/v1/completions", json=payload) as response:
            if response.status_code != 200:
                result.error = (await response.aread()).decode()[:200]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now, chunk = time.perf_counter(), json.loads(line[6:])
                if chunk.get("error"):
                    result.error = chunk["error"]["message"]
                    return result
                if chunk["choices"]:
                    if result.ttft is None:
                        result.ttft = now - result.start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.end, result.ok = time.perf_counter(), True
    return result


async def replay(args: argparse.Namespace, base_url: str) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
        model = args.served_model or card["id"]
        vocab_size, hidden_size = model_dims(card.get("root"), args)
        workload = await to_bodies(http, build_workload(args, vocab_size, hidden_size))
        # Warm up (first-request overheads are not what we measure).
        await send(http, model, workload[0][0], workload[0][1], 4)
        rng = np.random.default_rng(args.seed + 1)
        tasks = []
        start = time.perf_counter()
        for kind, body in workload:
            tasks.append(asyncio.create_task(send(http, model, kind, body, args.output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def model_dims(root: str | None, args: argparse.Namespace) -> tuple[int, int]:
    if args.vocab_size and args.hidden_size:
        return args.vocab_size, args.hidden_size
    if root is None or not os.path.exists(root):
        raise SystemExit("The server's model path is not local; pass --vocab-size and "
                         "--hidden-size.")
    from vllm.transformers_utils.config import get_config

    config = get_config(root)
    return args.vocab_size or config.vocab_size, args.hidden_size or config.hidden_size


def summarize(results: list[Result], duration: float) -> dict:
    report = {}
    kinds = sorted({r.kind for r in results})
    for kind in [*kinds, "all"] if len(kinds) > 1 else kinds:
        chosen = [r for r in results if kind in ("all", r.kind)]
        ok = [r for r in chosen if r.ok]
        ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
        itls = [x * 1000 for r in ok for x in r.itls]
        out_tokens = sum(r.output_tokens for r in ok)
        report[kind] = {
            "completed": len(ok), "failed": len(chosen) - len(ok),
            "request_throughput": len(ok) / duration,
            "output_token_throughput": out_tokens / duration,
            "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok])) if ok else 0,
            "ttft_ms_median": _pct(ttfts, 50), "ttft_ms_p99": _pct(ttfts, 99),
            "itl_ms_median": _pct(itls, 50), "itl_ms_p99": _pct(itls, 99),
        }
        errors = [r.error for r in chosen if not r.ok]
        if errors:
            report[kind]["first_error"] = errors[0]
    return report


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def print_report(report: dict, duration: float, args: argparse.Namespace) -> None:
    print(f"\nrate={args.request_rate} req/s, {args.num_prompts} prompts per kind, "
          f"input {args.input_len}, output {args.output_len} tokens, {duration:.1f} s")
    header = (f"{'kind':8} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}  (ms)")
    print(header)
    for kind, r in report.items():
        def ms(v):
            return f"{v:9.1f}" if v is not None else f"{'-':>9}"
        print(f"{kind:8} {r['completed']:5d} {r['failed']:4d} {r['request_throughput']:7.2f} "
              f"{r['output_token_throughput']:10.1f} {ms(r['ttft_ms_median'])} "
              f"{ms(r['ttft_ms_p99'])} {ms(r['itl_ms_median'])[1:]} {ms(r['itl_ms_p99'])[1:]}")
        if "first_error" in r:
            print(f"         first error: {r['first_error']}")


def launch(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "vllm.entrypoints.cli", "serve"]
    if args.model:
        command.append(args.model)
    command += ["--host", "127.0.0.1", "--port", str(port), "--enable-prompt-embeds",
                "--disable-uvicorn-access-log", *shlex.split(args.server_args)]
    proc = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--launch", action="store_true",
                        help="start `vllm serve` on a free loopback port, stop it after")
    parser.add_argument("--model", default=None, help="with --launch: the model to serve")
    parser.add_argument("--server-args", default="", help="with --launch: extra serve flags")
    parser.add_argument("--served-model", default=None, help="model name for requests "
                        "(default: the first of /v1/models)")
    parser.add_argument("--kinds", default="text,embeds", help="text, embeds or both")
    parser.add_argument("--num-prompts", type=int, default=32, help="per kind")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second (Poisson arrivals); inf: all at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--result-json", default=None, help="also write the report here")
    args = parser.parse_args()

    proc = None
    base_url = args.base_url
    if args.launch:
        proc, base_url = launch(args)
    try:
        results, duration = asyncio.run(replay(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    report = summarize(results, duration)
    print_report(report, duration, args)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"args": vars(args), "duration_s": duration, "report": report}, f,
                      indent=2)


if __name__ == "__main__":
    main()
