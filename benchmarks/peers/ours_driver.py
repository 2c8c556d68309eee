"""Runs this engine for benchmark_peers.py in a process of its own, as the peers run in
theirs: every engine and setting starts fresh, none inherits another's heap or compiled
code.

    python ours_driver.py MODEL OUTPUT_LEN WORKLOAD.json ENGINE_KWARGS.json

WORKLOAD.json as for the other drivers ({"concurrency": [...], "prompts": [...],
"repeats": r}); ENGINE_KWARGS is a JSON object of `LLM` keyword arguments (dtype,
quantization, enforce_eager, ...). Prints one JSON line per concurrency and repeat:
{"engine": "this engine", "concurrency": c, "tokens": n, "seconds": s}.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's vllm


def main() -> None:
    model, output_len, workload, engine_kwargs = sys.argv[1:5]
    with open(workload) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams

    prompts = spec["prompts"]
    llm = LLM(model, max_model_len=2048, max_num_seqs=max(spec["concurrency"]),
              kv_cache_memory_bytes=1024**3, **json.loads(engine_kwargs))
    params = SamplingParams(temperature=0, max_tokens=int(output_len), ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8),
                 use_tqdm=False)
    for c in spec["concurrency"]:
        for _ in range(spec.get("repeats", 1)):
            llm.llm_engine.reset_prefix_cache()
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:c]], params,
                                use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"engine": "this engine", "concurrency": c, "tokens": tokens,
                              "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
