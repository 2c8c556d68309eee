"""The shared-memory all-reduce between 2 real ranks (spawned processes joined by gloo).

One spawn runs every scenario (a spawn costs seconds); each rank reports what it saw and
the tests below check it. Every rank can rebuild every rank's inputs (seeded by rank and
call), so each checks its results against the exact rank-order float32 sum.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import socket
import time

import pytest
import torch

from vllm._custom_ops import cpu_ops
from vllm.distributed.parallel_state import (
    destroy_model_parallel,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.shm_all_reduce import ShmAllReducer

# Every test reads the reports of two spawned ranks (the module's fixture, ~10 s): left
# out of `make test-fast`.
pytestmark = pytest.mark.slow

RANKS = 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 576), (8, 576), (3, 5, 17), (64, 576), (0, 576)]


def _input(rank: int, call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


def _expected(call: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The kernel's definition: the ranks' inputs summed in rank order in float32."""
    total = _input(0, call, shape, dtype).float()
    for rank in range(1, RANKS):
        total = total + _input(rank, call, shape, dtype).float()
    return total.to(dtype)


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return name in f.read()


def _matrix(group) -> list[tuple[bytes, bool, bool, bool]]:
    """Every dtype and shape, through shared memory: (the result's bytes, whether it equals
    the rank-order float32 sum, gloo's result, and the float64 sum within tolerance)."""
    rows = []
    for i, (dtype, shape) in enumerate((d, s) for d in DTYPES for s in SHAPES):
        x = _input(group.rank_in_group, i, shape, dtype)
        out = group.all_reduce(x)
        reducer, group.fast_all_reduce = group.fast_all_reduce, None
        gloo = group.all_reduce(x)
        group.fast_all_reduce = reducer
        exact = torch.stack([_input(r, i, shape, dtype).double() for r in range(RANKS)]).sum(0)
        close = torch.allclose(out.double(), exact, rtol=1e-2, atol=1e-2)
        assert out.dtype == dtype and out.shape == shape
        rows.append((out.view(torch.uint8).numpy().tobytes(),
                     torch.equal(out, _expected(i, shape, dtype)), torch.equal(out, gloo), close))
    return rows


def _back_to_back(group, calls: int) -> list[int]:
    """Calls of random sizes without barriers (rank 1 sometimes late); the wrong ones."""
    sizes = random.Random(0)
    late = random.Random(group.rank_in_group)
    wrong = []
    for call in range(calls):
        shape = (sizes.randint(1, 300), 576)
        dtype = DTYPES[call % len(DTYPES)]
        if group.rank_in_group == 1 and late.random() < 0.1:
            time.sleep(0.001)
        out = group.all_reduce(_input(group.rank_in_group, call, shape, dtype))
        if not torch.equal(out, _expected(call, shape, dtype)):
            wrong.append(call)
    return wrong


def _rank_main(rank: int, port: int, results) -> None:
    torch.set_num_threads(1)
    init_distributed_environment(RANKS, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(RANKS)
    group = get_tp_group()
    reducer = group.fast_all_reduce
    assert isinstance(reducer, ShmAllReducer)
    report: dict[str, object] = {"name_left": os.path.exists(f"/dev/shm/{reducer.name}"),
                                 "mapped": _mapped(reducer.name)}
    report["matrix"] = _matrix(group)
    report["wrong"] = _back_to_back(group, 300)

    big = _input(rank, 0, (reducer.buffer_bytes // 4 + 1,), torch.float32)
    report["big_can_reduce"] = reducer.can_reduce(big)
    report["big_ok"] = torch.equal(group.all_reduce(big), _expected(0, big.shape, big.dtype))

    compiled = torch.compile(lambda x: group.all_reduce(x) * 2, fullgraph=True)
    x = _input(rank, 7, (4, 576), torch.float32)
    report["compiled_ok"] = torch.equal(compiled(x), _expected(7, x.shape, x.dtype) * 2)

    # Both ranks on one core: waiting must yield, or this never ends.
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    report["shared_core_wrong"] = _back_to_back(group, 100)

    if rank == 0:  # rank 1 leaves (below): waiting for it must fail, not hang
        try:
            reducer.all_reduce(x)
        except RuntimeError as e:
            report["peer_gone_error"] = str(e)
    reducer.close()
    report["mapped_after_close"] = _mapped(reducer.name)
    group.fast_all_reduce = None
    destroy_model_parallel()
    results.put(report)


@pytest.fixture(scope="module")
def reports() -> list[dict[str, object]]:
    assert cpu_ops() is not None  # built once here, not by both ranks at once
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queues = [ctx.Queue() for _ in range(RANKS)]
    procs = [ctx.Process(target=_rank_main, args=(r, port, queues[r])) for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        out = []
        for r in reversed(range(RANKS)):  # rank 1 first: rank 0 waits for it to be gone
            try:
                out.append(queues[r].get(timeout=600))
            except queue.Empty:
                pytest.fail("a rank did not report (crashed or hung); see its stderr")
            procs[r].join(timeout=60)  # reaped: its pid is gone, not a zombie
        return out[::-1]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_same_bits_on_every_rank_and_equal_to_gloo(reports):
    rows = [report["matrix"] for report in reports]
    assert len(rows[0]) == len(DTYPES) * len(SHAPES)
    for case, (rank0, rank1) in enumerate(zip(*rows)):
        assert rank0[0] == rank1[0], case  # the same bytes on both ranks
        for _, exact_sum, equals_gloo, close in (rank0, rank1):
            assert exact_sum and close, case
            assert equals_gloo, case  # 2 ranks: gloo's float32 sum also rounds once


def test_back_to_back_calls_of_varying_sizes(reports):
    for report in reports:
        assert report["wrong"] == []
        assert report["shared_core_wrong"] == []


def test_tensor_over_the_buffer_goes_through_gloo(reports):
    for report in reports:
        assert report["big_can_reduce"] is False
        assert report["big_ok"] is True


def test_inside_compiled_graph(reports):
    for report in reports:
        assert report["compiled_ok"] is True


def test_segment_has_no_name_and_is_unmapped_at_close(reports):
    for report in reports:
        assert report["name_left"] is False  # removed as soon as every rank had mapped it
        assert report["mapped"] is True
        assert report["mapped_after_close"] is False


def test_waiting_for_a_dead_rank_raises(reports):
    assert "rank 1" in reports[0]["peer_gone_error"] and "is gone" in reports[0]["peer_gone_error"]
