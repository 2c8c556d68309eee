"""Image prompts on a small LLaVA-shaped model (random weights, built here): this engine
against transformers' batched `generate`, in one run.

Workload 1 (distinct): N requests (default 64), each with its own image.
Workload 2 (repeated): N requests with one and the same image: the engine's encoder cache
runs the vision tower once, and the prefix cache shares the image's KV blocks.
Both greedy, `--max-tokens` new tokens each, EOS ignored; requests per second and the ratio.
For workload 1 the engine also runs with its vision tower fed one image per call (other
images, same sizes), the way it ran before the requests of a step shared one encoder batch.

    python benchmarks/benchmark_multimodal.py
    python benchmarks/benchmark_multimodal.py --num-requests 16 --max-tokens 16
    python benchmarks/benchmark_multimodal.py --vllm-cpu-python /work/peers/vllm-venv/bin/python

`--vllm-cpu-python`: also vLLM's CPU build on the same directory and images
(`peers/vllm_cpu_multimodal_driver.py`, in a process of its own from a neutral directory);
where it cannot run, the end of its error output is printed in place of its numbers.
"""

# ruff: noqa: I001
from __future__ import annotations

# vllm first: it sets how OpenMP threads wait for work before torch loads libgomp
# (vllm/platforms/openmp.py). Imported after torch, the engine and transformers both ran
# with libgomp's long default spin, and on a shared machine every small op of a decode step
# waited for a preempted thread (decode steps of 64 requests 6-10x slower).
import vllm  # noqa: F401

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm import LLM, SamplingParams

PROMPT = "USER: <image>\nWhat is in this picture?\nASSISTANT:"
IMAGE_TOKEN = "<image>"


def build_model(path: str) -> None:
    """A LLaVA with a 224 px, patch-16 CLIP tower (196 image positions, 6 layers of 384)
    and a 6-layer Llama of 512, with the tests' tiny tokenizer plus <image>."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import transformers
    from transformers import AutoTokenizer, CLIPImageProcessorPil

    from tests.model_factory import make_tiny_tokenizer

    make_tiny_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.save_pretrained(path)
    vision = transformers.CLIPVisionConfig(hidden_size=384, intermediate_size=1536,
                                           num_hidden_layers=6, num_attention_heads=6,
                                           image_size=224, patch_size=16)
    text = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=512,
                                    intermediate_size=1376, num_hidden_layers=6,
                                    num_attention_heads=8, num_key_value_heads=4,
                                    max_position_embeddings=1024, pad_token_id=3)
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    CLIPImageProcessorPil().save_pretrained(path)
    processor(path).save_pretrained(path)  # processor_config.json, for vLLM's CPU build


def processor(path: str) -> Any:
    """transformers' LLaVA processor of the model at `path` (tokenizer and image processor
    saved there)."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return LlavaProcessor(image_processor=CLIPImageProcessorPil.from_pretrained(path),
                          tokenizer=tokenizer, patch_size=16,
                          vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                          num_additional_image_tokens=1)


def images(n: int, repeated: bool, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
    return [first if repeated or i == 0 else rng.integers(0, 256, (240, 320, 3), np.uint8)
            for i in range(n)]


def run_engine(llm: LLM, pictures: list[np.ndarray], max_tokens: int) -> float:
    llm.llm_engine.reset_prefix_cache()
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": p}} for p in pictures]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


@torch.inference_mode()
def run_hf(path: str, pictures: list[np.ndarray], max_tokens: int, batch_size: int) -> float:
    from transformers import LlavaForConditionalGeneration

    prepare = processor(path)
    model: Any = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    start = time.perf_counter()
    for i in range(0, len(pictures), batch_size):
        batch = pictures[i:i + batch_size]
        inputs = prepare(text=[PROMPT] * len(batch), images=batch, return_tensors="pt",
                         padding=True)
        model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False)
    return time.perf_counter() - start


def run_vllm_cpu(python: str, path: str, pictures: list[np.ndarray], max_tokens: int
                 ) -> float | str:
    """vLLM's CPU build's seconds for the requests (each image with `PROMPT`), or the end
    of its error output."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.benchmark_peers import run_in_neutral_dir

    driver = Path(__file__).resolve().parent / "peers" / "vllm_cpu_multimodal_driver.py"
    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as f:
        np.save(f, np.stack(pictures))
    try:
        proc, rows = run_in_neutral_dir([python, str(driver), path, f.name, PROMPT,
                                         str(max_tokens)])
    finally:
        os.unlink(f.name)
    if proc.returncode != 0 or not rows:
        return (proc.stderr or proc.stdout)[-1500:]
    return float(rows[-1]["seconds"])


def compare_encoder_batching(llm: LLM, n: int, max_tokens: int, rounds: int = 2) -> None:
    """Distinct images with the vision tower fed one image per call (as before the requests
    of a step shared one encoder batch) and batched, alternating, other images each run;
    the best of `rounds` each (the development machine is shared and noisy)."""
    stage: Any = llm.llm_engine.engine_core.media_rows
    batch = stage.max_batch
    best = {1: float("inf"), batch: float("inf")}
    for r in range(rounds):
        for i, size in enumerate(best):
            stage.max_batch = size
            pictures = images(n, False, seed=1 + 2 * r + i)
            best[size] = min(best[size], run_engine(llm, pictures, max_tokens))
    stage.max_batch = batch
    print(f"distinct  engine {n / best[1]:7.2f} req/s with one image per vision tower call, "
          f"{n / best[batch]:7.2f} req/s batched (up to {batch}): x{best[1] / best[batch]:5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--vllm-cpu-python", default=None,
                        help="the python of a virtual environment with vLLM's CPU build")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as path:
        build_model(path)
        llm = LLM(path, dtype="float32", max_model_len=512)
        for name, repeated in (("distinct", False), ("repeated", True)):
            pictures = images(args.num_requests, repeated)
            run_engine(llm, pictures[:2], 2)  # warm-up (graphs, first calls)
            if not repeated:
                compare_encoder_batching(llm, args.num_requests, args.max_tokens)
            ours = run_engine(llm, pictures, args.max_tokens)
            state = llm.llm_engine.engine_core.get_state()
            theirs = run_hf(path, pictures, args.max_tokens, args.hf_batch_size)
            n = args.num_requests
            print(f"{name:9s} engine {n / ours:7.2f} req/s   transformers {n / theirs:7.2f} "
                  f"req/s   x{theirs / ours:5.2f}   encoder cache hits "
                  f"{state['encoder_cache_hits']} misses {state['encoder_cache_misses']}")
            if args.vllm_cpu_python:
                result = run_vllm_cpu(args.vllm_cpu_python, path, pictures, args.max_tokens)
                if isinstance(result, str):
                    print(f"{name:9s} vllm-cpu failed:\n{result}")
                else:
                    print(f"{name:9s} engine {n / ours:7.2f} req/s   vllm-cpu     "
                          f"{n / result:7.2f} req/s   x{result / ours:5.2f}")
        llm.shutdown()


if __name__ == "__main__":
    main()
