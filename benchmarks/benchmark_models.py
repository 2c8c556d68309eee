"""Model-family benchmarks, by section.

`--kv-memory`: the KV cache one 8k-token request holds at its peak with sliding-window
layers against the same model with every layer global. The request runs through the real
`KVCacheManager` (prefill in 2048-token chunks, then decode to 8192 tokens; window blocks
go back to the pool as it advances); a block costs `group_size` layers of K and V
(`kv_cache_groups`). Geometries of the published configs (bfloat16 cache, block size 16):

    python benchmarks/benchmark_models.py --kv-memory
"""

from __future__ import annotations

import argparse

import transformers

from tests.core_factories import make_scheduler_request
from vllm.v1.core.kv_cache_groups import (
    KVCacheGroupSpec,
    group_size,
    layer_sliding_windows,
    make_kv_cache_groups,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kv-memory", action="store_true",
                        help="KV memory of one 8k-token request, windowed vs full attention")
    args = parser.parse_args()
    if args.kv_memory:
        kv_memory()
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
