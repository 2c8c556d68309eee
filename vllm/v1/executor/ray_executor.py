"""`RayDistributedExecutor`: one Ray actor per tensor-parallel rank, in a placement group.

The engine core joins the Ray cluster named by `RAY_ADDRESS` (or `ray.init()`'s default: a
running local cluster, else a new local instance), reserves one bundle per rank (PACK: on
as few machines as fit), and starts a `Worker` in an actor per bundle. Rank 0's node and a
free port there are the process group's rendezvous; calls are Ray method calls on every
actor. Ray carries the calls and results; the ranks' collectives go through
torch.distributed (gloo across machines, NCCL between GPUs).

A dead actor (its process or node gone) raises `ExecutorDeadError`.

The placement group belongs to the Ray job (this process), not to the actors: Ray frees it
only when the driver exits. So the executor removes it (and kills its actors) on
`shutdown()` and, through a `weakref.finalize`, when it is garbage-collected unshut;
otherwise the next engine of this process could not place its ranks.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import weakref
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.executor.abstract import Executor, ExecutorDeadError

logger = logging.getLogger(__name__)


def init_ray() -> Any:
    """Joins the Ray cluster named by `RAY_ADDRESS` (else a running local one, else a new
    local instance) unless this process already has; returns the `ray` module (typed Any:
    Ray's stubs do not see its lazily loaded submodules)."""
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                         "'ray[default]'.") from None
    if not ray.is_initialized():
        sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True,
                 log_to_driver=False)
        # Ray's own SIGTERM handler exits with code 15 at once; keep this process's (the
        # API server's stops the engines and exits 0).
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)
    return ray


class RayWorker:
    """The actor: a `Worker` built once the rendezvous address is known."""

    def __init__(self, vllm_config: VllmConfig, rank: int) -> None:
        self.vllm_config = vllm_config
        self.rank = rank
        self.worker: Any = None

    def node_and_port(self) -> tuple[str, str, int]:
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def start(self, init_method: str, local_rank: int, local_world_size: int) -> None:
        from vllm.v1.worker.worker import Worker

        self.worker = Worker(self.vllm_config, self.rank, init_method, local_rank,
                             local_world_size)
        self.worker.init_device()
        self.worker.load_model()

    def execute_method(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        ray = init_ray()
        from ray.util.placement_group import placement_group

        self._ray = ray
        world = self.parallel_config.tensor_parallel_size
        gpu = self.vllm_config.device_config.device == "cuda"
        bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
        self.workers: list[Any] = []
        self.placement_group = placement_group([dict(bundle) for _ in range(world)],
                                               strategy="PACK")
        # Holds the actors list itself, so that it frees the actors started after it.
        self._finalizer = weakref.finalize(self, release_placement_group, ray, self.placement_group,
                                           self.workers)
        try:
            ray.get(self.placement_group.ready(), timeout=120)
        except Exception:
            self._finalizer()
            raise ValueError(f"Ray could not place {world} ranks of {bundle} (its cluster: "
                             f"{ray.cluster_resources()}).") from None
        try:
            self._start_workers(bundle)
        except BaseException:
            self._finalizer()
            raise

    def _start_workers(self, bundle: dict[str, float]) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls: Any = self._ray.remote(RayWorker)
        for rank in range(self.parallel_config.tensor_parallel_size):
            self.workers.append(actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank),
            ).remote(self.vllm_config, rank))
        places = self._ray.get([w.node_and_port.remote() for w in self.workers])
        _, master_ip, master_port = places[0]
        self.distributed_init_method = f"tcp://{master_ip}:{master_port}"
        # Ranks on one node split its cores (local rank, local count).
        nodes = [node for node, _, _ in places]
        local = [nodes[:rank].count(node) for rank, node in enumerate(nodes)]
        logger.info("Ray ranks on nodes %s; rendezvous %s.", nodes,
                    self.distributed_init_method)
        self._get([w.start.remote(self.distributed_init_method, local[rank],
                                  nodes.count(nodes[rank]))
                   for rank, w in enumerate(self.workers)])

    def _get(self, refs: list[Any]) -> list[Any]:
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as e:
            raise ExecutorDeadError(f"A tensor-parallel Ray actor died: {e}") from None
        except self._ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()
            raise cause from None

    def collective_rpc(self, method: str, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        return self._get([w.execute_method.remote(method, args, kwargs or {})
                          for w in self.workers])

    def shutdown(self) -> None:
        """Lets each rank leave its process group, then kills the actors and removes the
        placement group (idempotent)."""
        if not self._finalizer.alive:
            return
        try:
            self.collective_rpc("shutdown")
        except Exception:
            logger.exception("Ray worker shutdown failed.")
        finally:
            self._finalizer()


def release_placement_group(ray: Any, placement_group: Any, actors: list[Any]) -> None:
    """Kills the actors and removes their placement group (an owner's finalizer: it holds
    no reference to the owner). Nothing to do once Ray is shut down: a local instance took
    everything with it, a cluster frees a driver's groups when the driver leaves."""
    if not ray.is_initialized():
        return
    from ray.util.placement_group import remove_placement_group

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already dead
            pass
    try:
        remove_placement_group(placement_group)
    except Exception:
        logger.exception("Removing the Ray placement group failed.")
