"""Scale-out measurements in one run, section by section (all sections by default):

  --allreduce  all-reduce latency between 2 CPU ranks (1 thread each, one core each) at the
               default model's hidden size (SmolLM2-135M: 576) for 1-64 tokens, in bfloat16
               and float32: gloo against the shared-memory all-reduce, side by side, through
               `group.all_reduce` (the registered op the models call). Prints the median
               microseconds per call, the ratio (gloo / shm: above 1 means shared memory is
               faster) and what 60 all-reduces (2 per layer, 30 layers) cost per step.

  --workload   the default model's size (SmolLM2-135M's hidden 576, 30 layers, MLP 1536,
               vocabulary 49152; 8 heads of 64 and 4 KV heads so that 2 ranks divide them:
               the real model's 9 / 3 heads do not), random weights, bfloat16 where the CPU
               has it: 32 requests of 128 prompt + 64 generated tokens (throughput) and one
               request of 64 generated tokens (decode latency), each configuration in
               processes of its own:
                 tp1 x2   one rank, 2 threads          (the default)
                 tp2      two ranks, 1 thread / core each (mp executor, shared-memory
                          all-reduce)
                 dp2      two engines, 1 thread / core each, half the requests each
                 tp1 x1   one rank, 1 thread           (the compute a rank would halve)
               and attributes tp2's overhead over half of tp1 x1: communication (the
               all-reduces and all-gathers a step makes, at the --allreduce latencies) and
               the rest (work every rank repeats: embeddings, norms, sampling, the runner's
               input preparation, the step's pipe round trip).

    python benchmarks/benchmark_parallel.py [--allreduce] [--workload] [--tokens 1 2 4 8]
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


_MEASURED: list[Latency] = []  # this run's all-reduce latencies (the workload reads them)


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
    _MEASURED[:] = rows
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


def _default_size_model(path: str, twin: bool = False) -> str:
    """A random-weight Llama of the default model's size that 2 ranks can split; `twin`:
    the same layers, heads and ops with almost no weights (hidden 64, MLP 64, vocabulary
    512), whose step time is the per-step cost that does not scale with the weights."""
    import transformers

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    hidden, inter, vocab = (64, 64, 512) if twin else (HIDDEN, 1536, 49152)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=True, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


class Run(NamedTuple):
    seconds: float  # the batch
    tokens: int  # generated in the batch
    decode_tok_s: float  # one request


def _workload_proc(path: str, tp: int, threads: int, cpus: list[int] | None,
                   prompts: list[list[int]], max_tokens: int, single: bool, results) -> None:
    from vllm import LLM, SamplingParams

    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)
    llm = LLM(path, tensor_parallel_size=tp, max_model_len=512, max_num_seqs=64,
              kv_cache_memory_bytes=512 * 2**20, enable_prefix_caching=False,
              skip_tokenizer_init=True)  # random ids in, ids out
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    warm = [{"prompt_token_ids": p} for p in prompts[:2]]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode = 0.0
    if single:
        one = [{"prompt_token_ids": prompts[0][:8]}]
        start = time.perf_counter()
        llm.generate(one, params, use_tqdm=False)
        decode = max_tokens / (time.perf_counter() - start)
    llm.llm_engine.engine_core.shutdown()
    results.put(Run(seconds, tokens, decode))


def _run_config(ctx, path: str, parts: list[tuple[int, int, list[int] | None]],
                prompts: list[list[int]], max_tokens: int) -> Run:
    """Runs each part (tp, threads, cpus) in its own process at once, the prompts split
    evenly; the batch time is the slowest part's."""
    results = ctx.Queue()
    share = len(prompts) // len(parts)
    procs = [ctx.Process(target=_workload_proc,
                         args=(path, tp, threads, cpus, prompts[i * share:(i + 1) * share],
                               max_tokens, i == 0 and len(parts) == 1, results))
             for i, (tp, threads, cpus) in enumerate(parts)]
    for p in procs:
        p.start()
    runs = [results.get() for _ in procs]
    for p in procs:
        p.join()
    return Run(max(r.seconds for r in runs), sum(r.tokens for r in runs),
               max(r.decode_tok_s for r in runs))


