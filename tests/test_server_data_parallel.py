"""`vllm serve -dp 2`: two engine cores behind one server. Outputs equal one engine's,
prefixes stick to an engine, one engine's death fails only its requests, bad sizes refuse
to start. Which engine served what is read from the per-engine `/metrics` series."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from tests.server_utils import (
    SMALL_ENGINE_ARGS,
    RemoteServer,
    concurrent_completions,
    scrape_metrics,
)
from vllm import LLM, SamplingParams
from vllm.distributed.utils import engine_cpus
from vllm.engine.arg_utils import EngineArgs

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow

DP_ARGS = ["-dp", "2", *SMALL_ENGINE_ARGS]
PREFIX = " ".join(f"word{i}" for i in range(40))  # far more than two blocks of 16 tokens
# Eight sequences of 480 tokens: about a second on one engine (several with one sequence
# running at a time), long enough to still hold it while other requests are routed.
LONG = {"prompt": "hi", "max_tokens": 480, "n": 8, "ignore_eos": True, "temperature": 0.0}


def _served(server: RemoteServer) -> list[float]:
    """Requests each engine finished, whatever the reason (engine 0, engine 1)."""
    totals = [0.0, 0.0]
    for name, value in scrape_metrics(server).items():
        match = re.match(r'vllm:request_success_total\{engine="(\d)"', name)
        if match:
            totals[int(match.group(1))] += value
    return totals


def _metric(server: RemoteServer, name: str, engine: int, **labels: str) -> float:
    wanted = {"engine": str(engine), **labels}
    total = 0.0
    for sample, value in scrape_metrics(server).items():
        if sample.startswith(name + "{") and all(f'{k}="{v}"' in sample
                                                for k, v in wanted.items()):
            total += value
    return total


def _wait_running(server: RemoteServer, engines: list[int]) -> None:
    for _ in range(400):  # bounded: at most ~20 s
        if all(_metric(server, "vllm:num_requests_running", e) > 0 for e in engines):
            return
        time.sleep(0.05)
    raise AssertionError(f"engines {engines} never ran a request")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str):
    srv = RemoteServer(tiny_llama_dir, DP_ARGS)
    yield srv
    assert srv.stop() == 0, srv.final_log


def test_concurrent_requests_equal_offline(server: RemoteServer, tiny_llama_dir: str) -> None:
    """32 concurrent greedy requests: the same tokens as one offline engine, and both
    engines served some (no shared prefix: routed by load)."""
    prompts = [f"request {i}: the colour of {i * 7} is" for i in range(32)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=512,
                  kv_cache_memory_bytes=64 * 2**20, seed=0, enforce_eager=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    before = _served(server)

    assert concurrent_completions(server, tiny_llama_dir, prompts) == expected
    after = _served(server)
    grew = [a - b for a, b in zip(after, before)]
    assert sum(grew) == 32 and min(grew) > 0, grew


def test_shared_prefix_sticks_to_its_engine(server: RemoteServer, tiny_llama_dir: str) -> None:
    """A long request holds engine 0, so the first prefix request goes to engine 1; once
    both are idle (a tie the router would break towards engine 0), the prefix's later
    requests still go to engine 1, where it is cached."""
    body = {"model": tiny_llama_dir, "max_tokens": 2, "temperature": 0.0}
    before = _served(server)
    hits_before = _metric(server, "vllm:prefix_cache_hits_total", 1)
    background = threading.Thread(target=lambda: httpx.post(
        f"{server.url}/v1/completions", json={"model": tiny_llama_dir, **LONG}, timeout=120))
    background.start()
    _wait_running(server, [0])
    httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": PREFIX + " a"},
               timeout=60).raise_for_status()
    background.join(120)
    for suffix in ("b", "c", "d", "e"):
        httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": f"{PREFIX} {suffix}"},
                   timeout=60).raise_for_status()
    after = _served(server)
    assert [a - b for a, b in zip(after, before)] == [8, 5]  # the long one's 8 sequences
    assert _metric(server, "vllm:prefix_cache_hits_total", 1) - hits_before >= 4 * 32


def test_one_engine_dies_the_other_serves(tiny_llama_dir: str) -> None:
    """Kill one of two engine cores while each runs a request: that request fails with a
    500 naming its engine, the other finishes, /health is 503 naming the dead engine, and
    new requests are served by the live one."""
    server = RemoteServer(tiny_llama_dir, [*DP_ARGS, "--max-num-seqs", "1"])
    try:
        results: list[httpx.Response] = []

        def long_request() -> None:
            results.append(httpx.post(f"{server.url}/v1/completions", timeout=120,
                                      json={"model": tiny_llama_dir, **LONG}))

        threads = [threading.Thread(target=long_request) for _ in range(2)]
        for thread in threads:
            thread.start()
            time.sleep(0.2)  # the first is in flight before the second is routed
        _wait_running(server, [0, 1])
        victim = server.engine_core_pids()[0]
        os.kill(victim, signal.SIGKILL)
        for thread in threads:
            thread.join(120)
        codes = sorted(r.status_code for r in results)
        assert codes == [200, 500], [r.text for r in results]
        failed = next(r for r in results if r.status_code == 500)
        dead = re.search(r"Engine core (\d)", failed.json()["error"]["message"])
        assert dead is not None, failed.text
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503
        assert f"Engine core {dead.group(1)}" in health.json()["error"]["message"]
        for i in range(4):
            ok = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": tiny_llama_dir, "prompt": f"after {i}", "max_tokens": 3})
            assert ok.status_code == 200, ok.text
        live = 1 - int(dead.group(1))
        assert _metric(server, "vllm:request_success_total", live,
                       finished_reason="length") == 8 + 4
        lost = int(dead.group(1))  # its sequences not finished when it died are errors
        assert _metric(server, "vllm:request_success_total", lost, finished_reason="error") > 0
        assert _served(server)[lost] == 8
    finally:
        assert server.stop() == 0, server.final_log


@pytest.mark.parametrize("size", [0, len(os.sched_getaffinity(0)) + 1])
def test_bad_data_parallel_size_refuses_to_start(tiny_llama_dir: str, size: int) -> None:
    with pytest.raises(RuntimeError) as info:
        RemoteServer(tiny_llama_dir, ["-dp", str(size), *SMALL_ENGINE_ARGS])
    log = str(info.value)
    assert ("data_parallel_size must be a positive integer" in log if size == 0
            else "need a core each" in log), log


def test_offline_llm_refuses_data_parallel(tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match="vllm serve MODEL --data-parallel-size 2"):
        LLM(tiny_llama_dir, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        EngineArgs(model=tiny_llama_dir, data_parallel_size=0).create_engine_config()


def test_engine_cpus() -> None:
    assert engine_cpus(None, 0, 1) is None  # one engine: unbound
    assert engine_cpus("all", 1, 2) is None
    assert engine_cpus("0-3|4-7", 1, 2) == (4, 5, 6, 7)
    assert engine_cpus("0-1|2-3|4-5|6-7", 1, 2, tp_size=2) == (4, 5, 6, 7)  # ranks 2, 3
    available = sorted(os.sched_getaffinity(0))
    if len(available) >= 2:
        halves = engine_cpus("auto", 0, 2), engine_cpus("auto", 1, 2)
        per = len(available) // 2
        assert halves == (tuple(available[:per]), tuple(available[per:2 * per]))
