"""`AsyncMPClient`: the API process's handle on an engine core running in another process.

The client spawns the process (`core_proc.run_engine_core`), waits for its handshake, and
then talks to it over two ZMQ sockets with msgpack (see `wire` for the framing). Only the
child imports the engine (`core_proc`): this process loads neither the runner nor models. A
reader task sorts incoming messages: step outputs go to a queue that `AsyncLLM` drains,
utility results resolve the future of their call. The process sentinel is watched by the
event loop, so an engine that dies (or is killed) turns into `EngineDeadError` for every
waiter instead of a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from vllm.config import VllmConfig
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
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

logger = logging.getLogger(__name__)


def _engine_core_main(*args: Any) -> None:
    """The child's entry point; importing the engine happens there, not here."""
    from vllm.v1.engine.core_proc import run_engine_core

    run_engine_core(*args)


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can make progress."""


def _stop_process(proc: BaseProcess, ctx: zmq.Context, tmpdir: str) -> None:
    """Terminates the engine process and frees the sockets (also run at interpreter exit)."""
    if proc.is_alive():
        proc.terminate()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


class AsyncMPClient:
    """Engine core in a background process, driven from an asyncio event loop.

    Args:
        vllm_config: the resolved config; the child builds its own `EngineCore` from it.
    Attributes:
        num_blocks: KV cache blocks the engine core allocated.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="vllm-engine-")
        input_addr = f"ipc://{os.path.join(self.tmpdir, 'input')}"
        output_addr = f"ipc://{os.path.join(self.tmpdir, 'output')}"
        self.ctx = zmq.asyncio.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(input_addr)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(output_addr)

        mp = multiprocessing.get_context("spawn")
        reader, writer = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=_engine_core_main, name="EngineCore",
                               args=(vllm_config, input_addr, output_addr, writer, os.getpid()))
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self.ctx, self.tmpdir)
        try:
            self.proc.start()
            writer.close()
            self.num_blocks = self._wait_ready(reader)
        except BaseException:
            self._finalizer()
            raise
        finally:
            writer.close()
            reader.close()

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

    def _wait_ready(self, reader: Any) -> int:
        ready = wait([reader, self.proc.sentinel])
        if reader not in ready:
            self.proc.join(5)
            raise RuntimeError(f"The engine core process exited with code "
                               f"{self.proc.exitcode} before it was ready.")
        try:
            message = msgspec.msgpack.decode(reader.recv_bytes())
        except EOFError:
            raise RuntimeError("The engine core process exited before it was ready.") from None
        if message.get("status") != "ready":
            raise RuntimeError(f"The engine core failed to start: {message.get('error')}")
        return int(message["num_blocks"])

    # ---- lifecycle ------------------------------------------------------------------

    def _ensure_started(self) -> None:
        """Starts the reader task and the death watch on the running event loop."""
        if self._reader_task is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.outputs_queue = asyncio.Queue()
        self._reader_task = self._loop.create_task(self._read_outputs())
        self._loop.add_reader(self.proc.sentinel, self._on_process_exit)
        if not self.proc.is_alive():
            self._on_process_exit()

    def _on_process_exit(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.proc.sentinel)
        if not self._closing:
            self.proc.join(1)
            self._set_dead(f"The engine core process exited unexpectedly (exit code "
                           f"{self.proc.exitcode}).")

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
        return self.dead_error is None and self.proc.is_alive()

    def shutdown(self) -> None:
        self._closing = True
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.proc.sentinel)
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
            self._set_dead(f"Reading engine-core outputs failed: {type(e).__name__}: {e}")

    def _dispatch(self, kind: bytes, body: list) -> None:
        assert self.outputs_queue is not None  # the reader runs once started
        if kind == OUT_OUTPUTS:
            self.outputs_queue.put_nowait(self.outputs_decoder.decode(body))
        elif kind == OUT_UTILITY_RESULT:
            self._resolve_call(self.utility_decoder.decode(body))
        elif kind == OUT_ENGINE_DEAD:
            self._set_dead(f"The engine core died: {self.dead_decoder.decode(body).message}")
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
        item = await self.outputs_queue.get()
        if isinstance(item, Exception):
            self.outputs_queue.put_nowait(item)  # every later call fails the same way
            raise item
        return item

    # ---- inputs ---------------------------------------------------------------------

    async def _send(self, kind: bytes, obj: Any) -> None:
        self._ensure_started()
        if self.dead_error is not None:
            raise self.dead_error
        await self.input_socket.send_multipart([kind, *self.encoder.encode(obj)], copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(REQ_ADD, request)

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
