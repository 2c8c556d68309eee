"""Runs inside llama-cpp-python's virtual environment: one request's decode speed on a GGUF.

    VENV/bin/python llama_cpp_driver.py MODEL.gguf OUTPUT_LEN THREADS WORKLOAD.json

Prints {"engine": "llama.cpp", "concurrency": 1, "tokens": n, "seconds": s} once per repeat
of the workload (prefill of the first workload prompt included, as for the other engines).
"""

import json
import sys
import time


def main() -> None:
    model, output_len, threads, workload = sys.argv[1:5]
    with open(workload) as f:
        spec = json.load(f)
    prompt = spec["prompts"][0]
    from llama_cpp import Llama

    llm = Llama(model_path=model, n_ctx=2048, n_threads=int(threads), n_batch=512,
                verbose=False)

    def run(n: int) -> int:
        llm.reset()
        count = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            count += 1
            if count == n:
                break
        return count

    run(8)  # warm-up
    for _ in range(spec.get("repeats", 1)):
        start = time.perf_counter()
        tokens = run(int(output_len))
        seconds = time.perf_counter() - start
        print(json.dumps({"engine": "llama.cpp", "concurrency": 1, "tokens": tokens,
                          "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
