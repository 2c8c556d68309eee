"""`AsyncMPClient`: the API process's handle on an engine core running in another process.

The client spawns the process (`core_proc.run_engine_core`), waits for its handshake, and
then talks to it over two ZMQ sockets with msgpack (see `wire` for the framing). Only the
child imports the engine (`core_proc`): this process loads neither the runner nor models. A
reader task sorts incoming messages: step outputs go to a queue that `AsyncLLM` drains,
utility results resolve the future of their call. The process sentinel is watched by the
event loop, so an engine that dies (or is killed) turns into `EngineDeadError` for every
waiter instead of a hang.

`DPAsyncMPClient` (data parallel) holds several of them behind the same calls: requests
routed by `dp_router`, outputs merged, one engine's death reported as `EngineLost`. With the
`ray` backend its engine cores run in Ray actors (`ray_engines`), maybe on other machines:
the sockets are then TCP on this machine's address, and a failed actor call stands in for
the process sentinel. `EngineProcess` and `ray_engines.RayEngine` are the two handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from vllm.config import VllmConfig
from vllm.distributed.utils import engine_cpus
from vllm.platforms.openmp import openmp_spin_count
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.dp_router import PrefixAffinityRouter, prefix_block_hashes
from vllm.v1.engine.wire import (
    OUT_ENGINE_DEAD,
    OUT_OUTPUTS,
    OUT_UTILITY_RESULT,
    REQ_ABORT,
    REQ_ADD,
    REQ_STOP,
    REQ_UTILITY,
    EngineDead,
    UtilityCall,
    UtilityResult,
)
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

if TYPE_CHECKING:
    from vllm.v1.engine.ray_engines import RayEngines

logger = logging.getLogger(__name__)


def _engine_core_main(*args: Any) -> None:
    """The child's entry point; importing the engine happens there, not here."""
    from vllm.v1.engine.core_proc import run_engine_core

    run_engine_core(*args)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can make progress."""


class EngineHandle(Protocol):
    """Where an engine core runs: started, ready or not, alive or not, stopped."""

    def wait_ready(self) -> int:
        """Waits for the handshake; returns the KV cache blocks, raises RuntimeError."""
        ...

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        """Calls `on_exit` on `loop` once the engine core is gone."""
        ...

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None: ...

    def is_alive(self) -> bool: ...

    def exit_message(self) -> str:
        """Why the engine core is gone (after `on_exit`)."""
        ...

    def stop(self) -> None: ...


class EngineProcess:
    """An engine core in a spawned local process: the handshake comes over a pipe, its
    death is the process sentinel."""

    def __init__(self, vllm_config: VllmConfig, name: str, input_addr: str,
                 output_addr: str) -> None:
        self.name = name
        mp = multiprocessing.get_context("spawn")
        self._ready_reader, writer = mp.Pipe(duplex=False)
        index = vllm_config.parallel_config.data_parallel_rank
        self.proc = mp.Process(target=_engine_core_main, name=f"EngineCore_{index}",
                               args=(vllm_config, input_addr, output_addr, writer, os.getpid()))
        try:
            with openmp_spin_count():  # read when the new process loads torch
                self.proc.start()
        except BaseException:
            self._ready_reader.close()
            raise
        finally:
            writer.close()

    def wait_ready(self) -> int:
        try:
            ready = wait([self._ready_reader, self.proc.sentinel])
            if self._ready_reader not in ready:
                self.proc.join(5)
                raise RuntimeError(f"{self.name} process exited with code "
                                   f"{self.proc.exitcode} before it was ready.")
            try:
                message = msgspec.msgpack.decode(self._ready_reader.recv_bytes())
            except EOFError:
                raise RuntimeError(f"{self.name} process exited before it was ready.") from None
        finally:
            self._ready_reader.close()
        if message.get("status") != "ready":
            raise RuntimeError(f"{self.name} failed to start: {message.get('error')}")
        return int(message["num_blocks"])

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        loop.add_reader(self.proc.sentinel, on_exit)
        if not self.proc.is_alive():
            on_exit()

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.remove_reader(self.proc.sentinel)

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def exit_message(self) -> str:
        self.proc.join(1)
        return (f"{self.name} process exited unexpectedly (exit code "
                f"{self.proc.exitcode}).")

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


def _stop_engine(handle: EngineHandle, ctx: zmq.Context, sockets: list[zmq.Socket],
                 tmpdir: str | None) -> None:
    """Stops the engine core and frees the sockets (also run at interpreter exit). The
    sockets are closed by name: when the client is collected as part of a reference cycle,
    the context has already lost track of them, and ending it would wait for them forever."""
    handle.stop()
    for socket in sockets:
        socket.close(linger=0)
    ctx.destroy(linger=0)
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _weak_callback(method: Callable[[], None]) -> Callable[[], None]:
    """`method` called through a weak reference to its object: a watch that outlives the
    client (a Ray `run` call pending until its actor dies) must not keep the client, its
    sockets and its finalizer alive."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        bound = ref()
        if bound is not None:
            bound()

    return call


