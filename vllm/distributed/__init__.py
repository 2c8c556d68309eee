"""Tensor-parallel process groups and collectives (see `parallel_state`)."""

from vllm.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
