"""Whisper tiny.en transcription speed, side by side with transformers, in one run.

Workload 1 (throughput): the committed speech clips (tests/data) repeated to N requests
(default 64), greedy, each decoded until end of text. This engine (continuous batching,
paged cross-attention) against transformers' batched `generate` on the same converted
weights, both from waveforms (feature extraction included). Reported as audio seconds
transcribed per second of wall time, and their ratio.

Workload 2 (shared encoder input): one clip with 32 different decoder prompts (previous-text
contexts). With prefix caching the 32 requests share one set of cross-attention blocks and
the encoder runs once; without, it runs 32 times.

    python benchmarks/benchmark_encoder_decoder.py              # both workloads, float32
    python benchmarks/benchmark_encoder_decoder.py --num-requests 16 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
import wave
from pathlib import Path

import numpy as np
import torch

from vllm import LLM, SamplingParams
from vllm.transformers_utils.default_model import default_whisper_model_path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
SAMPLE_RATE = 16_000
SOT, NO_TIMESTAMPS, EOT = 50257, 50362, 50256


def load_clips() -> list[np.ndarray]:
    clips = []
    for name in json.loads((DATA / "speech_clips.json").read_text()):
        with wave.open(str(DATA / name)) as f:
            assert f.getframerate() == SAMPLE_RATE and f.getnchannels() == 1
            raw = np.frombuffer(f.readframes(f.getnframes()), dtype=np.int16)
        clips.append(raw.astype(np.float32) / 32768.0)
    return clips


def run_engine(llm: LLM, waveforms: list[np.ndarray], max_tokens: int) -> tuple[float, list]:
    prompts = [{"prompt": "", "multi_modal_data": {"audio": (w, SAMPLE_RATE)}}
               for w in waveforms]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.llm_engine.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def load_hf(model_dir: str, dtype: torch.dtype):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from vllm.model_executor.model_loader.ct2_loader import (
        load_ct2_config,
        load_ct2_state_dict,
    )

    model = WhisperForConditionalGeneration(WhisperConfig(**load_ct2_config(model_dir)))
    model.load_state_dict(load_ct2_state_dict(model_dir, torch.float32))
    return model.to(dtype).eval()


@torch.inference_mode()
def run_hf(model, waveforms: list[np.ndarray], max_tokens: int,
           batch_size: int) -> tuple[float, list]:
    """transformers: feature extraction plus greedy `generate` with the KV cache, batched;
    the plain generation loop (Whisper's long-form wrapper adds nothing for 30 s clips)."""
    from transformers import GenerationMixin, WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(waveforms), batch_size):
        batch = waveforms[i:i + batch_size]
        features = extractor(batch, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        prompt = torch.tensor([[SOT, NO_TIMESTAMPS]] * len(batch))
        out = GenerationMixin.generate(
            model, input_features=features.input_features.to(model.dtype),
            decoder_input_ids=prompt, max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=EOT, pad_token_id=EOT)
        for row in out[:, 2:].tolist():
            tokens.append(row[:row.index(EOT) + 1] if EOT in row else row)
    return time.perf_counter() - start, tokens


def throughput(args, llms: dict[str, LLM], clips: list[np.ndarray]) -> None:
    """Prefix caching on: repeated clips share cross blocks (one encoder run per distinct
    clip); off: every request runs the encoder, as in an engine without that cache."""
    waveforms = [clips[i % len(clips)] for i in range(args.num_requests)]
    audio_seconds = sum(len(w) for w in waveforms) / SAMPLE_RATE
    ours = {}
    for name, llm in llms.items():
        run_engine(llm, waveforms[:4], args.max_tokens)  # warm-up
        ours[name], our_tokens = run_engine(llm, waveforms, args.max_tokens)
        print(f"this engine, prefix caching {name}: {args.num_requests} requests, "
              f"{audio_seconds:.1f} s of audio in {ours[name]:.2f} s: "
              f"{audio_seconds / ours[name]:.1f} audio s/s")
    if args.skip_hf:
        return
    model = load_hf(default_whisper_model_path(), _dtype(args.dtype))
    run_hf(model, waveforms[:4], args.max_tokens, args.hf_batch_size)  # warm-up
    theirs, hf_tokens = run_hf(model, waveforms, args.max_tokens, args.hf_batch_size)
    print(f"transformers generate (batch {args.hf_batch_size}): {theirs:.2f} s: "
          f"{audio_seconds / theirs:.1f} audio s/s")
    same = sum(a == b for a, b in zip(our_tokens, hf_tokens))
    for name, elapsed in ours.items():
        print(f"ratio (this engine, prefix caching {name} / transformers): "
              f"{theirs / elapsed:.2f}x")
    print(f"identical transcripts: {same}/{len(our_tokens)}")


def shared_encoder(args, llms: dict[str, LLM], clips: list[np.ndarray]) -> None:
    contexts = [f"Meeting notes, part {i}." for i in range(32)]
    times = {}
    for name, llm in llms.items():
        tokenizer = llm.get_tokenizer()
        prompts = [{"encoder_prompt": {"prompt": "",
                                       "multi_modal_data": {"audio": (clips[0], SAMPLE_RATE)}},
                    "decoder_prompt": {"prompt_token_ids": [
                        50360, *tokenizer.encode(" " + text, add_special_tokens=False),
                        SOT, NO_TIMESTAMPS]}}
                   for text in contexts]
        runner = llm.llm_engine.engine_core.model_executor.model_runner.encoder_runner
        llm.llm_engine.reset_prefix_cache()
        before = runner.num_inputs_encoded
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens),
                     use_tqdm=False)
        times[name] = time.perf_counter() - start
        print(f"32 decoder prompts over one clip, prefix caching {name}: {times[name]:.2f} s, "
              f"encoder runs: {runner.num_inputs_encoded - before}")
    print(f"speed-up from shared cross blocks: {times['off'] / times['on']:.2f}x")


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-shared", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    clips = load_clips()
    model = default_whisper_model_path()
    llms = {name: LLM(model, dtype=args.dtype, kv_cache_memory_bytes=1024**3,
                      enable_prefix_caching=name == "on")
            for name in ("on", "off")}
    throughput(args, llms, clips)
    if not args.skip_shared:
        shared_encoder(args, llms, clips)


if __name__ == "__main__":
    main()
