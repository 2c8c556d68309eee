"""Runs inside llama-cpp-python's virtual environment: llama.cpp's greedy continuations for
`compare_llama_cpp_greedy.py`.

    VENV/bin/python llama_cpp_greedy_driver.py MODEL.gguf THREADS NUM_TOKENS PROMPTS.json

PROMPTS.json: a list of token-id lists (given as they are: no BOS added). Each prompt is run
alone from an empty cache, greedy (`top_k=1`, temperature 0), EOS ignored, for NUM_TOKENS
tokens. Prints one JSON line: {"tokens": [[...], ...], "margins": [[...], ...]}, where a
margin is the gap between the best and second-best logit at that step.
"""

import json
import sys


def main() -> None:
    model, threads, num_tokens, prompts_path = sys.argv[1:5]
    with open(prompts_path) as f:
        prompts = json.load(f)
    import numpy as np
    from llama_cpp import Llama  # pyright: ignore[reportMissingImports]  (the peer's venv)

    llm = Llama(model_path=model, n_ctx=1024, n_threads=int(threads),
                n_threads_batch=int(threads), n_batch=512, logits_all=False, verbose=False)
    vocab = llm.n_vocab()
    all_tokens, all_margins = [], []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        tokens, margins = [], []
        for _ in range(int(num_tokens)):
            # The last evaluated token's row (without logits_all, `eval` keeps no scores).
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).astype(
                np.float64)
            top2 = np.partition(logits, -2)[-2:]
            token = int(np.argmax(logits))
            tokens.append(token)
            margins.append(float(top2[1] - top2[0]))
            llm.eval([token])
        all_tokens.append(tokens)
        all_margins.append(margins)
    print(json.dumps({"tokens": all_tokens, "margins": all_margins}), flush=True)


if __name__ == "__main__":
    main()
