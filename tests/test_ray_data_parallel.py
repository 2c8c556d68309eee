"""`vllm serve -dp 2 --distributed-executor-backend ray`: the engine cores in Ray actors of a
local Ray instance started here (one machine: the sockets are TCP on this machine's address
all the same). Outputs equal offline greedy outputs; a killed actor fails only its own
request, /health names it, the other engine serves on; stopping the server frees the
actors and the placement group. The engine side of liveness (`PeerWatch`) without Ray."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import zmq

from tests.server_utils import (
    SMALL_ENGINE_ARGS,
    RemoteServer,
    concurrent_completions,
    wait_until,
)
from tests.test_server_data_parallel import LONG, _metric, _wait_running
from vllm import LLM, SamplingParams
from vllm.v1.engine.core_proc import PeerWatch

# End to end (engines or servers): left out of `make test-fast`.
pytestmark = pytest.mark.slow


def test_peer_watch_sees_the_api_process_go() -> None:
    """Alive while the bound end is there (and before it ever connected, for the grace);
    gone `grace_s` after it closes."""
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.PULL)
        server.setsockopt(zmq.LINGER, 0)
        server.bind("tcp://127.0.0.1:*")
        client = ctx.socket(zmq.PUSH)
        client.setsockopt(zmq.LINGER, 0)
        watch = PeerWatch(client, grace_s=0.5)
        assert watch.alive()  # not connected yet, within the grace
        client.connect(server.getsockopt_string(zmq.LAST_ENDPOINT))
        wait_until(lambda: watch.connected, "connected")
        time.sleep(0.6)
        assert watch.alive()  # connected for longer than the grace
        server.close()
        wait_until(lambda: not watch.connected, "disconnected")
        assert watch.alive()  # a short outage is forgiven
        wait_until(lambda: not watch.alive(), "gone after the grace")
    finally:
        ctx.destroy(linger=0)


def _engine_actors(ray) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("EngineCore_"))


@contextlib.contextmanager
def _ray_instance() -> Iterator[tuple[Any, dict[str, str]]]:
    """A local Ray instance of 2 CPUs; yields `ray` and the env that points a server at it.
    Restores os.environ afterwards (importing Ray and ray.init set variables of their own)."""
    environ = dict(os.environ)
    import ray

    context: Any = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray, {"RAY_ADDRESS": context.address_info["address"]}
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environ)


RAY_DP_ARGS = ["-dp", "2", "--distributed-executor-backend", "ray", *SMALL_ENGINE_ARGS]
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed")


@needs_ray
def test_ray_placed_engines_serve_and_fail_alone(tiny_llama_dir: str) -> None:
    """Two engine actors, one bundle each: concurrent greedy requests equal offline and both
    engines serve; killing engine 0's actor mid-request fails that request only (500 naming
    it), /health is 503 naming it, engine 1 serves on; a clean stop frees actors and cores."""
    prompts = [f"request {i}: the colour of {i * 7} is" for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = LLM(tiny_llama_dir, dtype="float32", max_model_len=512,
                  kv_cache_memory_bytes=64 * 2**20, seed=0, enforce_eager=True)
    expected = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False)]
    del offline

    server = None
    with _ray_instance() as (ray, env):
        try:
            server = RemoteServer(tiny_llama_dir, [*RAY_DP_ARGS, "--max-num-seqs", "1"], env)
            actors = _engine_actors(ray)
            assert [name.rsplit("_", 1)[0] for name in actors] == ["EngineCore_0", "EngineCore_1"]
            assert server.engine_core_pids() == []  # no local engine processes
            assert ray.available_resources().get("CPU", 0) == 0  # one bundle per engine

            assert concurrent_completions(server, tiny_llama_dir, prompts) == expected
            served = [_metric(server, "vllm:request_success_total", e) for e in (0, 1)]
            assert sum(served) == 16 and min(served) > 0, served

            # Kill engine 0's actor while each engine runs a long request.
            results: list[httpx.Response] = []

            def long_request() -> None:
                results.append(httpx.post(f"{server.url}/v1/completions", timeout=120,
                                          json={"model": tiny_llama_dir, **LONG}))

            threads = [threading.Thread(target=long_request) for _ in range(2)]
            for thread in threads:
                thread.start()
                time.sleep(0.2)
            _wait_running(server, [0, 1])
            ray.kill(ray.get_actor(actors[0], namespace="vllm"))
            for thread in threads:
                thread.join(120)
            codes = sorted(r.status_code for r in results)
            assert codes == [200, 500], [r.text for r in results]
            failed = next(r for r in results if r.status_code == 500)
            assert re.search(r"Engine core 0 actor died", failed.json()["error"]["message"]), \
                failed.text
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 503
            assert "Engine core 0" in health.json()["error"]["message"]
            before = _metric(server, "vllm:request_success_total", 1)
            for i in range(3):
                ok = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                    "model": tiny_llama_dir, "prompt": f"after {i}", "max_tokens": 3})
                assert ok.status_code == 200, ok.text
            assert _metric(server, "vllm:request_success_total", 1) == before + 3

            assert server.stop() == 0, server.final_log
            wait_until(lambda: _engine_actors(ray) == [], "the actors are gone")
            wait_until(lambda: ray.available_resources().get("CPU", 0) == 2,
                   "the placement group is removed")
        finally:
            if server is not None:
                server.stop()


@needs_ray
def test_engine_actors_end_with_the_api_server(tiny_llama_dir: str) -> None:
    """The API server killed outright: its engine actors go, their cores are free again.
    (Ray's own fate-sharing of a driver's actors is the first to act here; `PeerWatch`,
    tested above, is the engine's check that does not depend on Ray.)"""
    with _ray_instance() as (ray, env):
        server = RemoteServer(tiny_llama_dir, RAY_DP_ARGS, env)
        try:
            assert len(_engine_actors(ray)) == 2
            os.kill(server.proc.pid, signal.SIGKILL)
            wait_until(lambda: _engine_actors(ray) == [], "the actors are gone", tries=600)
            wait_until(lambda: ray.available_resources().get("CPU", 0) == 2, "the cores are free",
                   tries=600)
        finally:
            server.stop()