def run_workload(args: argparse.Namespace) -> None:
    import tempfile

    cpus = usable_cpus()
    if len(cpus) < 2:
        print("--workload needs 2 cores.")
        return
    path = _default_size_model(args.model_dir or os.path.join(tempfile.gettempdir(),
                                                             "vllm-bench-parallel-model"))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 49000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.num_prompts)]
    twin = _default_size_model(path + "-twin", twin=True)
    ctx = mp.get_context("spawn")
    configs = {
        "tp1 x2": [(1, 2, cpus[:2])],
        "tp2": [(2, 1, cpus[:2])],
        "dp2": [(1, 1, cpus[:1]), (1, 1, cpus[1:2])],
        "tp1 x1": [(1, 1, cpus[:1])],
    }
    runs = {name: _run_config(ctx, path, parts, prompts, args.max_tokens)
            for name, parts in configs.items()}
    small = [[t % 500 for t in p] for p in prompts]
    runs["twin x1"] = _run_config(ctx, twin, [(1, 1, cpus[:1])], small, args.max_tokens)
    base = runs["tp1 x2"]
    print(f"\nDefault-size workload: {args.num_prompts} requests x {args.prompt_len} prompt + "
          f"{args.max_tokens} generated tokens; one request's decode after")
    print(f"{'config':>8} {'batch s':>8} {'tok/s':>8} {'vs tp1 x2':>10} {'1-req tok/s':>12}")
    for name, r in runs.items():
        tok_s = r.tokens / r.seconds
        single = f"{r.decode_tok_s:12.1f}" if r.decode_tok_s else f"{'-':>12}"
        ratio = tok_s / (base.tokens / base.seconds)
        print(f"{name:>8} {r.seconds:>8.2f} {tok_s:>8.1f} {ratio:>10.2f} {single}")
    # tp2's decode step against half the single-thread step: what does not halve.
    one_thread_ms = 1e3 / runs["tp1 x1"].decode_tok_s
    tp2_ms = 1e3 / runs["tp2"].decode_tok_s
    overhead = tp2_ms - one_thread_ms / 2
    step_comm_us = args.step_comm_us
    measured = [r for r in _MEASURED if r.tokens == 1 and r.dtype == "bfloat16"]
    if measured:  # this run's --allreduce: one-token all-reduce x 62
        step_comm_us = measured[0].shm_us * 62
    comm = step_comm_us / 1e3
    fixed_ms = 1e3 / runs["twin x1"].decode_tok_s
    weights_ms = one_thread_ms - fixed_ms
    print(f"\nScaling model, one-request decode step = F + W / ranks + C: F (per-step work "
          f"every rank repeats: Python, op dispatch; the weightless twin at 1 thread) "
          f"{fixed_ms:.2f} ms, W (weights: streaming and multiplying, tp1 x1 - F) "
          f"{weights_ms:.2f} ms, C (collectives) {comm:.2f} ms -> predicted tp2 "
          f"{fixed_ms + weights_ms / 2 + comm:.2f} ms, measured {tp2_ms:.2f} ms")
    print(f"\nOne-request decode step: tp1 x1 {one_thread_ms:.2f} ms, tp2 {tp2_ms:.2f} ms, "
          f"ideal tp2 (half of tp1 x1) {one_thread_ms / 2:.2f} ms; overhead "
          f"{overhead:.2f} ms = communication ~{comm:.2f} ms (62 collectives at "
          f"{step_comm_us / 62:.1f} us) + repeated work and the step's round trip "
          f"~{overhead - comm:.2f} ms")


SECTIONS = {"allreduce": run_allreduce, "workload": run_workload}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--allreduce", action="store_true", help="all-reduce latency")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--calls", type=int, default=300, help="calls per timed round")
    parser.add_argument("--workload", action="store_true", help="tp1 vs tp2 vs dp2")
    parser.add_argument("--model-dir", default=None,
                        help="where the default-size random model is kept (made once)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--step-comm-us", type=float, default=620.0,
                        help="one decode step's collectives (60 all-reduces, the embedding's "
                             "all-reduce and the logits' all-gather) when --allreduce does "
                             "not run first")
    args = parser.parse_args()
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)
    for name in chosen:
        SECTIONS[name](args)


if __name__ == "__main__":
    main()
