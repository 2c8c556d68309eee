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

`--kv-memory`: the KV cache one 8k-token request holds at its peak with sliding-window
layers against the same model with every layer global. The request runs through the real
`KVCacheManager` (prefill in 2048-token chunks, then decode to 8192 tokens; window blocks
go back to the pool as it advances); a block costs `group_size` layers of K and V
(`kv_cache_groups`). Geometries of the published configs (bfloat16 cache, block size 16):

    python benchmarks/benchmark_models.py --kv-memory
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

import transformers  # noqa: E402

from benchmarks.benchmark_throughput import make_workload, report, run_hf  # noqa: E402
from tests.core_factories import make_scheduler_request  # noqa: E402
from tests.model_factory import make_tiny_model  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_groups import (  # noqa: E402
    KVCacheGroupSpec,
    group_size,
    layer_sliding_windows,
    make_kv_cache_groups,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402

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


# ---- sliding windows: KV memory ---------------------------------------------------------
BLOCK_SIZE = 16
NUM_TOKENS = 8192
PREFILL_TOKENS = 4096
CHUNK = 2048
DTYPE_BYTES = 2  # bfloat16

# name -> (config class, kwargs): the published geometries (layers, KV heads, head size,
# window, layer pattern).
KV_CONFIGS = {
    "gemma-2-2b": (transformers.Gemma2Config, dict(
        num_hidden_layers=26, num_key_value_heads=4, head_dim=256, sliding_window=4096)),
    "gemma-3-1b": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=26, num_key_value_heads=1, head_dim=256, sliding_window=512)),
    "mistral-7b-v0.1": (transformers.MistralConfig, dict(
        num_hidden_layers=32, num_key_value_heads=8, head_dim=128, sliding_window=4096)),
}


def peak_kv_bytes(groups: list[KVCacheGroupSpec], num_kv_heads: int, head_dim: int) -> int:
    """Peak bytes of KV one request of NUM_TOKENS tokens (PREFILL_TOKENS of prompt in
    CHUNK-token steps, then one token a step) holds under `groups`."""
    blocks_per_request = -(-NUM_TOKENS // BLOCK_SIZE) * len(groups) + 1
    kv = KVCacheManager(blocks_per_request + 1, BLOCK_SIZE, False, groups)
    request = make_scheduler_request("r", [5] * PREFILL_TOKENS, block_size=None,
                                     max_model_len=NUM_TOKENS + 1, max_tokens=NUM_TOKENS)
    peak = 0
    while request.num_computed_tokens < NUM_TOKENS:
        if request.num_computed_tokens >= request.num_tokens:
            request.append_output_token_ids([5])
        n = min(CHUNK, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, n) is not None
        request.num_computed_tokens += n
        peak = max(peak, kv.block_pool.num_blocks - 1 - kv.block_pool.get_num_free_blocks())
    block_bytes = 2 * BLOCK_SIZE * num_kv_heads * head_dim * DTYPE_BYTES * group_size(groups)
    return peak * block_bytes


def kv_memory() -> None:
    print(f"KV cache held by one {NUM_TOKENS}-token request at its peak (bfloat16, block "
          f"size {BLOCK_SIZE}):")
    print(f"{'model':18} {'window':>7} {'groups':>7} {'windowed MiB':>13} {'full MiB':>9} "
          f"{'ratio':>6}")
    for name, (config_class, kwargs) in KV_CONFIGS.items():
        config = config_class(**kwargs)
        layers = config.num_hidden_layers
        windows = layer_sliding_windows(config, layers)
        windowed = peak_kv_bytes(make_kv_cache_groups(windows), config.num_key_value_heads,
                                 config.head_dim)
        full = peak_kv_bytes(make_kv_cache_groups([None] * layers),
                             config.num_key_value_heads, config.head_dim)
        print(f"{name:18} {config.sliding_window:>7} {len(make_kv_cache_groups(windows)):>7} "
              f"{windowed / 2**20:>13.1f} {full / 2**20:>9.1f} {windowed / full:>6.2f}")


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
    parser.add_argument("--kv-memory", action="store_true",
                        help="only the KV memory of one 8k-token request, windowed vs full")
    args = parser.parse_args()
    if args.kv_memory:
        kv_memory()
        return
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
