"""This engine's side of `benchmark_peers.py --single`, in a process of its own.

    python ours_single_driver.py MODEL WORKLOAD.json ENGINE_KWARGS.json

One request at a time through `LLMEngine` (tokens as they come, for the time to the first),
prefix cache reset before each. Speculation builds a second engine with the workload's
`speculative_config` (ngram prompt lookup).
Prints single_common's JSON lines.
"""

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's vllm
sys.path.insert(0, str(Path(__file__).resolve().parent))

from single_common import measure  # noqa: E402


def main() -> None:
    model, workload, engine_kwargs = sys.argv[1:4]
    with open(workload) as f:
        spec = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs = dict(max_model_len=2048, max_num_seqs=8, kv_cache_memory_bytes=256 * 1024**2,
                  **json.loads(engine_kwargs))
    speculative_config = {"method": "ngram", **spec["prompt_lookup"]}
    engines = {False: LLM(model, **kwargs).llm_engine,
               True: LLM(model, speculative_config=speculative_config, **kwargs).llm_engine}
    ids = itertools.count()

    def generate(prompt, max_tokens, speculative):
        engine = engines[speculative]
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(str(next(ids)), {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                yield from output.outputs[0].token_ids

    measure(spec, generate)


if __name__ == "__main__":
    main()
