"""The engine core in its own process: a ZMQ-fed loop around `EngineCore`.

The framing of both sockets is in `vllm.v1.engine.wire`. Bodies are msgpack
(`vllm.v1.serial_utils`); nothing on these sockets is pickled. The start-up handshake
(ready, or the error that stopped the engine from starting) goes over a one-way
multiprocessing pipe as msgpack bytes.

The process never outlives the API process that started it: the loop checks its parent
before every step (not only when idle), sends give up on a peer that is gone instead of
blocking, and a watchdog thread ends the process if the loop itself is stuck (a long
step, a full send queue) a few seconds after the parent died. An engine core in a Ray actor
(`ray_engines`) may be on another machine than the API process, so there "the parent" is
the API process's end of the output socket (`PeerWatch`) instead of a process id.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import zmq
import zmq.utils.monitor

from vllm.config import VllmConfig
from vllm.lora.request import LoRARequest
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from vllm.v1.engine.core import EngineCore
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

# How often an idle engine checks that the API process is still alive.
_IDLE_POLL_MS = 1000
# A send waits this long for room in the queue before checking that the peer still lives.
_SEND_TIMEOUT_MS = 1000
# The watchdog ends the process this long after the parent died if the loop has not.
_WATCHDOG_GRACE_S = 3.0
# A remote API process is gone once its end of the output socket has been disconnected
# (or never connected) for this long; ZMQ reconnects by itself after a short outage.
_PEER_GRACE_S = 5.0


class ParentGone(Exception):
    """The API process that started this engine core is gone."""


class ParentWatch:
    """Is the parent still alive? Checked by the loop each step and by a watchdog thread
    that ends the process (`os._exit`) if the loop does not notice in time.

    Args:
        alive: the check; it runs before every step, so it must be cheap (`parent_pid` for
            a local parent, `PeerWatch.alive` for a remote one).
    """

    def __init__(self, alive: Callable[[], bool]) -> None:
        self.alive = alive

    @classmethod
    def of_pid(cls, parent_pid: int) -> ParentWatch:
        # Once the parent dies this process is re-parented, so its parent id changes.
        return cls(lambda: os.getppid() == parent_pid)

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watchdog, name="parent-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        while self.alive():
            time.sleep(0.5)
        time.sleep(_WATCHDOG_GRACE_S)
        logger.error("The API process is gone and the engine loop did not stop; exiting.")
        os._exit(1)


class PeerWatch:
    """Is the API process at the other end of a (TCP) socket still there? A thread reads
    the socket's ZMQ monitor events: the peer is gone once the connection has been down
    (or never up) for `grace_s` seconds. A process that exits closes its connections at
    once; a machine that vanishes is noticed by TCP keepalive (about 25 s).

    Create it before the socket connects, so that the first connection is seen.
    """

    def __init__(self, socket: zmq.Socket, grace_s: float = _PEER_GRACE_S) -> None:
        for option, value in ((zmq.TCP_KEEPALIVE, 1), (zmq.TCP_KEEPALIVE_IDLE, 10),
                              (zmq.TCP_KEEPALIVE_INTVL, 5), (zmq.TCP_KEEPALIVE_CNT, 3)):
            socket.setsockopt(option, value)
        self.grace_s = grace_s
        self.connected = False
        self.since = time.monotonic()  # when `connected` last changed
        self._monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        threading.Thread(target=self._follow, name="peer-watch", daemon=True).start()

    def alive(self) -> bool:
        return self.connected or time.monotonic() - self.since < self.grace_s

    def _follow(self) -> None:
        try:
            while True:
                if self._monitor.poll(500):
                    event = zmq.utils.monitor.recv_monitor_message(self._monitor)
                    self.connected = event["event"] == zmq.EVENT_CONNECTED
                    self.since = time.monotonic()
        except zmq.ZMQError:  # the context was destroyed: the engine core is closing
            pass


class EngineCoreProc:
    """Owns one `EngineCore` and its two sockets; steps while there is work, sleeps on the
    input socket when there is none."""

    UTILITY_METHODS = ("reset_prefix_cache", "get_scheduler_stats", "get_engine_state", "ping",
                       "add_lora", "remove_lora")

    def __init__(self, engine_core: EngineCore, input_addr: str, output_addr: str,
                 parent_pid: int | None) -> None:
        """`parent_pid` None: the API process may be on another machine; watch its end of
        the output socket instead."""
        self.engine_core = engine_core
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.connect(input_addr)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self.parent = (ParentWatch.of_pid(parent_pid) if parent_pid is not None
                       else ParentWatch(PeerWatch(self.output_socket).alive))
        self.output_socket.connect(output_addr)
        self.encoder = MsgpackEncoder()
        self.add_decoder = MsgpackDecoder(EngineCoreRequest)
        self.abort_decoder = MsgpackDecoder(list[str])
        self.utility_decoder = MsgpackDecoder(UtilityCall)
        self._last_stats: SchedulerStats | None = None

    def run_busy_loop(self) -> None:
        """Steps while there is work; returns once the API process is gone (also when it
        dies in the middle of a full batch)."""
        self.parent.start_watchdog()
        try:
            while self.parent.alive():
                # Keep stepping while finished requests remain to be dropped by the runner.
                self._process_input(block=not self.engine_core.has_requests())
                outputs = self.engine_core.step()
                # Stats carry per-step prefix-cache deltas, so any change must be sent.
                if outputs.outputs or outputs.scheduler_stats != self._last_stats:
                    self._send(OUT_OUTPUTS, outputs)
                    self._last_stats = outputs.scheduler_stats
        except ParentGone:
            pass
        logger.info("The API process is gone; the engine core stops.")

    def _process_input(self, block: bool) -> None:
        """Handles every queued message; when `block`, first waits for one. Raises
        ParentGone if the parent process died while waiting."""
        if block:
            while not self.input_socket.poll(_IDLE_POLL_MS):
                if not self.parent.alive():
                    raise ParentGone
        while self.input_socket.poll(0):
            frames = self.input_socket.recv_multipart(copy=False)
            self._handle(frames[0].bytes, [f.buffer for f in frames[1:]])

    def _handle(self, kind: bytes, body: list[memoryview]) -> None:
        if kind == REQ_ADD:
            self._add_request(self.add_decoder.decode(body))
        elif kind == REQ_ABORT:
            self.engine_core.abort_requests(self.abort_decoder.decode(body))
        elif kind == REQ_STOP:
            self.engine_core.stop_requests(self.abort_decoder.decode(body))
        elif kind == REQ_UTILITY:
            self._call_utility(self.utility_decoder.decode(body))
        else:
            logger.error("Ignoring an engine-core message of unknown kind %r.", kind)

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(request)
        except Exception as e:  # the API process validated it; never let one kill the loop
            logger.error("Engine core refused request %s: %s", request.request_id, e)
            refused = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)
            self._send(OUT_OUTPUTS, EngineCoreOutputs([refused]))

    def _call_utility(self, call: UtilityCall) -> None:
        result = UtilityResult(call.call_id)
        if call.method not in self.UTILITY_METHODS:
            result.error = f"Unknown engine-core utility {call.method!r}."
        else:
            try:
                result.result = getattr(self, call.method)(*call.args)
            except Exception as e:
                result.error = f"{type(e).__name__}: {e}"
        self._send(OUT_UTILITY_RESULT, result)

    # ---- utilities callable from the API process ---------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str,
                 base_model_name: str | None) -> bool:
        return self.engine_core.add_lora(LoRARequest(lora_name, lora_int_id, lora_path,
                                                     base_model_name))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine_core.remove_lora(lora_int_id)

    def get_scheduler_stats(self) -> dict[str, Any]:
        """Running/waiting counts and KV usage now (leaves the streamed prefix deltas be)."""
        scheduler = self.engine_core.scheduler
        return {
            "num_running_reqs": len(scheduler.running),
            "num_waiting_reqs": len(scheduler.waiting),
            "kv_cache_usage": scheduler.kv_cache_manager.usage,
            "num_preemptions": scheduler.num_preemptions,
        }

    def get_engine_state(self) -> dict[str, Any]:
        """What the engine holds now, for leak checks (`/server_info` in dev mode)."""
        state = self.engine_core.get_state()
        state["rss_bytes"] = _rss_bytes()
        state["num_tensors"] = sum(map(_is_live_tensor, gc.get_objects()))
        return state

    def ping(self) -> str:
        return "pong"

    def _send(self, kind: bytes, obj: Any) -> None:
        """Sends one message; while the queue is full, waits in bounded slices and gives up
        (ParentGone) once the API process is gone rather than blocking forever."""
        frames = [kind, *self.encoder.encode(obj)]
        while True:
            try:
                self.output_socket.send_multipart(frames, copy=False)
                return
            except zmq.Again:
                if not self.parent.alive():
                    raise ParentGone from None

    def send_dead(self, message: str) -> None:
        try:
            self._send(OUT_ENGINE_DEAD, EngineDead(message))
        except ParentGone:
            pass

    def close(self) -> None:
        self.engine_core.shutdown()
        self.ctx.destroy(linger=0)


def _is_live_tensor(obj: Any) -> bool:
    """isinstance, except that a dead weakref proxy (torch.compile keeps some) raises."""
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:
        return False


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bind_cpus(cpu_ids: tuple[int, ...] | None) -> None:
    """A data-parallel engine core runs on its own cores, one torch thread each; its
    tensor-parallel ranks (processes it starts) inherit the set and split it."""
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
        torch.set_num_threads(len(cpu_ids))
        logger.info("Engine core bound to CPUs %s.", ",".join(map(str, cpu_ids)))


def start_engine_core(vllm_config: VllmConfig, input_addr: str, output_addr: str,
                      parent_pid: int | None) -> EngineCoreProc:
    """Builds the engine (bound to its cores) and connects its sockets."""
    _bind_cpus(vllm_config.parallel_config.cpu_ids)
    return EngineCoreProc(EngineCore(vllm_config), input_addr, output_addr, parent_pid)


def serve_engine_core(proc: EngineCoreProc) -> None:
    """Runs the loop until the API process is gone; an engine that fails tells the API
    process why, then re-raises."""
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except BaseException as e:
        logger.error("Engine core died:\n%s", traceback.format_exc())
        proc.send_dead(f"{type(e).__name__}: {e}")
        proc.close()
        raise
    proc.close()


def run_engine_core(vllm_config: VllmConfig, input_addr: str, output_addr: str,
                    ready_pipe: Connection, parent_pid: int) -> None:
    """Process entry point: build the engine, report ready (or why not), then loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    # A spawned process starts with no logging set up: log start-up (cache sizes) as the
    # API process does.
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")

    def _on_sigterm(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        proc = start_engine_core(vllm_config, input_addr, output_addr, parent_pid)
    except Exception as e:
        ready_pipe.send_bytes(msgspec.msgpack.encode(
            {"status": "failed", "error": f"{type(e).__name__}: {e}"}))
        raise SystemExit(1) from None
    ready_pipe.send_bytes(msgspec.msgpack.encode(
        {"status": "ready", "num_blocks": vllm_config.cache_config.num_blocks}))
    ready_pipe.close()
    try:
        serve_engine_core(proc)
    except BaseException:
        raise SystemExit(1) from None
