"""Every engine releases what it holds when it is deleted or shut down, so that the next
engine of the same process starts: worker processes (`mp`), Ray actors and placement
groups (`ray`, and the data-parallel engine cores placed by Ray), the ranks' shared-memory
all-reduce segment and their rendezvous port. One local Ray instance serves the module.

Each case builds an engine, notes what it holds, deletes it (`del` + gc) and checks all of
it is gone; then builds a second engine of the same kind, which must place and generate
the same tokens, shuts it down explicitly (twice: idempotent) and checks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import socket
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest
import zmq

from tests.server_utils import wait_until
from vllm import LLM, SamplingParams
from vllm._custom_ops import cpu_ops
from vllm.distributed.shm_all_reduce import SHM_DIR
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.core_client import DPAsyncMPClient

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="Ray is not installed"),
              pytest.mark.slow]  # engines of every executor: left out of `make test-fast`

PROMPTS = ["the colour of seven is", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
LOGPROB_TOL = 1e-4  # two ranks against one, as tests/test_tensor_parallel.py holds them
SMALL = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 * 2**20, seed=0,
             enforce_eager=True)


@pytest.fixture(scope="module")
def ray_module() -> Iterator[Any]:
    """A local Ray instance of 2 CPUs for the module. Restores os.environ afterwards
    (importing Ray and ray.init set variables of their own)."""
    environ = dict(os.environ)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(environ)


@dataclass
class Held:
    """What one engine holds outside this process's Python objects."""

    pids: list[int]  # the ranks' (or engine cores') processes
    executor: weakref.ref | None = None  # the in-process executor (offline engines)
    ports: list[int] = field(default_factory=list)  # rendezvous, the engines' sockets
    segments: list[str] = field(default_factory=list)  # shared-memory all-reduce
    placement_group: Any = None


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _spawned_children() -> list[int]:
    """This process's children started by multiprocessing (workers, engine cores); Ray's
    own daemons and multiprocessing's resource tracker are not."""
    pids = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()) and _alive(child.pid):
                pids.append(child.pid)
    return pids


def _shm_segments(pids: list[int]) -> list[str]:
    """The shared-memory all-reduce segments these processes map (their names are
    unlinked from /dev/shm as soon as every rank has mapped them)."""
    names = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            names.update(line.split()[5] for line in maps
                         if len(line.split()) > 5 and "vllm_allreduce_" in line)
    return sorted(names)


def _port(init_method: str) -> int:
    return int(init_method.rsplit(":", 1)[1])


def _listening(port: int) -> bool:
    return bool(_listener_pids(port))


def _listener_pids(port: int) -> set[int | None]:
    return {c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr[1] == port}


def _describe(pids: set[int | None]) -> list[str]:
    """pid, parent and command line of each process, for a failure's message."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid) if pid else None
            found.append(f"pid {pid} (parent {process.ppid() if process else None}): "
                         f"{' '.join(process.cmdline()) if process else '?'}")
        except psutil.Error as e:
            found.append(f"pid {pid}: {e!r}")
    return found


def _actor_pids(actor_class: str) -> list[int]:
    """The processes of this class's Ray actors (the local raylet is this process's child;
    an actor's process title is `ray::<class>[.<method running>]`)."""
    pids = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.cmdline()[0].startswith(f"ray::{actor_class}") and _alive(process.pid):
                pids.append(process.pid)
    return pids


def _held_offline(llm: LLM) -> Held:
    executor = llm.llm_engine.engine_core.model_executor
    backend = llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
    held = Held([], weakref.ref(executor))
    if backend == "mp":
        held.pids = [p.pid for p in executor.procs]  # type: ignore[attr-defined]
    elif backend == "ray":
        held.pids = _actor_pids("RayWorker")
        assert len(held.pids) == 2
        held.placement_group = executor.placement_group  # type: ignore[attr-defined]
    if backend != "uni":
        held.ports = [_port(executor.distributed_init_method)]  # type: ignore[attr-defined]
        assert _listening(held.ports[0])  # rank 0's torch.distributed store
        held.segments = _shm_segments(held.pids)
        if cpu_ops() is not None:  # the ranks all-reduce through shared memory
            assert len(held.segments) == 1, held.segments
    return held


