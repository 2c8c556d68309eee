"""The one-request measurements of `benchmark_peers.py --single`, shared by the drivers of
this engine and of llama.cpp (each imports it from its own interpreter: standard library
only).

A driver supplies `generate(token_ids, max_tokens, speculative) -> iterator of token ids`
(greedy, ignoring EOS, a fresh cache every call: no prefix reuse) and gets back one JSON
line per measurement, best of the spec's repeats:

    {"metric": "decode", "value": tok/s}     128-token prompt, tokens after the first / time
    {"metric": "ttft", "value": seconds}     the long prompt's time to its first token
    {"metric": "copy", "value": tok/s}       the copy-heavy prompt, all output tokens / time
    {"metric": "copy_spec", "value": tok/s}  the same with prompt-lookup speculation
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

Generate = Callable[[list[int], int, bool], Iterator[int]]


def timed(generate: Generate, prompt: list[int], max_tokens: int,
          speculative: bool = False) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the last, tokens) of one request."""
    start = time.perf_counter()
    first = None
    count = 0
    for _ in generate(prompt, max_tokens, speculative):
        count += 1
        if first is None:
            first = time.perf_counter() - start
        if count == max_tokens:
            break
    total = time.perf_counter() - start
    return (first if first is not None else total), total, count


def measure(spec: dict, generate: Generate) -> None:
    """Prints the JSON lines above for `spec` (the benchmark's workload file)."""
    repeats = spec.get("repeats", 1)
    output_len = spec["output_len"]
    timed(generate, spec["decode_prompt"], 8)  # warm-up

    def best(metric: str, run: Callable[[], float], larger_is_better: bool = True) -> None:
        values = [run() for _ in range(repeats)]
        value = max(values) if larger_is_better else min(values)
        print(json.dumps({"metric": metric, "value": value}), flush=True)

    def decode() -> float:
        first, total, count = timed(generate, spec["decode_prompt"], output_len)
        return (count - 1) / (total - first)

    def ttft() -> float:
        return timed(generate, spec["long_prompt"], 1)[0]

    def copy(speculative: bool) -> float:
        _, total, count = timed(generate, spec["copy_prompt"], spec["copy_output_len"],
                                speculative)
        return count / total

    best("decode", decode)
    best("ttft", ttft, larger_is_better=False)
    best("copy", lambda: copy(False))
    best("copy_spec", lambda: copy(True))
