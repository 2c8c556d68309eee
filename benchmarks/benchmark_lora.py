"""Multi-LoRA serving cost: the same requests on the base model and through adapters.

    python benchmarks/benchmark_lora.py [MODEL] [--requests 64] [--adapters 4] [--rank 16]
        [--max-tokens 64] [--repeats 2] [--cpu-time]

One run (default model: the packaged SmolLM2-135M GGUF; random non-zero rank-16 adapters on
all of q/k/v/o/gate/up/down, written as PEFT directories):
- base: `requests` prompts on an engine without LoRA;
- N adapters: the same prompts spread round-robin over `adapters` adapters (as many slots),
  on an engine with LoRA enabled;
- 1 adapter: the same prompts all through one adapter;
- base on the LoRA engine: no adapter rows (the graphs' LoRA-free copies).
Output tokens per second of each (every request generates exactly `max-tokens` tokens) and
the ratios to the base engine (the target for N adapters is >= 0.8). Repeats interleave the
cases; the fastest of each is kept. On a machine loaded by other work, `--cpu-time` counts
the process's CPU time instead of wall time: with one thread (`OMP_NUM_THREADS=1`) that is
the work each case costs, whatever share of the cores the process got (with two threads,
a loaded machine stalls every parallel region on a descheduled thread: a run has measured
the base model at 41 output tok/s, 877 on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.lora.peft import SUPPORTED_MODULES, projection_shapes  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.transformers_utils.config import get_config  # noqa: E402
from vllm.transformers_utils.default_model import default_model_path  # noqa: E402

PROMPTS = ["Write a short story about a lighthouse keeper.",
           "Explain how a refrigerator works.",
           "List some facts about the moon.",
           "Describe your favourite meal in detail."]


def write_adapter(path: str, hf_config, rank: int, seed: int) -> str:
    """A PEFT LoRA directory with seeded random A and B on every supported projection."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(hf_config)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for name in SUPPORTED_MODULES:
            in_f, out_f = shapes[name]
            group = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, in_f,
                                                                    generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(out_f, rank,
                                                                    generator=generator)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(SUPPORTED_MODULES), "bias": "none"}, f)
    return path


def run(llm: LLM, prompts: list[str], params: SamplingParams,
        loras: list[LoRARequest | None], cpu_time: bool = False) -> float:
    """Output tokens per second (wall, or the process's CPU time) of one batch."""
    clock = time.process_time if cpu_time else time.perf_counter
    start = clock()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = clock() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == len(prompts) * params.max_tokens  # type: ignore[operator]
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true",
                        help="rates per second of the process's CPU time, not wall time")
    args = parser.parse_args()
    model = args.model or default_model_path()
    hf_config = get_config(model)
    root = tempfile.mkdtemp(prefix="lora-bench-")
    adapters = [LoRARequest(f"adapter{i}", i + 1,
                            write_adapter(os.path.join(root, f"a{i}"), hf_config, args.rank, i))
                for i in range(args.adapters)]
    engine = {"max_model_len": 512, "kv_cache_memory_bytes": 512 * 2**20}
    base_llm = LLM(model, **engine)
    lora_llm = LLM(model, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                   **engine)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    n = args.requests
    cases = {
        "base (LoRA off)": (base_llm, [None] * n),
        f"{args.adapters} adapters": (lora_llm, [adapters[i % len(adapters)] for i in range(n)]),
        "1 adapter": (lora_llm, [adapters[0]] * n),
        "base (LoRA on)": (lora_llm, [None] * n),
    }
    for llm, loras in cases.values():  # warm-up: adapters loaded, graphs and caches hot
        run(llm, prompts[:8], params, loras[:8])
    print(f"{n} requests x {args.max_tokens} tokens, rank-{args.rank} adapters on all "
          f"projections, dtype {lora_llm.llm_engine.vllm_config.model_config.dtype}, "
          f"{torch.get_num_threads()} threads, {'CPU' if args.cpu_time else 'wall'} time",
          flush=True)
    best = dict.fromkeys(cases, 0.0)
    unit = "output tok/CPU s" if args.cpu_time else "output tok/s"
    for repeat in range(args.repeats):
        for name, (llm, loras) in cases.items():
            rate = run(llm, prompts, params, loras, args.cpu_time)
            best[name] = max(best[name], rate)
            print(f"  repeat {repeat}: {name:<18} {rate:8.1f} {unit}", flush=True)
    base = best["base (LoRA off)"]
    for name, rate in best.items():
        print(f"  {name:<18} {rate:8.1f} {unit}   {rate / base:5.2f}x base")


if __name__ == "__main__":
    main()