def _assert_released(ray, held: Held) -> None:
    if held.executor is not None:
        assert held.executor() is None, "the executor outlived its engine"
    assert _spawned_children() == []
    wait_until(lambda: not any(map(_alive, held.pids)), f"the engine's processes {held.pids} exit")
    for name in held.segments:
        assert not os.path.exists(os.path.join(SHM_DIR, os.path.basename(name)))
    assert _shm_segments([p.pid for p in psutil.Process().children(recursive=True)]) == []
    for port in held.ports:  # nobody listens there any more: the next engine may bind it
        listeners = _listener_pids(port)
        assert not listeners & {os.getpid(), *held.pids}, _describe(listeners)
        # A dead rank's listening socket can outlive its process for a moment, owned by no
        # process (`pid None`; seen once in a two-worker run).
        wait_until(lambda: not _listening(port),  # noqa: B023 (called at once)
                   f"port {port} free (listening at first: {_describe(listeners)})")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the next engine may
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # bind it, as torch's
            s.bind(("", port))  # store does
    if held.placement_group is not None:
        table = ray.util.placement_group_table()
        assert table[held.placement_group.id.hex()]["state"] == "REMOVED"
    assert [pg for pg in ray.util.placement_group_table().values()
            if pg["state"] != "REMOVED"] == []
    wait_until(lambda: ray.available_resources().get("CPU") == 2, "Ray's cores are free again")


def _offline(backend: str, path: str) -> LLM:
    tp = 1 if backend == "uni" else 2
    return LLM(path, tensor_parallel_size=tp, distributed_executor_backend=backend, **SMALL)


Greedy = list[tuple[list[int], list[dict[int, float]]]]  # per prompt: tokens, top logprobs


def _greedy(llm: LLM) -> Greedy:
    return [(list(c.token_ids), [{t: lp.logprob for t, lp in step.items()}
                                 for step in c.logprobs or []])
            for c in (o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False))]


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir) -> Greedy:
    llm = _offline("uni", tiny_llama_dir)
    try:
        return _greedy(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("backend", ["uni", "mp", "ray"])
def test_offline_engine_releases_everything(ray_module, tiny_llama_dir, one_rank,
                                            backend) -> None:
    """`del llm` + gc, then `LLM.shutdown()`: each time every worker process, Ray actor,
    placement group, shared-memory segment and port is gone, and the next engine starts.
    Two ranks in processes (`mp`) or Ray actors in a placement group (`ray`) give what one
    rank gives: the same tokens, logprobs within LOGPROB_TOL."""
    ray = ray_module
    assert _spawned_children() == []
    llm = _offline(backend, tiny_llama_dir)
    expected = _greedy(llm)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(expected, one_rank,
                                                                 strict=True):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs, strict=True):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < LOGPROB_TOL for t in got)
    held = _held_offline(llm)
    del llm
    gc.collect()
    _assert_released(ray, held)

    llm = _offline(backend, tiny_llama_dir)  # places its ranks where the first one was
    assert _greedy(llm) == expected
    held = _held_offline(llm)
    llm.shutdown()
    llm.shutdown()
    del llm
    gc.collect()
    _assert_released(ray, held)


async def _generate(engine: AsyncLLM) -> list[list[int]]:
    async def one(index: int, prompt: str) -> list[int]:
        final = None
        async for output in engine.generate(prompt, GREEDY, f"r{index}"):
            final = output
        assert final is not None
        return list(final.outputs[0].token_ids)

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))


def _ray_data_parallel(path: str) -> AsyncLLM:
    args = EngineArgs.from_kwargs(model=path, data_parallel_size=2,
                                  distributed_executor_backend="ray", **SMALL)
    return AsyncLLM.from_engine_args(args)


def _held_ray_engines(engine: AsyncLLM) -> Held:
    client = engine.engine_core
    assert isinstance(client, DPAsyncMPClient) and client.ray_engines is not None
    pids = _actor_pids("EngineCoreActor")
    assert len(pids) == 2
    # This process binds each engine core's two sockets (TCP: the actor may be elsewhere).
    ports = [_port(sock.getsockopt_string(zmq.LAST_ENDPOINT)) for e in client.engines
             for sock in (e.input_socket, e.output_socket)]
    assert len(ports) == 4 and all(map(_listening, ports))
    return Held(pids, ports=ports, placement_group=client.ray_engines.placement_group)


def test_ray_data_parallel_engines_release_everything(ray_module, tiny_llama_dir) -> None:
    """Two engine cores in Ray actors (as `vllm serve -dp 2 --distributed-executor-backend
    ray` starts them): deleting the `AsyncLLM` kills the actors and removes their placement
    group, so a second set places and serves; its `shutdown()` releases it too."""
    ray = ray_module
    engine = _ray_data_parallel(tiny_llama_dir)
    expected = asyncio.run(_generate(engine))
    held = _held_ray_engines(engine)
    del engine
    gc.collect()
    _assert_released(ray, held)

    engine = _ray_data_parallel(tiny_llama_dir)
    assert asyncio.run(_generate(engine)) == expected
    held = _held_ray_engines(engine)
    engine.shutdown()
    engine.shutdown()
    _assert_released(ray, held)
