"""Scale-out measurements in one run, section by section (all sections by default):

  --allreduce  all-reduce latency between 2 CPU ranks (1 thread each, one core each) at the
               default model's hidden size (SmolLM2-135M: 576) for 1-64 tokens, in bfloat16
               and float32: gloo against the shared-memory all-reduce, side by side, through
               `group.all_reduce` (the registered op the models call). Prints the median
               microseconds per call, the ratio (gloo / shm: above 1 means shared memory is
               faster) and what 60 all-reduces (2 per layer, 30 layers) cost per step.

    python benchmarks/benchmark_parallel.py [--allreduce] [--tokens 1 2 4 8] [--calls 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import NamedTuple

import torch

from vllm._custom_ops import cpu_ops
from vllm.distributed.parallel_state import (
    destroy_model_parallel,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
)
from vllm.distributed.utils import usable_cpus

HIDDEN = 576  # SmolLM2-135M
ALL_REDUCES_PER_STEP = 60  # 2 per layer x 30 layers
RANKS = 2


class Latency(NamedTuple):
    tokens: int
    dtype: str
    gloo_us: float
    shm_us: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_us(fn, x: torch.Tensor, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _allreduce_rank(rank: int, port: int, tokens: list[int], calls: int, results) -> None:
    cpus = usable_cpus()
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    init_distributed_environment(RANKS, rank, f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(RANKS)
    group = get_tp_group()
    shm = group.fast_all_reduce
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for n in tokens:
            x = torch.randn(n, HIDDEN).to(dtype)
            medians: dict[str, list[float]] = {"gloo": [], "shm": []}
            for _ in range(3):  # alternate rounds, so that both see the same noise
                for name, reducer in (("gloo", None), ("shm", shm)):
                    if name == "shm" and reducer is None:
                        continue
                    group.fast_all_reduce = reducer
                    for _ in range(20):  # warm up
                        group.all_reduce(x)
                    group.barrier()
                    medians[name].append(_median_us(group.all_reduce, x, calls))
            group.fast_all_reduce = shm
            shm_us = min(medians["shm"]) if medians["shm"] else float("nan")
            rows.append(Latency(n, str(dtype).removeprefix("torch."), min(medians["gloo"]),
                                shm_us))
    if rank == 0:
        results.put(rows)
    destroy_model_parallel()


def run_allreduce(args: argparse.Namespace) -> None:
    cpu_ops()  # build the native kernels once, before the ranks load them
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_allreduce_rank, args=(r, port, args.tokens, args.calls,
                                                       results)) for r in range(RANKS)]
    for p in ranks:
        p.start()
    rows: list[Latency] = results.get()
    for p in ranks:
        p.join()
    print(f"\nAll-reduce, {RANKS} ranks (1 thread, 1 core each), hidden {HIDDEN}, median us "
          f"per call (best of 3 rounds of {args.calls}); per step = "
          f"{ALL_REDUCES_PER_STEP} calls")
    print(f"{'tokens':>6} {'dtype':>9} {'gloo us':>9} {'shm us':>8} {'gloo/shm':>9} "
          f"{'gloo ms/step':>13} {'shm ms/step':>12}")
    for r in rows:
        print(f"{r.tokens:>6} {r.dtype:>9} {r.gloo_us:>9.1f} {r.shm_us:>8.1f} "
              f"{r.gloo_us / r.shm_us:>9.1f} {r.gloo_us * ALL_REDUCES_PER_STEP / 1e3:>13.2f} "
              f"{r.shm_us * ALL_REDUCES_PER_STEP / 1e3:>12.2f}")


SECTIONS = {"allreduce": run_allreduce}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--allreduce", action="store_true", help="all-reduce latency")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed round")
    args = parser.parse_args()
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)
    for name in chosen:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
