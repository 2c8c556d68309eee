"""All-reduce through shared memory for the ranks of one group on one machine.

gloo sends even a one-token all-reduce through loopback TCP (~0.3 ms on the 2-core
machine); the ranks of one machine can instead copy their tensor into a shared segment,
wait on each other's flags and sum every rank's copy (the native `shm_all_reduce` kernel of
`csrc/cpu/shm_all_reduce.cpp`, which documents the segment's layout and protocol).
Tensors over the buffer size still go through gloo (`can_reduce` says no).

The segment lives in /dev/shm only while the ranks map it: rank 0 creates it, the others
map it, and rank 0 removes its name at once, so that a crash can leak no segment; the
memory goes back to the system when the last rank unmaps it (`close`, or exit).
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import struct

import torch
import torch.distributed as dist

from vllm._custom_ops import cpu_ops

logger = logging.getLogger(__name__)

# Each rank's buffer (two per rank): 1 MiB holds 910 tokens x 576 bfloat16, 455 in float32.
DEFAULT_BUFFER_BYTES = 1 << 20
LINE_BYTES = 64  # one cache line per rank: arrived (uint64), pid (int64)
SHM_DIR = "/dev/shm"
# A rank waiting for a peer that never arrives gives up after this long (matches gloo's).
WAIT_TIMEOUT_S = 120.0
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ShmAllReducer:
    """The shared-memory all-reduce of one group's ranks (an `AllReducer`): every rank
    gets the same bits, the sum in rank order accumulated in float32."""

    def __init__(self, segment: mmap.mmap, name: str, rank: int, world_size: int) -> None:
        ops = cpu_ops()
        assert ops is not None
        self._kernel = ops.shm_all_reduce
        self._mmap: mmap.mmap | None = segment
        # The kernel's view of the segment: [LINE_BYTES * world + 2 * world * buffer] uint8.
        self._segment: torch.Tensor | None = torch.frombuffer(segment, dtype=torch.uint8)
        self.name = name  # in /dev/shm until every rank has mapped it
        self.rank = rank
        self.world_size = world_size
        self.buffer_bytes = (len(segment) - LINE_BYTES * world_size) // (2 * world_size)
        struct.pack_into("q", segment, LINE_BYTES * rank + 8, os.getpid())

    def can_reduce(self, x: torch.Tensor) -> bool:
        return (self._segment is not None and x.device.type == "cpu" and x.dtype in DTYPES
                and x.numel() * x.element_size() <= self.buffer_bytes)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        assert self._segment is not None, "all_reduce after close()"
        return self._kernel(x, self._segment, self.rank, self.world_size, WAIT_TIMEOUT_S)

    def close(self) -> None:
        """Unmaps the segment (its name is already gone: see `open_shm_all_reducer`)."""
        self._segment = None  # the tensor exports the mmap's buffer: drop it first
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def segment_bytes(world_size: int, buffer_bytes: int) -> int:
    return LINE_BYTES * world_size + 2 * world_size * buffer_bytes


def open_shm_all_reducer(cpu_group: dist.ProcessGroup,
                         buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> ShmAllReducer | None:
    """A `ShmAllReducer` for the ranks of `cpu_group` (a gloo group; every rank calls this),
    or None on every rank when one of them cannot have it: ranks on other machines, no
    native kernels, no /dev/shm. Returns the same answer on every rank."""
    rank, world = dist.get_rank(cpu_group), dist.get_world_size(cpu_group)
    usable = cpu_ops() is not None and os.path.isdir(SHM_DIR)
    answers: list[tuple[str, bool]] = [("", False)] * world
    dist.all_gather_object(answers, (socket.gethostname(), usable), group=cpu_group)
    if len({host for host, _ in answers}) != 1 or not all(ok for _, ok in answers):
        logger.info("Shared-memory all-reduce off (ranks on several machines, or native "
                    "kernels or /dev/shm missing on one): using gloo.")
        return None
    buffer_bytes = -(-buffer_bytes // LINE_BYTES) * LINE_BYTES  # keep buffers line-aligned
    segment, name = _share_segment(cpu_group, rank, segment_bytes(world, buffer_bytes))
    mapped: list[bool] = [False] * world
    dist.all_gather_object(mapped, segment is not None, group=cpu_group)
    if rank == 0 and name:
        os.unlink(os.path.join(SHM_DIR, name))  # every rank has mapped it or given up
    if not all(mapped):
        if segment is not None:
            segment.close()
        return None
    assert segment is not None
    reducer = ShmAllReducer(segment, name, rank, world)
    dist.barrier(group=cpu_group)  # every pid written before the first call can check them
    return reducer


def _share_segment(cpu_group: dist.ProcessGroup, rank: int,
                   size: int) -> tuple[mmap.mmap | None, str]:
    """Rank 0 creates a segment and sends its name to the others, which map it. Returns
    this rank's mapping (None if it failed) and the name ("" if rank 0 failed)."""
    name, segment = "", None
    if rank == 0:
        name = f"vllm_allreduce_{os.getpid()}_{secrets.token_hex(4)}"
        segment = _map(name, size, create=True)
        name = name if segment is not None else ""
    names = [name]
    dist.broadcast_object_list(names, src=dist.get_global_rank(cpu_group, 0), group=cpu_group)
    if rank != 0 and names[0]:
        segment = _map(names[0], size, create=False)
    return segment, names[0]


def _map(name: str, size: int, create: bool) -> mmap.mmap | None:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    except OSError as e:
        logger.warning("Shared-memory all-reduce: cannot open %s (%s).", path, e)
        return None
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size)
    except OSError as e:
        logger.warning("Shared-memory all-reduce: cannot map %s (%s).", path, e)
        if create:
            os.unlink(path)
        return None
    finally:
        os.close(fd)
