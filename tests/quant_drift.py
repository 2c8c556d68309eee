"""Drift of a quantized model against the unquantized one on a fixed prompt set (greedy).

Shared by tests/test_quantization.py and the README's numbers
(`python -m tests.quant_drift`)."""

from __future__ import annotations

from typing import NamedTuple

from vllm import LLM, SamplingParams

DRIFT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "The largest planet in our solar system is",
    "To make a cup of tea, you first",
    "import numpy as np\nx = np.arange(10)\n",
    "The French word for 'cat' is",
    "Photosynthesis is the process by which",
    "1, 2, 3, 5, 8, 13,",
    "The opposite of hot is",
]


class Drift(NamedTuple):
    agreement: float  # share of prompts whose first `first_n` greedy tokens are identical
    mean_common_prefix: float  # mean length of the identical greedy prefix, in tokens
    max_logprob_diff: float  # over the common prefixes: |chosen-token logprob difference|
    mean_logprob_diff: float


def greedy_runs(model: str, num_tokens: int, prompts: list[str] = DRIFT_PROMPTS,
                **engine_kwargs) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model, max_model_len=512, kv_cache_memory_bytes=64 * 1024**2, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    runs = []
    for out in outputs:
        completion = out.outputs[0]
        lps = [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]
        runs.append((list(completion.token_ids), lps))
    return runs


def measure_drift(reference: list[tuple[list[int], list[float]]],
                  candidate: list[tuple[list[int], list[float]]], first_n: int) -> Drift:
    agree, prefixes, diffs = 0, [], []
    for (ref_ids, ref_lps), (ids, lps) in zip(reference, candidate):
        common = 0
        while common < min(len(ref_ids), len(ids)) and ref_ids[common] == ids[common]:
            common += 1
        agree += common >= first_n
        prefixes.append(common)
        diffs += [abs(a - b) for a, b in zip(ref_lps[:common], lps[:common])]
    return Drift(agree / len(reference), sum(prefixes) / len(prefixes), max(diffs, default=0.0),
                 sum(diffs) / max(len(diffs), 1))


if __name__ == "__main__":
    from vllm.transformers_utils.default_model import default_model_path

    path = default_model_path()
    reference = greedy_runs(path, 32, dtype="float32", quantization="none")
    for label, kwargs in [("bfloat16", {"dtype": "bfloat16"}),
                          ("int8 (float32 activations)", {"dtype": "float32",
                                                          "quantization": "int8"}),
                          ("int8 (bfloat16 activations)", {"dtype": "bfloat16",
                                                           "quantization": "int8"}),
                          # One request at a time: every step takes the block kernel.
                          ("gguf (one request)", {"dtype": "bfloat16",
                                                       "quantization": "gguf",
                                                       "max_num_seqs": 1})]:
        drift = measure_drift(reference, greedy_runs(path, 32, **kwargs), first_n=16)
        print(f"{label:<30} agreement@16 {drift.agreement:.2f}  mean common prefix "
              f"{drift.mean_common_prefix:.1f}/32  logprob diff max {drift.max_logprob_diff:.3f} "
              f"mean {drift.mean_logprob_diff:.4f}")
