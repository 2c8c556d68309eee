"""Runs inside vLLM's CPU build's virtual environment (never imports this project).

    VENV/bin/python vllm_cpu_driver.py MODEL TOKENIZER_DIR DTYPE OUTPUT_LEN WORKLOAD.json \
        [MAX_MODEL_LEN]

WORKLOAD.json: {"concurrency": [1, 64], "prompts": [[ids...], ...], "repeats": r}; prints
one JSON line per concurrency and repeat: {"engine": "vllm-cpu", "concurrency": c,
"tokens": n, "seconds": s}. The prefix cache is reset before each run, as for this engine
(the first c prompts of a run are the prompts of the smaller runs before it).

With `ATEN_CPU_CAPABILITY=avx2` in the environment (the AVX2 proxy of docs/testing.md, on an
AVX-512 machine), vLLM is also told the processor has no AVX-512, so that it loads its AVX2
kernels (`vllm._C_AVX2`) and its AVX2 attention, as on an AVX2-only processor: torch's
own kernels already follow that variable; vLLM asks `torch.cpu._is_avx512_supported()`.
"""

import json
import os
import sys
import time


def main() -> None:
    model, tokenizer, dtype, output_len, workload = sys.argv[1:6]
    max_model_len = int(sys.argv[6]) if len(sys.argv) > 6 else 2048
    with open(workload) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2":
        import torch

        torch.cpu._is_avx512_supported = lambda: False  # noqa: SLF001  (see the docstring)
        torch.cpu._is_avx512_bf16_supported = lambda: False  # noqa: SLF001
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
              max_num_seqs=max(spec["concurrency"]), enforce_eager=False)
    params = SamplingParams(temperature=0, max_tokens=int(output_len), ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=spec["prompts"][0])],
                 SamplingParams(max_tokens=8), use_tqdm=False)
    for c in spec["concurrency"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"][:c]]
        for _ in range(spec.get("repeats", 1)):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"engine": "vllm-cpu", "dtype": dtype, "concurrency": c,
                              "tokens": tokens, "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
