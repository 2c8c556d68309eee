"""`MultiprocExecutor`: one worker process per tensor-parallel rank on this machine.

The engine core sends each call to every rank over its own pipe (pickled once, sent to all),
and waits for every reply: rank 0's result is the step's output, the others' say they are
done (or carry their error). The ranks talk among themselves only through their process
group (`vllm.distributed`). A rank whose process dies is noticed by its sentinel, so a
call never waits on a dead worker: it raises `ExecutorDeadError`.

Workers are daemonic (they die with the engine core's process), run with the spawn start
method, and exit when the engine core's end of their pipe closes.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import socket
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from vllm.config import VllmConfig
from vllm.platforms.openmp import openmp_spin_count
from vllm.v1.executor.abstract import Executor, ExecutorDeadError

logger = logging.getLogger(__name__)

# Starting a rank (imports, process group, model load) may take this long.
READY_TIMEOUT_S = 600.0


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A worker raised something that does not cross a pipe; its traceback is the text."""


def _reply_error(conn: Connection, e: BaseException) -> None:
    text = "".join(traceback.format_exception(e))
    try:
        conn.send(("error", e, text))
    except Exception:  # the exception does not pickle
        conn.send(("error", WorkerError(f"{type(e).__name__}: {e}"), text))


def _worker_main(vllm_config: VllmConfig, rank: int, init_method: str,
                 conn: Connection) -> None:
    from vllm.v1.worker.worker import Worker

    try:
        worker = Worker(vllm_config, rank, init_method)
        worker.init_device()
        worker.load_model()
    except BaseException as e:
        _reply_error(conn, e)
        return
    conn.send(("ok", None))
    while True:
        try:
            method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the engine core is gone
            return
        try:
            result = getattr(worker, method)(*args, **kwargs)
        except Exception as e:
            _reply_error(conn, e)
            continue
        conn.send(("ok", result))
        if method == "shutdown":
            return


class MultiprocExecutor(Executor):
    def _init_executor(self) -> None:
        world = self.parallel_config.tensor_parallel_size
        # Rank 0's process listens there (torch.distributed's store) while it lives.
        self.distributed_init_method = f"tcp://127.0.0.1:{get_open_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"VllmWorker-{rank}", daemon=True,
                               args=(self.vllm_config, rank, self.distributed_init_method,
                                     child))
            with openmp_spin_count():  # read when the new process loads torch
                proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        logger.info("Started %d worker processes (pids %s).", world,
                    ", ".join(str(p.pid) for p in self.procs))
        try:
            self._collect(READY_TIMEOUT_S)
        except BaseException:
            self._finalizer()
            raise

    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        payload = pickle.dumps((method, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                raise ExecutorDeadError(self._death_message(rank)) from None
        return self._collect(None)

    def _collect(self, timeout: float | None) -> list[Any]:
        """Every rank's reply, in rank order; the first error is raised once all replied
        (so that no reply is left unread for the next call)."""
        results: dict[int, Any] = {}
        error: tuple[BaseException, str] | None = None
        waiting = dict(enumerate(self.conns))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while waiting:
            ready = wait([*waiting.values(), *sentinels], timeout)
            if not ready:
                raise ExecutorDeadError(f"Workers {sorted(waiting)} did not answer within "
                                        f"{timeout:.0f} s.")
            for rank, conn in list(waiting.items()):
                if conn in ready or conn.poll():
                    try:
                        status, *body = conn.recv()
                    except (EOFError, OSError):
                        raise ExecutorDeadError(self._death_message(rank)) from None
                    del waiting[rank]
                    if status == "ok":
                        results[rank] = body[0]
                    elif error is None:
                        error = (body[0], body[1])
            for sentinel in ready:
                rank = sentinels.get(sentinel)  # type: ignore[call-overload]
                if rank is not None and rank in waiting and not self.conns[rank].poll():
                    raise ExecutorDeadError(self._death_message(rank))
        if error is not None:
            exc, text = error
            exc.add_note(f"(raised in a tensor-parallel worker)\n{text}")
            raise exc
        return [results[rank] for rank in range(len(self.conns))]

    def _death_message(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(timeout=1)
        return (f"Tensor-parallel worker rank {rank} (pid {proc.pid}) died "
                f"(exit code {proc.exitcode}).")

    def shutdown(self) -> None:
        """Lets each rank leave its process group and exit, then joins them (idempotent;
        the finalizer alone, when the executor is garbage-collected unshut, closes the
        pipes: each worker exits when it reads the end of its pipe)."""
        if not self._finalizer.alive:
            return
        try:
            if all(p.is_alive() for p in self.procs):
                self.collective_rpc("shutdown")
        except Exception:
            logger.exception("Worker shutdown failed; stopping them.")
        finally:
            self._finalizer()


def _stop_workers(procs: list[Any], conns: list[Connection]) -> None:
    for conn in conns:
        conn.close()
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
