"""Throughput of each model family against transformers' batched `generate`.

For a ~100-300M-parameter random-weight config of each family (written once to
--workdir with the tiny tokenizer), N requests (default 64) with prompt lengths drawn from
[--min-len, --max-len] (seeded random token ids), each generating exactly --output-len
tokens, in one `LLM.generate` call; then the same prompts through transformers `generate`
(greedy, left-padded batches of --hf-batch-size). Prints output tokens/s and the ratio.

    python benchmarks/benchmark_models.py                        # every family
    python benchmarks/benchmark_models.py --families qwen3 phi3  # some
    python benchmarks/benchmark_models.py --num-prompts 16 --output-len 32 --layers 4

Sections: `FAMILIES` maps a family name to its `Family` (the tests' model factory arch and
the config overrides that make it ~100M+); add a family by adding an entry.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.benchmark_throughput import make_workload, report, run_hf  # noqa: E402
from tests.model_factory import make_tiny_model  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

# ~105M parameters with the defaults below: 12 layers of 768 hidden, 12 query / 4 KV
# heads, MLP 3072 (attention 1.6M + MLP 7.1M per layer).
BASE: dict[str, Any] = {"hidden_size": 768, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "num_key_value_heads": 4,
                        "intermediate_size": 3072, "max_position_embeddings": 1024}


@dataclass
class Family:
    arch: str  # tests/model_factory.py's name for it
    overrides: dict[str, Any] = field(default_factory=dict)


# ---- dense decoders ----------------------------------------------------------------------
FAMILIES: dict[str, Family] = {
    "llama": Family("llama"),
    "qwen3": Family("qwen3", {"head_dim": 64}),
    "mistral": Family("mistral", {"head_dim": 64}),
    "phi3": Family("phi3", {"partial_rotary_factor": 0.75}),
    "olmo2": Family("olmo2"),
    "granite": Family("granite"),
}


def build(workdir: str, name: str, family: Family, layers: int | None) -> str:
    path = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        overrides = {**BASE, **family.overrides}
        if layers is not None:
            overrides["num_hidden_layers"] = layers
        make_tiny_model(path, family.arch, **overrides)
    return path


def run_family(path: str, args: argparse.Namespace) -> tuple[float, float | None]:
    llm = LLM(path, dtype=args.dtype, max_model_len=args.max_len + args.output_len + 8,
              max_num_seqs=args.num_prompts, enforce_eager=args.enforce_eager)
    dtype = llm.llm_engine.vllm_config.model_config.dtype
    params = sum(p.numel() for p in
                 llm.llm_engine.engine_core.model_executor.model_runner.model.parameters())
    print(f"  {params / 1e6:.0f}M parameters, {str(dtype).removeprefix('torch.')}")
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    token_ids = make_workload(vocab, args.num_prompts, args.min_len, args.max_len)
    prompts = [{"prompt_token_ids": ids} for ids in token_ids]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], greedy, use_tqdm=False)  # warm-up
    llm.llm_engine.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    ours = report("  engine", time.perf_counter() - start,
                  sum(len(o.outputs[0].token_ids) for o in outputs))
    llm.llm_engine.engine_core.shutdown()
    del llm
    if args.skip_hf:
        return ours, None
    theirs = report("  transformers generate",
                    *run_hf(path, token_ids, args.output_len, dtype, args.hf_batch_size))
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES),
                        choices=list(FAMILIES))
    parser.add_argument("--workdir", default="/tmp/benchmark_models")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=None,
                        help="override the configs' layer count (smaller, faster runs)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    for name in args.families:
        print(f"{name}:")
        results[name] = run_family(build(args.workdir, name, FAMILIES[name], args.layers),
                                   args)
    print("\nfamily      engine tok/s   transformers tok/s   ratio")
    for name, (ours, theirs) in results.items():
        ratio = f"{ours / theirs:5.2f}x" if theirs else "   -"
        hf = f"{theirs:10.1f}" if theirs else "         -"
        print(f"{name:<10} {ours:12.1f}   {hf}          {ratio}")


if __name__ == "__main__":
    main()
