"""Model-family benchmarks (random weights, no download).

    python benchmarks/benchmark_models.py --moe-dispatch     # expert dispatch alternatives
    python benchmarks/benchmark_models.py --moe-model        # one MoE model vs transformers

Only the mixture-of-experts section is here so far; the dense families' section goes beside
it (its own flags, its own functions).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

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
    from vllm.model_executor.layers.fused_moe import FusedMoE, select_experts

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
        kernels = {}
        for name, quant, pack in (("loop", None, False), ("loop packed", None, True),
                                  ("loop int8", "int8", False)):
            if pack and dtype != torch.bfloat16:
                continue
            layer.process_weights_after_loading(quant, pack)
            kernels[name] = layer.kernel
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


# `--moe-model`: a Qwen3-MoE-shaped model of ~200M parameters (~40M active a token).
MOE_MODEL: dict[str, Any] = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, num_experts=32, num_experts_per_tok=4,
                 moe_intermediate_size=384, intermediate_size=1536, vocab_size=32000,
                 norm_topk_prob=True)


def moe_model(num_prompts: int, output_len: int, dtype: str, compare_hf: bool) -> None:
    import transformers

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as path:
        from tests.model_factory import make_tiny_tokenizer

        make_tiny_tokenizer(path)
        config = transformers.Qwen3MoeConfig(max_position_embeddings=1024,
                                             **MOE_MODEL)  # pyright: ignore[reportArgumentType]
        torch.manual_seed(0)
        hf = transformers.Qwen3MoeForCausalLM(config).eval()
        hf.save_pretrained(path)
        params = sum(p.numel() for p in hf.parameters())
        print(f"Qwen3-MoE-shaped model: {params / 1e6:.0f}M parameters, {dtype}, "
              f"{num_prompts} requests x {output_len} tokens")
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(32, 129, (num_prompts,), generator=g).tolist()
        prompts = [torch.randint(100, 700, (n,), generator=g).tolist() for n in lengths]
        llm = LLM(path, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=512 * 1024**2)
        sampling = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                            use_tqdm=False)
        ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        print(f"  ours:         {ours:8.1f} output tokens/s")
        if not compare_hf:
            return
        hf = hf.to(getattr(torch, dtype))
        pad = 3
        width = max(lengths)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = (ids != pad).long()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                              min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
        theirs = (out.shape[1] - width) * num_prompts / (time.perf_counter() - start)
        print(f"  transformers: {theirs:8.1f} output tokens/s (batched generate)")
        print(f"  ratio:        {ours / theirs:8.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moe-dispatch", action="store_true")
    parser.add_argument("--moe-model", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compare-hf", action="store_true")
    args = parser.parse_args()
    if args.moe_dispatch:
        moe_dispatch(args.repeats)
    if args.moe_model:
        moe_model(args.num_prompts, args.output_len, args.dtype, args.compare_hf)


if __name__ == "__main__":
    main()
