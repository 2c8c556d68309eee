"""`RayEngines`: data-parallel engine cores placed by Ray, each in an actor that may sit on
another machine of the cluster (`vllm serve -dp N --distributed-executor-backend ray`).

    API process (this machine)                     Ray actor (any machine)
    AsyncMPClient --tcp://IP:port (PUSH)--------->  EngineCoreProc (PULL)
                  <--tcp://IP:port (PULL)---------  EngineCoreProc (PUSH), PeerWatch on it
    RayEngine: run_ref ------ fails when the actor dies ------ EngineCoreActor.run()

The placement group holds one bundle per engine core (SPREAD: replicas share nothing, so
each gets a machine's cores and memory bandwidth to itself where the cluster has machines
to spare; Ray falls back to packing them when it has not). Each actor runs the same
`EngineCoreProc` loop as a local engine process, fed by the same sockets, bound here as
TCP on this machine's address instead of Unix sockets. An engine core's own
tensor-parallel ranks are `mp` processes beside it (one replica's ranks all-reduce twice
per layer: they belong on one machine, where the shared-memory all-reduce works).

Liveness both ways: this side holds the ObjectRef of the actor's long-running `run()`,
which fails when the actor (its process or machine) dies; that stands in for the process
sentinel. The actor watches this process's end of its output socket (`PeerWatch`) and
stops once it has been gone for a few seconds; Ray also kills the actors of a driver that
exits, but the socket watch does not depend on Ray's view of the API process.

The placement group outlives a driver's actors (Ray frees it when the driver exits), so
`RayEngines` removes it on `shutdown()` and, through a `weakref.finalize`, when it is
garbage-collected unshut.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.executor.ray_executor import init_ray, release_placement_group

logger = logging.getLogger(__name__)

# Placing the engines (free resources for every bundle) must not wait forever.
_PLACEMENT_TIMEOUT_S = 120
# Actor names are "EngineCore_<index>_<server id>" in this namespace (for `ray.get_actor`).
RAY_NAMESPACE = "vllm"


class EngineCoreActor:
    """The actor: `start` builds the engine core and connects it to the API process's
    sockets; `run` is its loop, which returns once the API process is gone."""

    def __init__(self) -> None:
        self.proc: Any = None

    def start(self, vllm_config: VllmConfig, input_addr: str, output_addr: str,
              num_threads: int) -> int:
        """Returns the KV cache blocks the engine core allocated."""
        import torch

        from vllm.v1.engine.core_proc import start_engine_core

        logging.basicConfig(level=logging.INFO,
                            format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        torch.set_num_threads(num_threads)  # the bundle's cores (its ranks split their own)
        self.proc = start_engine_core(vllm_config, input_addr, output_addr, parent_pid=None)
        return vllm_config.cache_config.num_blocks

    def run(self) -> None:
        from vllm.v1.engine.core_proc import serve_engine_core

        if self.proc is None:
            raise RuntimeError("The engine core did not start.")
        serve_engine_core(self.proc)


class RayEngine:
    """The API process's handle on one `EngineCoreActor` (an `EngineHandle`)."""

    def __init__(self, ray: Any, actor: Any, name: str, start_ref: Any) -> None:
        self._ray = ray
        self.actor = actor
        self.name = name
        self._start_ref = start_ref
        self._run: Future = actor.run.remote().future()
        self._watching = False

    def wait_ready(self) -> int:
        try:
            return int(self._ray.get(self._start_ref))
        except self._ray.exceptions.RayTaskError as e:
            raise RuntimeError(f"{self.name} failed to start: {e.cause}") from None
        except self._ray.exceptions.RayActorError as e:
            raise RuntimeError(f"{self.name} actor died before it was ready: "
                               f"{_first_line(e)}") from None

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[], None]) -> None:
        self._watching = True

        def done(_: Future) -> None:  # on a Ray thread (or here, if already done)
            if self._watching and not loop.is_closed():
                loop.call_soon_threadsafe(on_exit)

        self._run.add_done_callback(done)

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._watching = False

    def is_alive(self) -> bool:
        return not self._run.done()

    def exit_message(self) -> str:
        error = self._run.exception() if self._run.done() else None
        if error is None:
            return f"{self.name} stopped: it lost its connection to the API process."
        if isinstance(error, self._ray.exceptions.RayActorError):
            return f"{self.name} actor died unexpectedly: {_first_line(error)}"
        return f"{self.name} failed: {_first_line(error)}"

    def stop(self) -> None:
        if not self._ray.is_initialized():  # Ray took the actor with it (and a call now
            return  # would start a new local instance)
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # the actor is gone
            pass


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class RayEngines:
    """The cluster connection, the placement group (one bundle per engine core) and the
    actors of one API server's data-parallel engines.

    Attributes:
        node_ip: this machine's address in the cluster; the engine cores connect to it.
    """

    def __init__(self, vllm_config: VllmConfig) -> None:
        ray = init_ray()
        from ray.util.placement_group import placement_group

        self._ray = ray
        parallel = vllm_config.parallel_config
        self.node_ip: str = ray.util.get_node_ip_address()
        self.server_id = uuid.uuid4().hex[:8]
        # One core per rank unless told more (the engine splits them among its ranks).
        self.cpus = int(os.environ.get("VLLM_RAY_ENGINE_CPUS", parallel.tensor_parallel_size))
        self.bundle = {"CPU": float(self.cpus)}
        if vllm_config.device_config.device == "cuda":
            self.bundle["GPU"] = float(parallel.tensor_parallel_size)
        engines = parallel.data_parallel_size
        self.engines: list[RayEngine] = []
        self._actors: list[Any] = []  # the engines' actors, for the finalizer
        self.placement_group = placement_group([dict(self.bundle) for _ in range(engines)],
                                               strategy="SPREAD")
        self._finalizer = weakref.finalize(self, release_placement_group, ray,
                                           self.placement_group, self._actors)
        try:
            ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except Exception:
            self.shutdown()
            raise ValueError(f"Ray could not place {engines} engine cores of {self.bundle} "
                             f"(its cluster: {ray.cluster_resources()}).") from None

    def engine_config(self, vllm_config: VllmConfig, engine_index: int) -> VllmConfig:
        """Engine `engine_index`'s config: its rank; its ranks run in the actor (`uni`) or
        beside it (`mp`); its cores are the actor's, not this machine's."""
        parallel = vllm_config.parallel_config
        backend = "uni" if parallel.tensor_parallel_size == 1 else "mp"
        return dataclasses.replace(vllm_config, parallel_config=dataclasses.replace(
            parallel, data_parallel_rank=engine_index, cpu_ids=None,
            distributed_executor_backend=backend))

    def start(self, vllm_config: VllmConfig, name: str, input_addr: str,
              output_addr: str) -> RayEngine:
        """Starts engine core `data_parallel_rank` in its bundle; returns its handle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        index = vllm_config.parallel_config.data_parallel_rank
        actor = self._ray.remote(EngineCoreActor).options(
            name=f"EngineCore_{index}_{self.server_id}", namespace=RAY_NAMESPACE,
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=index),
        ).remote()
        start_ref = actor.start.remote(vllm_config, input_addr, output_addr,
                                       1 if vllm_config.parallel_config.world_size > 1
                                       else self.cpus)
        self._actors.append(actor)
        engine = RayEngine(self._ray, actor, name, start_ref)
        self.engines.append(engine)
        return engine

    def shutdown(self) -> None:
        """Kills the actors (if their clients have not) and removes the placement group
        (idempotent)."""
        self._finalizer()
