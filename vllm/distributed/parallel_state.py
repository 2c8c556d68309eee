"""Process groups of the tensor-parallel ranks, over torch.distributed.

Every rank of one engine joins one world (`init_distributed_environment`), whose ranks
form the tensor-parallel group (`initialize_model_parallel`). A `GroupCoordinator` holds
the group's collectives: gloo on CPU (or a shared-memory all-reduce for ranks on one
machine, where it is faster: see `shm_all_reduce`), NCCL on CUDA. Data-parallel engines
are separate worlds: they never talk to each other.

One rank without torch.distributed (the `uni` executor) has a group of one, whose
collectives return their input: the models never branch on the rank count.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Protocol

import torch
import torch.distributed as dist

from vllm.distributed.shm_all_reduce import open_shm_all_reducer

logger = logging.getLogger(__name__)

# A rank blocked in a collective whose peer died gives up after this long (the executor
# notices a dead worker process much sooner, by its sentinel).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


class AllReducer(Protocol):
    """A faster all-reduce for some tensors (e.g. shared memory between local ranks)."""

    def can_reduce(self, x: torch.Tensor) -> bool: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...


class GroupCoordinator:
    """The ranks of one group and their collectives. `rank_in_group` 0 is the driver."""

    def __init__(self, ranks: list[int], rank: int, backend: str, name: str) -> None:
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank = rank
        self.rank_in_group = ranks.index(rank) if rank in ranks else 0
        self.name = name
        self.device_group: dist.ProcessGroup | None = None
        self.cpu_group: dist.ProcessGroup | None = None
        self.fast_all_reduce: AllReducer | None = None
        if self.world_size > 1:
            self.device_group = _new_group(ranks, backend)
            self.cpu_group = (self.device_group if backend == "gloo" else
                              _new_group(ranks, "gloo"))
        _GROUPS[name] = self

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, as a new tensor (every rank gets the same bits)."""
        if self.world_size == 1:
            return x
        return torch.ops.vllm.all_reduce(x, self.name)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over ranks, as a new tensor."""
        if self.world_size == 1:
            return x
        return torch.ops.vllm.all_reduce_max(x, self.name)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Ranks' tensors concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        dim = dim % x.dim()
        gathered = torch.ops.vllm.all_gather(x, self.name)  # [world, *x.shape]
        return torch.cat(gathered.unbind(0), dim=dim)

    def _all_reduce_eager(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_all_reduce is not None and self.fast_all_reduce.can_reduce(x):
            return self.fast_all_reduce.all_reduce(x)
        out = x.clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def _all_reduce_max_eager(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.device_group)
        return out

    def _all_gather_eager(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=self.device_group)
        return out.view(self.world_size, *x.shape)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        if self.fast_all_reduce is not None:
            self.fast_all_reduce.close()
            self.fast_all_reduce = None
        _GROUPS.pop(self.name, None)


def _new_group(ranks: list[int], backend: str) -> dist.ProcessGroup | None:
    """The group of `ranks`; None on a rank outside it (every rank of the world calls this)."""
    group = dist.new_group(ranks, backend=backend, timeout=COLLECTIVE_TIMEOUT)
    return group if isinstance(group, dist.ProcessGroup) else None


_GROUPS: dict[str, GroupCoordinator] = {}
_TP: GroupCoordinator | None = None


def _single_group() -> GroupCoordinator:
    group = _GROUPS.get("single")
    return group if group is not None else GroupCoordinator([0], 0, "gloo", "single")


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group; a group of one when no world was initialized."""
    return _TP if _TP is not None else _single_group()


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)


def init_distributed_environment(world_size: int, rank: int, init_method: str,
                                 backend: str = "gloo") -> None:
    """Joins this process to its engine's world (rank 0's address in `init_method`)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process.")
    dist.init_process_group(backend=backend, init_method=init_method, world_size=world_size,
                            rank=rank, timeout=COLLECTIVE_TIMEOUT)


def initialize_model_parallel(tensor_parallel_size: int, backend: str = "gloo") -> None:
    global _TP
    world = dist.get_world_size()
    if world != tensor_parallel_size:
        raise ValueError(f"The world has {world} ranks but tensor_parallel_size is "
                         f"{tensor_parallel_size}.")
    _TP = GroupCoordinator(list(range(world)), dist.get_rank(), backend, "tp")
    if (_TP.cpu_group is not None and backend == "gloo"
            and os.environ.get("VLLM_CPU_SHM_ALLREDUCE", "1") != "0"):
        _TP.fast_all_reduce = open_shm_all_reducer(_TP.cpu_group)


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None:
        _TP.destroy()
        _TP = None
    if dist.is_initialized():
        dist.destroy_process_group()


# Collectives as registered ops, so that compiled graphs keep them as single calls (the
# group is found by name, like the attention layer by id). `torch.library.Library` ops, not
# `custom_op`: ~3 us a call instead of ~9 (see `vllm::attention`), where the shared-memory
# all-reduce itself takes ~1.5 us and a decode step makes 60.
_lib = torch.library.Library("vllm", "FRAGMENT")
_lib.define("all_reduce(Tensor x, str group_name) -> Tensor")
_lib.define("all_gather(Tensor x, str group_name) -> Tensor")
_lib.define("all_reduce_max(Tensor x, str group_name) -> Tensor")


def _all_reduce_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _GROUPS[group_name]._all_reduce_eager(x)


def _all_reduce_max_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _GROUPS[group_name]._all_reduce_max_eager(x)


def _all_gather_op(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _GROUPS[group_name]._all_gather_eager(x)


_lib.impl("all_reduce", _all_reduce_op, "CompositeExplicitAutograd")
_lib.impl("all_gather", _all_gather_op, "CompositeExplicitAutograd")
_lib.impl("all_reduce_max", _all_reduce_max_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm::all_reduce", lib=_lib)
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("vllm::all_reduce_max", lib=_lib)
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("vllm::all_gather", lib=_lib)
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    world = _GROUPS[group_name].world_size
    return x.new_empty((world, *x.shape))
