"""Speech transcription throughput and word error rate: this engine (offline and through
`vllm serve`) against faster-whisper and transformers on the same Whisper tiny.en, in one run.

Workload: N different clips (default 64), each one to four of the committed test sentences
(tests/data) in a seeded order, with seeded pauses between them and a seeded gain, written as
16 kHz mono WAV files. Every system transcribes every clip greedily without timestamps, and is
timed after a warm-up on two clips:

- this engine, offline: `LLM.generate` over all clips at once (continuous batching);
- this engine, server: all N files uploaded at once to POST /v1/audio/transcriptions of a
  `vllm serve --task transcription` it launches (upload, decoding and HTTP included);
- faster-whisper (CTranslate2, the same model directory), in its own environment
  (`--faster-whisper-python`): `WhisperModel.transcribe` clip by clip with compute_type
  float32 and int8, and `BatchedInferencePipeline` over all clips (float32, int8);
- transformers: `WhisperForConditionalGeneration.generate`, batched, on the converted weights.

Reported: audio seconds transcribed per wall-clock second, word error rate against the
sentences, and this engine's speed relative to each system. Every system gets the same
number of threads (`--threads`) and the same OpenMP environment (importing vllm sets
OMP_WAIT_POLICY=PASSIVE unless it is set; faster-whisper's CTranslate2 also uses libgomp).

    python benchmarks/benchmark_transcription.py \
        --faster-whisper-python /work/peers/fw-venv/bin/python [--threads 1] [--num-clips 64]

Long-form mode (`--long-form`): the synthesized long-form set (tests/longform_audio.py,
espeak-ng: recordings of `--minutes` minutes, varied voices, rates and pauses of 0.3-15 s,
plus a mostly silent 90 s file), every file uploaded at once to the server (its long-form
pipeline: VAD windows, timestamps, fallback, re-seek) and run offline through the same
pipeline, against faster-whisper's long-form defaults (`WhisperModel.transcribe` with
beam_size 1 and 5, float32 and int8, and `BatchedInferencePipeline`), file after file.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime (importing vllm sets the same default, but torch
# comes first here); the servers and faster-whisper's driver inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import soundfile  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from tests.wer import normalize_words, word_error_rate  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.transformers_utils.default_model import default_whisper_model_path  # noqa: E402

DATA = ROOT / "tests" / "data"
RATE = 16_000
SERVED_NAME = "whisper-tiny.en"


def build_workload(num_clips: int, seed: int) -> tuple[list[np.ndarray], list[str]]:
    """N distinct clips (no two share audio, so no system gets an encoder cache hit)."""
    sentences = json.loads((DATA / "speech_clips.json").read_text())
    sources = [soundfile.read(DATA / name, dtype="float32")[0] for name in sentences]
    texts = list(sentences.values())
    rng = np.random.default_rng(seed)
    clips, references = [], []
    for _ in range(num_clips):
        order = rng.integers(0, len(sources), size=rng.integers(1, 5))
        parts = []
        for index in order:
            parts += [sources[index], np.zeros(int(rng.uniform(0.2, 1.0) * RATE), np.float32)]
        gain = rng.uniform(0.4, 1.0)
        clips.append((np.concatenate(parts) * gain).astype(np.float32))
        references.append(" ".join(texts[i] for i in order))
    return clips, references


def write_clips(clips: list[np.ndarray], directory: Path) -> list[Path]:
    paths = []
    for i, clip in enumerate(clips):
        paths.append(directory / f"clip_{i:04d}.wav")
        soundfile.write(paths[-1], clip, RATE, subtype="PCM_16")
    return paths


def corpus_wer(references: list[str], texts: list[str]) -> float:
    """Word errors over all clips / reference words over all clips."""
    errors = sum(word_error_rate(r, t) * len(normalize_words(r))
                 for r, t in zip(references, texts))
    return errors / sum(len(normalize_words(r)) for r in references)


# ---- the systems --------------------------------------------------------------------


def run_offline(args, clips: list[np.ndarray]) -> tuple[float, list[str]]:
    llm = LLM(default_whisper_model_path(), dtype=args.dtype,
              kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=224)

    def run(batch: list[np.ndarray]) -> list[str]:
        prompts = [{"prompt": "", "multi_modal_data": {"audio": (c, RATE)}} for c in batch]
        return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

    run(clips[:2])
    llm.llm_engine.reset_prefix_cache()
    start = time.perf_counter()
    texts = run(clips)
    return time.perf_counter() - start, texts


def run_server(args, paths: list[Path]) -> tuple[float, list[str]]:
    import httpx

    sys.path.insert(0, str(ROOT / "tests"))
    from server_utils import RemoteServer

    server = RemoteServer(None, ["--task", "transcription", "--dtype", args.dtype,
                                 "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
                                 "--max-num-seqs", str(args.max_num_seqs)])

    async def upload_all(batch: list[Path]) -> list[str]:
        limits = httpx.Limits(max_connections=len(batch))
        async with httpx.AsyncClient(base_url=server.url, timeout=3600, limits=limits) as http:
            async def one(path: Path) -> str:
                response = await http.post("/v1/audio/transcriptions",
                                           data={"model": SERVED_NAME},
                                           files={"file": (path.name, path.read_bytes())})
                response.raise_for_status()
                return response.json()["text"]

            return list(await asyncio.gather(*(one(p) for p in batch)))

    try:
        asyncio.run(upload_all(paths[:2]))
        start = time.perf_counter()
        texts = asyncio.run(upload_all(paths))
        return time.perf_counter() - start, texts
    finally:
        server.stop()


def run_offline_long_form(args, clips: list[np.ndarray]) -> tuple[float, list[str]]:
    from vllm.entrypoints.longform import make_setup, transcribe_offline
    from vllm.inputs.whisper import decoder_prompt, join_texts

    llm = LLM(default_whisper_model_path(), dtype=args.dtype,
              kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs)
    tokenizer, config = llm.get_tokenizer(), llm.llm_engine.vllm_config.model_config
    prompt_ids = decoder_prompt(tokenizer, config.hf_config, language=None, task="transcribe",
                                previous_text_ids=[], timestamps=True,
                                max_model_len=config.max_model_len)
    setup = make_setup(tokenizer, prompt_ids, SamplingParams(temperature=0, max_tokens=224))

    def run(batch: list[np.ndarray]) -> list[str]:
        return [join_texts([tokenizer.decode(s.token_ids) for s in segments])
                for segments in transcribe_offline(llm, batch, setup)]

    run([c[:30 * RATE] for c in clips[:2]])
    llm.llm_engine.reset_prefix_cache()
    start = time.perf_counter()
    texts = run(clips)
    return time.perf_counter() - start, texts


def run_faster_whisper_long_form(args, clip_dir: Path) -> dict[str, tuple[float, list[str]]]:
    modes = {"long:float32:1": "faster-whisper float32 beam 1",
             "long:int8:1": "faster-whisper int8 beam 1",
             "long:float32:5": "faster-whisper float32 beam 5",
             "long:int8:5": "faster-whisper int8 beam 5",
             f"longbatched:float32:{args.fw_batch_size}":
                 f"faster-whisper batched float32 (batch {args.fw_batch_size})",
             f"longbatched:int8:{args.fw_batch_size}":
                 f"faster-whisper batched int8 (batch {args.fw_batch_size})"}
    command = [args.faster_whisper_python, str(ROOT / "benchmarks" / "faster_whisper_driver.py"),
               default_whisper_model_path(), str(clip_dir), *modes,
               "--threads", str(torch.get_num_threads())]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    results = json.loads(out.strip().splitlines()[-1])
    return {modes[m]: (r["seconds"], r["texts"]) for m, r in results.items()}


def long_form_main(args) -> None:
    from tests.longform_audio import long_form_set

    recordings = long_form_set(tuple(args.minutes))
    clips = [r.samples for r in recordings]
    references = [r.text for r in recordings]
    audio_seconds = sum(len(c) for c in clips) / RATE
    results: dict[str, tuple[float, list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="transcription-long-") as tmp:
        paths = write_clips(clips, Path(tmp))
        if "server" not in args.skip:
            results["this engine, vllm serve (all files at once)"] = run_server(args, paths)
        if "offline" not in args.skip:
            results["this engine, offline long-form"] = run_offline_long_form(args, clips)
        if args.faster_whisper_python and "faster-whisper" not in args.skip:
            results.update(run_faster_whisper_long_form(args, Path(tmp)))
    report(results, references, audio_seconds,
           "this engine, vllm serve (all files at once)")


def run_faster_whisper(args, clip_dir: Path) -> dict[str, tuple[float, list[str]]]:
    batch = args.fw_batch_size
    modes = ["sequential:float32", "sequential:int8", f"batched:float32:{batch}",
             f"batched:int8:{batch}"]
    command = [args.faster_whisper_python, str(ROOT / "benchmarks" / "faster_whisper_driver.py"),
               default_whisper_model_path(), str(clip_dir), *modes,
               "--threads", str(torch.get_num_threads())]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    results = json.loads(out.strip().splitlines()[-1])
    names = {"sequential:float32": "faster-whisper float32",
             "sequential:int8": "faster-whisper int8",
             f"batched:float32:{batch}": f"faster-whisper batched float32 (batch {batch})",
             f"batched:int8:{batch}": f"faster-whisper batched int8 (batch {batch})"}
    return {names[m]: (r["seconds"], r["texts"]) for m, r in results.items()}


def run_transformers(args, clips: list[np.ndarray]) -> tuple[float, list[str]]:
    from benchmark_encoder_decoder import load_hf, run_hf

    from vllm.transformers_utils.tokenizer import get_tokenizer

    model = load_hf(default_whisper_model_path(), torch.float32)
    tokenizer = get_tokenizer(default_whisper_model_path())
    run_hf(model, clips[:2], 224, args.hf_batch_size)
    elapsed, tokens = run_hf(model, clips, 224, args.hf_batch_size)
    return elapsed, [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]


# ---- report -------------------------------------------------------------------------


def report(results: dict[str, tuple[float, list[str]]], references: list[str],
           audio_seconds: float, baseline: str) -> None:
    print(f"\n{len(references)} clips, {audio_seconds:.1f} s of audio, "
          f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')} (every system), load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"{'system':<44} {'wall s':>8} {'audio s/s':>10} {'WER %':>7} {'ours / it':>10}")
    base = audio_seconds / results[baseline][0] if baseline in results else None
    for name, (elapsed, texts) in results.items():
        speed = audio_seconds / elapsed
        ratio = f"{base / speed:.2f}x" if base else "-"
        print(f"{name:<44} {elapsed:>8.1f} {speed:>10.2f} "
              f"{100 * corpus_wer(references, texts):>7.2f} {ratio:>10}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-clips", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads of every system (default: torch's, the cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32",
                        help="this engine's dtype (float32: bfloat16 is slow on CPUs without "
                             "native bfloat16 matrix units)")
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--faster-whisper-python", default=None,
                        help="python of an environment with faster-whisper installed "
                             "(skipped when not given)")
    parser.add_argument("--fw-batch-size", type=int, default=16)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--long-form", action="store_true",
                        help="the long-form set instead of the short clips (see above)")
    parser.add_argument("--minutes", type=float, nargs="+", default=[1.0, 2.0, 3.0, 5.0],
                        help="long-form recordings' lengths")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["offline", "server", "faster-whisper", "transformers"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server's engine-core process
    if args.long_form:
        long_form_main(args)
        return
    clips, references = build_workload(args.num_clips, args.seed)
    audio_seconds = sum(len(c) for c in clips) / RATE
    results: dict[str, tuple[float, list[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="transcription-bench-") as tmp:
        paths = write_clips(clips, Path(tmp))
        if "offline" not in args.skip:
            results["this engine, offline LLM.generate"] = run_offline(args, clips)
        if "server" not in args.skip:
            results["this engine, vllm serve (HTTP uploads)"] = run_server(args, paths)
        if args.faster_whisper_python and "faster-whisper" not in args.skip:
            results.update(run_faster_whisper(args, Path(tmp)))
        if "transformers" not in args.skip:
            results[f"transformers generate (batch {args.hf_batch_size})"] = \
                run_transformers(args, clips)
    report(results, references, audio_seconds, "this engine, offline LLM.generate")


if __name__ == "__main__":
    main()
