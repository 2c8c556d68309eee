"""Runs inside llama-cpp-python's virtual environment: llama.cpp's side of
`benchmark_peers.py --single` (one request at a time on the GGUF file).

    VENV/bin/python llama_cpp_single_driver.py MODEL.gguf THREADS WORKLOAD.json

Speculation is llama-cpp-python's own prompt lookup (`LlamaPromptLookupDecoding`, drafts
copied from the context), with the workload's `num_speculative_tokens` and
`prompt_lookup_max`. Prints single_common's JSON lines.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from single_common import measure  # noqa: E402


def main() -> None:
    model, threads, workload = sys.argv[1:4]
    with open(workload) as f:
        spec = json.load(f)
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    def load(draft):
        return Llama(model_path=model, n_ctx=2048, n_threads=int(threads),
                     n_threads_batch=int(threads), n_batch=512, draft_model=draft,
                     verbose=False)

    plain = load(None)
    lookup = spec["prompt_lookup"]
    drafting = load(LlamaPromptLookupDecoding(num_pred_tokens=lookup["num_speculative_tokens"],
                                              max_ngram_size=lookup["prompt_lookup_max"]))

    def generate(prompt, max_tokens, speculative):
        llm = drafting if speculative else plain
        llm.reset()  # no prefix reuse from the previous call
        return llm.generate(prompt, temp=0.0, top_k=1, reset=True)

    measure(spec, generate)


if __name__ == "__main__":
    main()