def _bind(socket: zmq.Socket, address: str) -> str:
    """Binds `socket`; returns the address bound (the port a `tcp://IP:*` got)."""
    socket.bind(address)
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class AsyncMPClient:
    """Engine core in a background process, driven from an asyncio event loop.

    Args:
        vllm_config: the resolved config; the child builds its own `EngineCore` from it.
        engine_index: this engine's data-parallel rank (names it in errors and outputs).
        wait_ready: wait for the engine's handshake now; False lets a caller start several
            engines before waiting for each (`wait_ready()`).
        ray_engines: start the engine core in a Ray actor from these (data parallel with
            the `ray` backend) instead of a local process.
    Attributes:
        num_blocks: KV cache blocks the engine core allocated.
    """

    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0,
                 wait_ready: bool = True, ray_engines: RayEngines | None = None) -> None:
        self.engine_index = engine_index
        self.name = ("The engine core" if vllm_config.parallel_config.data_parallel_size == 1
                     else f"Engine core {engine_index}")
        self.ctx = zmq.asyncio.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.tmpdir: str | None = None
        try:
            if ray_engines is None:  # the engine core on this machine: Unix sockets
                self.tmpdir = tempfile.mkdtemp(prefix="vllm-engine-")
                input_addr = _bind(self.input_socket,
                                   f"ipc://{os.path.join(self.tmpdir, 'input')}")
                output_addr = _bind(self.output_socket,
                                    f"ipc://{os.path.join(self.tmpdir, 'output')}")
                self.handle: EngineHandle = EngineProcess(vllm_config, self.name, input_addr,
                                                          output_addr)
            else:  # maybe on another machine: TCP on this one's address, any free port
                input_addr = _bind(self.input_socket, f"tcp://{ray_engines.node_ip}:*")
                output_addr = _bind(self.output_socket, f"tcp://{ray_engines.node_ip}:*")
                self.handle = ray_engines.start(vllm_config, self.name, input_addr,
                                                output_addr)
        except BaseException:  # nothing started: free the sockets
            self.ctx.destroy(linger=0)
            if self.tmpdir is not None:
                shutil.rmtree(self.tmpdir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _stop_engine, self.handle, self.ctx,
                                           [self.input_socket, self.output_socket],
                                           self.tmpdir)
        self.num_blocks = 0
        self.encoder = MsgpackEncoder()
        self.outputs_decoder = MsgpackDecoder(EngineCoreOutputs)
        self.utility_decoder = MsgpackDecoder(UtilityResult)
        self.dead_decoder = MsgpackDecoder(EngineDead)
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | Exception] | None = None
        self.dead_error: EngineDeadError | None = None
        self._reader_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._closing = False
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Waits for the engine's handshake; raises (and stops the engine) if it failed."""
        try:
            self.num_blocks = self.handle.wait_ready()
        except BaseException:
            self._finalizer()
            raise

    # ---- lifecycle ------------------------------------------------------------------

    def _ensure_started(self) -> None:
        """Starts the reader task and the death watch on the running event loop."""
        if self._reader_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.outputs_queue = asyncio.Queue()
        self._reader_task = self._loop.create_task(self._read_outputs())
        self.handle.watch(self._loop, _weak_callback(self._on_engine_exit))

    def _on_engine_exit(self) -> None:
        if self._loop is not None:
            self.handle.unwatch(self._loop)
        if not self._closing:
            self._set_dead(self.handle.exit_message())

    def _set_dead(self, message: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("%s", message)
        self.dead_error = EngineDeadError(message)
        if self.outputs_queue is not None:
            self.outputs_queue.put_nowait(self.dead_error)
        for future in self._pending_calls.values():
            if not future.done():
                future.set_exception(self.dead_error)
        self._pending_calls.clear()

    def is_alive(self) -> bool:
        return self.dead_error is None and self.handle.is_alive()

    @property
    def engines(self) -> list[AsyncMPClient]:
        """The engine cores behind this client: this one (`DPAsyncMPClient` has several)."""
        return [self]

    def dead_engines(self) -> list[EngineDeadError]:
        """Why each engine core that is gone is gone (empty while it runs)."""
        if self.is_alive():
            return []
        return [self.dead_error or EngineDeadError(f"{self.name} is not running.")]

    def shutdown(self) -> None:
        self._closing = True
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self.handle.unwatch(self._loop)
        self._finalizer()

    # ---- outputs --------------------------------------------------------------------

    async def _read_outputs(self) -> None:
        try:
            while True:
                frames = await self.output_socket.recv_multipart(copy=False)
                self._dispatch(frames[0].bytes, [f.buffer for f in frames[1:]])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a reader that stops silently would hang every request
            logger.exception("Reading engine-core outputs failed.")
            self._set_dead(f"Reading the outputs of {self.name.lower()} failed: "
                           f"{type(e).__name__}: {e}")

    def _dispatch(self, kind: bytes, body: list) -> None:
        assert self.outputs_queue is not None  # the reader runs once started
        if kind == OUT_OUTPUTS:
            outputs = self.outputs_decoder.decode(body)
            outputs.engine_index = self.engine_index
            self.outputs_queue.put_nowait(outputs)
        elif kind == OUT_UTILITY_RESULT:
            self._resolve_call(self.utility_decoder.decode(body))
        elif kind == OUT_ENGINE_DEAD:
            self._set_dead(f"{self.name} died: {self.dead_decoder.decode(body).message}")
        else:
            logger.error("Ignoring an engine-core output of unknown kind %r.", kind)

    def _resolve_call(self, result: UtilityResult) -> None:
        future = self._pending_calls.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.result)

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next step's outputs; raises `EngineDeadError` once the engine is gone."""
        self._ensure_started()
        assert self.outputs_queue is not None
        return await _next_output(self.outputs_queue)

    # ---- inputs ---------------------------------------------------------------------

    async def _send(self, kind: bytes, obj: Any) -> None:
        self._ensure_started()
        if self.dead_error is not None:
            raise self.dead_error
        await self.input_socket.send_multipart([kind, *self.encoder.encode(obj)], copy=False)

    async def add_request_async(self, request: EngineCoreRequest,
                                engine_index: int | None = None) -> int:
        """Sends a request; returns the engine it went to (this one; see `DPAsyncMPClient`)."""
        if engine_index not in (None, self.engine_index):
            raise ValueError(f"data_parallel_rank {engine_index} is out of range: this "
                             "server runs one engine core.")
        await self._send(REQ_ADD, request)
        return self.engine_index

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            await self._send(REQ_ABORT, list(request_ids))

    async def stop_requests_async(self, request_ids: list[str]) -> None:
        """Requests a stop string finished here; the core still sends their rows if asked."""
        if request_ids and self.dead_error is None:
            await self._send(REQ_STOP, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        assert self._loop is not None
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._pending_calls[call_id] = future
        try:
            await self._send(REQ_UTILITY, UtilityCall(call_id, method, list(args)))
        except BaseException:
            self._pending_calls.pop(call_id, None)
            raise
        return await future

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")


# ---- data parallel ------------------------------------------------------------------


@dataclass(slots=True)
class EngineLost:
    """One of several engine cores died; the others serve on. The requests it held fail
    with `error`."""

    engine_index: int
    error: EngineDeadError


def engine_config(vllm_config: VllmConfig, engine_index: int) -> VllmConfig:
    """The config of data-parallel engine `engine_index`: its rank, and on CPU its cores."""
    parallel = vllm_config.parallel_config
    cpu_ids = None
    if vllm_config.device_config.device == "cpu":
        cpu_ids = engine_cpus(os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), engine_index,
                              parallel.data_parallel_size, parallel.tensor_parallel_size)
    return dataclasses.replace(vllm_config, parallel_config=dataclasses.replace(
        parallel, data_parallel_rank=engine_index, cpu_ids=cpu_ids))


