"""Structured outputs' cost: JSON-schema-constrained generation against unconstrained.

    python benchmarks/benchmark_structured_outputs.py [MODEL] [--requests 64] [--schemas 4]
        [--repeats 5]

One run, one engine (default: the packaged SmolLM2-135M GGUF):
- throughput: `requests` prompts, each with one of `schemas` distinct JSON schemas (so the
  compile cache serves all but the first of each), against the same prompts unconstrained;
  output tokens per second of each and their ratio (the target is >= 0.9); once with
  compact JSON, once with the default bounded whitespace; each the best of `repeats`
  interleaved runs, with the spread of the ratios of the runs taken pair by pair, and
  the same ratio in CPU time (this process's threads: what other jobs' load moves least);
- compile time of one schema, cold (a fresh compiler; the tokenizer table is built
  beforehand) and cached;
- time to first token added: one request with a schema never seen before, against one with
  a cached schema and one unconstrained (max_tokens=1 each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.structured_output_schemas import SCHEMAS  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.sampling_params import StructuredOutputsParams  # noqa: E402
from vllm.transformers_utils.default_model import default_model_path  # noqa: E402
from vllm.v1.structured_output.manager import GrammarCompiler  # noqa: E402

PROMPT = "Answer with a JSON value that matches the request.\nJSON:"
# Object schemas of a few dozen tokens each.
BENCH_SCHEMAS = [SCHEMAS[i] for i in (8, 28, 31, 35, 11, 12, 29, 32)]


def run(llm: LLM, params: list[SamplingParams]) -> tuple[float, float, list[int]]:
    """Seconds for the batch (wall clock, and CPU time of this process's threads), and
    each request's output length."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return elapsed, cpu, [len(o.outputs[0].token_ids) for o in outputs]


def ttft(llm: LLM, constraint: StructuredOutputsParams | None) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, structured_outputs=constraint)
    start = time.perf_counter()
    llm.generate(PROMPT, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--schemas", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(args.model or default_model_path(), max_model_len=512)
    schemas = BENCH_SCHEMAS[:args.schemas]
    run(llm, [SamplingParams(max_tokens=8)] * 4)  # warm-up (graphs, caches)
    # The front end's compiler: the grammar cache every request goes through.
    compiler = llm.llm_engine.processor.grammar_compiler
    assert compiler is not None
    # Compact JSON (tool calls' and strict schemas' default) and bounded whitespace (the
    # default elsewhere: a line break and an indent between tokens).
    for whitespace, compact in (("compact", True), ("bounded whitespace", False)):
        constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                      structured_outputs=StructuredOutputsParams(
                                          json=schemas[i % len(schemas)],
                                          disable_any_whitespace=compact))
                       for i in range(args.requests)]
        compiled_before = compiler.num_compiled
        load = os.getloadavg()[0]
        t_con, cpu_con, lengths = run(llm, constrained)
        compiled = compiler.num_compiled - compiled_before
        # The same requests unconstrained, each made to generate as many tokens as it did
        # constrained: the same batch shape step by step, so only the constraint differs.
        free = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        t_free, cpu_free, free_lengths = run(llm, free)
        assert free_lengths == lengths
        # Interleaved repeats, the faster of each kept: a shared machine's noise is one-sided.
        # Each pair (constrained and unconstrained back to back) also gives a ratio of
        # its own: their spread shows how far one pair alone can be trusted.
        pair_ratios = [t_free / t_con]
        for i in range(args.repeats - 1):  # which goes first alternates
            if i % 2:
                t_c, c_c, _ = run(llm, constrained)
                t_f, c_f, _ = run(llm, free)
            else:
                t_f, c_f, _ = run(llm, free)
                t_c, c_c, _ = run(llm, constrained)
            pair_ratios.append(t_f / t_c)
            t_con, t_free = min(t_con, t_c), min(t_free, t_f)
            cpu_con, cpu_free = min(cpu_con, c_c), min(cpu_free, c_f)
        n_tokens = sum(lengths)
        tps_free, tps_con = n_tokens / t_free, n_tokens / t_con
        pair_ratios.sort()
        print(f"throughput, {whitespace} ({args.requests} requests, {len(schemas)} schemas, "
              f"{compiled} compiled, best of {args.repeats}; load {load:.1f} -> "
              f"{os.getloadavg()[0]:.1f})")
        print(f"  unconstrained: {n_tokens} tokens in {t_free:.2f} s = {tps_free:.1f} tok/s")
        print(f"  json schema:   {n_tokens} tokens in {t_con:.2f} s = {tps_con:.1f} tok/s")
        print(f"  ratio: {tps_con / tps_free:.3f} (target >= 0.9); pairs: min "
              f"{pair_ratios[0]:.3f}, median {pair_ratios[len(pair_ratios) // 2]:.3f}, max "
              f"{pair_ratios[-1]:.3f}")
        # CPU time counts this process's work, not the waits other jobs impose on it: the
        # steadier measure on a shared machine (the least of each, as above).
        print(f"  CPU time: unconstrained {cpu_free:.2f} s, json schema {cpu_con:.2f} s; "
              f"ratio {cpu_free / cpu_con:.3f}", flush=True)

    fresh = GrammarCompiler(lambda: llm.get_tokenizer(), compiler.vocab_size)
    fresh.backend  # noqa: B018  (builds the tokenizer table outside the timing)
    schema = StructuredOutputsParams(json=SCHEMAS[31])
    start = time.perf_counter()
    fresh.compile(schema)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    fresh.compile(schema)
    cached = time.perf_counter() - start
    print(f"compile (people schema): cold {cold * 1e3:.2f} ms, cached {cached * 1e6:.1f} us")

    unseen = StructuredOutputsParams(json={**SCHEMAS[29], "title": "unseen"})
    t_unseen = ttft(llm, unseen)
    t_cached = ttft(llm, unseen)
    t_free1 = ttft(llm, None)
    print(f"time to first token: unconstrained {t_free1 * 1e3:.1f} ms, new schema "
          f"{t_unseen * 1e3:.1f} ms (+{(t_unseen - t_free1) * 1e3:.1f}), cached schema "
          f"{t_cached * 1e3:.1f} ms (+{(t_cached - t_free1) * 1e3:.1f})")


if __name__ == "__main__":
    main()
