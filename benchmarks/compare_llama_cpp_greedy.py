"""Greedy continuations of this engine and llama.cpp on the same GGUF file: how many of a
fixed set of prompts agree on their first tokens, how long the common prefixes are, and at
each first difference how close the choice was (both engines quantize activations, in other
orders, so a near tie can go either way).

    python benchmarks/compare_llama_cpp_greedy.py --llama-python /work/peers/llama-venv/bin/python
    python benchmarks/compare_llama_cpp_greedy.py --gguf-file /tmp/gemma-3-270m-q4_k_m.gguf ...

The prompts are `tests/quant_drift.py`'s twelve, as token ids from this engine's tokenizer
(with the BOS the file asks for), given to both engines as they are; each engine decodes
`--num-tokens` greedy tokens per prompt, one prompt at a time, EOS ignored. This engine runs
with the file's own block types (`quantization="gguf"`, the default for a `.gguf` path) in
each `--dtype`; llama.cpp (`peers/llama_cpp_greedy_driver.py`, its own virtual environment)
with `--threads` threads. A row per prompt: the common prefix, and where they part, both
engines' margins there (best minus second-best: a logit gap for llama.cpp, a logprob gap for
this engine, the same quantity). Then each engine against this engine on the same weights
widened to float32 (`quantization="none"`), the reference both approximate.
"""

# ruff: noqa: I001
from __future__ import annotations

import vllm  # noqa: F401  (first: it sets how OpenMP threads wait; see benchmark_multimodal)

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchmark_peers import run_in_neutral_dir  # noqa: E402
from tests.quant_drift import DRIFT_PROMPTS  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.transformers_utils.default_model import default_model_path  # noqa: E402

FIRST_N = 4  # "the first words": the first four tokens


def ours(path: str, prompts: list[list[int]], num_tokens: int, dtype: str,
         quantization: str = "gguf") -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens and each step's margin (top-1 minus top-2 logprob), one prompt at a
    time."""
    llm = LLM(path, dtype=dtype, quantization=quantization, max_model_len=1024,
              max_num_seqs=1, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=2)
    tokens, margins = [], []
    for ids in prompts:
        completion = llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                  use_tqdm=False)[0].outputs[0]
        assert completion.logprobs is not None
        tokens.append(list(completion.token_ids))
        steps = []
        for entry in completion.logprobs:
            best = sorted((lp.logprob for lp in entry.values()), reverse=True)
            steps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
        margins.append(steps)
    llm.shutdown()
    return tokens, margins


def llama_cpp(python: str, path: str, prompts: list[list[int]], num_tokens: int,
              threads: int) -> tuple[list[list[int]], list[list[float]]]:
    driver = Path(__file__).resolve().parent / "peers" / "llama_cpp_greedy_driver.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    try:
        proc, rows = run_in_neutral_dir([python, str(driver), path, str(threads),
                                         str(num_tokens), f.name])
    finally:
        os.unlink(f.name)
    if proc.returncode != 0 or not rows:
        raise SystemExit(f"llama.cpp failed:\n{(proc.stderr or proc.stdout)[-2000:]}")
    return rows[-1]["tokens"], rows[-1]["margins"]


Run = tuple[list[list[int]], list[list[float]]]


def compare(label: str, tokenizer, prompts: list[list[int]], a: Run, b: Run, num_tokens: int,
            rows: bool = True) -> None:
    agree, prefixes = 0, []
    if rows:
        print(f"\n{label}: common greedy prefix per prompt (of {num_tokens}); where they "
              f"part, each engine's margin there (ours / llama.cpp)")
    for i, ((ids, margins), (ref, ref_margins)) in enumerate(
            zip(zip(*a, strict=True), zip(*b, strict=True), strict=True)):
        common = 0
        while common < min(len(ids), len(ref)) and ids[common] == ref[common]:
            common += 1
        agree += common >= FIRST_N
        prefixes.append(common)
        text = tokenizer.decode(prompts[i])[-28:].replace("\n", "\\n")
        line = f"  {i:2d} {text!r:34s} {common:3d}"
        if common < min(len(ids), len(ref)):
            line += (f"   parts at {common}: margins {margins[common]:.3f} / "
                     f"{ref_margins[common]:.3f}; ours {tokenizer.decode(ids[common:common + 3])!r}"
                     f" llama.cpp {tokenizer.decode(ref[common:common + 3])!r}")
        if rows:
            print(line)
    print(f"  {'' if rows else label + ': '}agree on the first {FIRST_N} tokens: {agree} of "
          f"{len(prompts)}; mean common prefix {sum(prefixes) / len(prefixes):.1f} of "
          f"{num_tokens}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--gguf-file", default=None, help="default: the default model's file")
    parser.add_argument("--llama-python", required=True,
                        help="the python of llama-cpp-python's virtual environment")
    parser.add_argument("--num-tokens", type=int, default=32)
    parser.add_argument("--dtype", nargs="+", default=["float32", "auto"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    path = args.gguf_file or default_model_path()
    probe = LLM(path, max_model_len=64, enforce_eager=True, kv_cache_memory_bytes=8 * 1024**2)
    tokenizer = probe.get_tokenizer()
    prompts = [list(tokenizer.encode(p)) for p in DRIFT_PROMPTS]
    probe.shutdown()
    del probe
    name = os.path.basename(path)
    reference = llama_cpp(args.llama_python, path, prompts, args.num_tokens, args.threads)
    runs = {dtype: ours(path, prompts, args.num_tokens, dtype) for dtype in args.dtype}
    for dtype, run in runs.items():
        compare(f"{name}, this engine ({dtype}) against llama.cpp", tokenizer, prompts, run,
                reference, args.num_tokens)
    # Who is nearer the weights' own answer: both against this engine on the same weights
    # widened to float32 (no activation quantization).
    widened = ours(path, prompts, args.num_tokens, "float32", quantization="none")
    print("\nAgainst the float32 reference of the same (dequantized) weights:")
    compare("llama.cpp", tokenizer, prompts, reference, widened, args.num_tokens, rows=False)
    for dtype, run in runs.items():
        compare(f"this engine ({dtype})", tokenizer, prompts, run, widened, args.num_tokens,
                rows=False)


if __name__ == "__main__":
    main()