class DPAsyncMPClient:
    """`data_parallel_size` engine cores, each an `AsyncMPClient`, behind one interface.

    Each request goes to the engine `PrefixAffinityRouter` picks (or the one asked for);
    the outputs of all engines merge into one queue, each `EngineCoreOutputs` naming its
    engine. An engine that dies becomes one `EngineLost` in that queue: its requests fail,
    the router skips it, the others serve on. Once every engine is gone,
    `get_output_async` raises `EngineDeadError` as a single engine's client does.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        num_engines = vllm_config.parallel_config.data_parallel_size
        self.engines: list[AsyncMPClient] = []
        self._forwarders: list[asyncio.Task] = []
        self.ray_engines: RayEngines | None = None
        if vllm_config.parallel_config.distributed_executor_backend == "ray":
            from vllm.v1.engine.ray_engines import RayEngines

            self.ray_engines = RayEngines(vllm_config)
        try:  # start every engine, then wait for each: they load in parallel
            for index in range(num_engines):
                config = (engine_config(vllm_config, index) if self.ray_engines is None
                          else self.ray_engines.engine_config(vllm_config, index))
                self.engines.append(AsyncMPClient(config, index, wait_ready=False,
                                                  ray_engines=self.ray_engines))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(engine.num_blocks for engine in self.engines)
        self.block_size = vllm_config.cache_config.block_size
        self.router = PrefixAffinityRouter(num_engines, self.num_blocks)
        self.loads = [0] * num_engines  # requests in flight per engine
        self._request_engine: dict[str, int] = {}
        self._lost: dict[int, EngineDeadError] = {}
        self.outputs_queue: asyncio.Queue[EngineCoreOutputs | EngineLost | Exception] | None \
            = None

    # ---- health ---------------------------------------------------------------------

    def is_alive(self) -> bool:
        """Some engine core can still serve."""
        return any(engine.is_alive() for engine in self.engines)

    def dead_engines(self) -> list[EngineDeadError]:
        return [error for engine in self.engines for error in engine.dead_engines()]

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set once every engine core is gone."""
        if self.is_alive():
            return None
        return EngineDeadError("Every engine core is gone: " + " ".join(
            str(error) for error in self.dead_engines()))

    def shutdown(self) -> None:
        for task in self._forwarders:
            task.cancel()
        for engine in self.engines:
            engine.shutdown()
        if self.ray_engines is not None:
            self.ray_engines.shutdown()

    # ---- outputs --------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self.outputs_queue is not None:
            return
        loop = asyncio.get_running_loop()
        self.outputs_queue = asyncio.Queue()
        self._forwarders = [loop.create_task(self._forward(engine)) for engine in self.engines]

    async def _forward(self, engine: AsyncMPClient) -> None:
        """Moves one engine's outputs to the shared queue until the engine is gone."""
        assert self.outputs_queue is not None  # started before the forwarders
        while True:
            try:
                outputs = await engine.get_output_async()
            except EngineDeadError as e:
                self._lose(engine.engine_index, e)
                return
            for output in outputs.outputs:
                if output.finished:
                    self._untrack(output.request_id)
            self.outputs_queue.put_nowait(outputs)

    def _lose(self, index: int, error: EngineDeadError) -> None:
        assert self.outputs_queue is not None
        self._lost[index] = error
        self.router.forget(index)
        for request_id in [r for r, e in self._request_engine.items() if e == index]:
            self._untrack(request_id)
        self.outputs_queue.put_nowait(EngineLost(index, error))
        if len(self._lost) == len(self.engines):
            self.outputs_queue.put_nowait(EngineDeadError(
                "Every engine core is gone: " + " ".join(map(str, self._lost.values()))))

    async def get_output_async(self) -> EngineCoreOutputs | EngineLost:
        """The next outputs of any engine, or the loss of one; raises `EngineDeadError`
        once all are gone."""
        self._ensure_started()
        assert self.outputs_queue is not None
        return await _next_output(self.outputs_queue)

    # ---- inputs ---------------------------------------------------------------------

    async def add_request_async(self, request: EngineCoreRequest,
                                engine_index: int | None = None) -> int:
        """Sends a request to `engine_index`, or where the router says; returns the engine.
        Raises EngineDeadError if that engine (or every engine) is gone."""
        self._ensure_started()
        if engine_index is None:
            alive = [engine.is_alive() and i not in self._lost
                     for i, engine in enumerate(self.engines)]
            if not any(alive):
                raise self.dead_error or EngineDeadError("No engine core is alive.")
            hashes = prefix_block_hashes(request, self.block_size)
            engine_index = self.router.choose(hashes, self.loads, alive)
            self.router.record(engine_index, hashes)
        elif not 0 <= engine_index < len(self.engines):
            raise ValueError(f"data_parallel_rank {engine_index} is out of range: this "
                             f"server runs {len(self.engines)} engine cores.")
        await self.engines[engine_index].add_request_async(request)
        if engine_index in self._lost:  # it died while the request was being sent
            raise self._lost[engine_index]
        self._request_engine[request.request_id] = engine_index
        self.loads[engine_index] += 1
        return engine_index

    def _untrack(self, request_id: str) -> int | None:
        index = self._request_engine.pop(request_id, None)
        if index is not None:
            self.loads[index] -= 1
        return index

    def _by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Forgets the requests, grouped by the live engine that holds them."""
        groups: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self._untrack(request_id)
            if index is not None and self.engines[index].is_alive():
                groups.setdefault(index, []).append(request_id)
        return groups

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for index, ids in self._by_engine(request_ids).items():
            await self.engines[index].abort_requests_async(ids)

    async def stop_requests_async(self, request_ids: list[str]) -> None:
        for index, ids in self._by_engine(request_ids).items():
            await self.engines[index].stop_requests_async(ids)

    async def reset_prefix_cache_async(self) -> bool:
        """Resets every live engine's prefix cache (True if all succeeded)."""
        self.router.forget()
        results = [await engine.reset_prefix_cache_async()
                   for engine in self.engines if engine.is_alive()]
        return all(results)


async def _next_output(queue: asyncio.Queue) -> Any:
    """The queue's next item; an exception is raised, and left for every later call."""
    item = await queue.get()
    if isinstance(item, Exception):
        queue.put_nowait(item)
        raise item
    return item
