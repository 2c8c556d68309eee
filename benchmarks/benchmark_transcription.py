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
number of threads (`--threads`) and the same OpenMP environment (OMP_WAIT_POLICY=PASSIVE and
GOMP_SPINCOUNT=10000 unless set; faster-whisper's CTranslate2 also uses libgomp).

    python benchmarks/benchmark_transcription.py \
        --faster-whisper-python /work/peers/fw-venv/bin/python [--threads 1] [--num-clips 64]

Long-form mode (`--long-form`): the synthesized long-form set (tests/longform_audio.py,
espeak-ng: recordings of `--minutes` minutes, varied voices, rates and pauses of 0.3-15 s,
plus a mostly silent 90 s file), every file uploaded at once to the server (its long-form
pipeline: VAD windows, timestamps, fallback, re-seek) and run offline through the same
pipeline, greedy and with beam search (`--beam-sizes`, default 1 and 5: the server's
`use_beam_search` with `best_of`), against faster-whisper's long-form defaults
(`WhisperModel.transcribe` with beam_size 1 and 5, float32 and int8, and
`BatchedInferencePipeline`), file after file. `--fw-modes` picks some of faster-whisper's
modes (e.g. `longbatched:int8:16`) for a shorter run.

This engine runs in `--dtype auto` unless told otherwise: bfloat16 on CPUs that multiply it
natively (AVX512-BF16 or AMX), float32 elsewhere.
"""

from __future__ import annotations

import os

# Before torch loads its OpenMP runtime; the servers and faster-whisper's driver inherit
# both (the spin count is the one this engine's own processes run with:
# vllm/platforms/openmp.py; libgomp lets it override the wait policy).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

import numpy as np  # noqa: E402
import soundfile  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from tests.wer import normalize_words, word_error_rate  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.sampling_params import BeamSearchParams  # noqa: E402
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
# Each returns (wall seconds, one text per clip) for every system it names.

Results = dict[str, tuple[float, list[str]]]


class Workload(NamedTuple):
    clips: list[np.ndarray]  # [num_samples] float32, 16 kHz
    paths: list[Path]  # the same clips as WAV files
    directory: Path  # where they are (faster-whisper's driver reads it)


def make_llm(args) -> LLM:
    return LLM(default_whisper_model_path(), dtype=args.dtype,
               kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs)


def timed(run: Callable[[Any], list[str]], warm_up: Any, batch: Any, repeats: int,
          reset: Callable[[], object] = lambda: None) -> tuple[float, list[str]]:
    """`run(batch)` after one untimed `run(warm_up)`: the fastest of `repeats` runs (on a
    shared machine the others' jobs only ever slow a run down) and its texts."""
    run(warm_up)
    best: tuple[float, list[str]] | None = None
    for _ in range(repeats):
        reset()
        start = time.perf_counter()
        texts = run(batch)
        elapsed = time.perf_counter() - start
        if best is None or elapsed < best[0]:
            best = (elapsed, texts)
    assert best is not None
    return best


def run_offline(args, work: Workload) -> Results:
    """Short clips: `LLM.generate` over all clips (one 30 s window each, no timestamps).
    Long form: the long-form pipeline (`transcribe_offline`), once per `--beam-sizes` entry."""
    clips = work.clips
    llm = make_llm(args)
    reset = llm.llm_engine.reset_prefix_cache
    if not args.long_form:
        params = SamplingParams(temperature=0, max_tokens=224)

        def run(batch: list[np.ndarray]) -> list[str]:
            prompts = [{"prompt": "", "multi_modal_data": {"audio": (c, RATE)}} for c in batch]
            return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]

        return {"this engine, offline LLM.generate": timed(run, clips[:2], clips,
                                                           args.repeats, reset)}

    from vllm.entrypoints.longform import make_setup, transcribe_offline
    from vllm.inputs.whisper import decoder_prompt, join_texts

    tokenizer, config = llm.get_tokenizer(), llm.llm_engine.vllm_config.model_config
    prompt_ids = decoder_prompt(tokenizer, config.hf_config, language=None, task="transcribe",
                                previous_text_ids=[], timestamps=True,
                                max_model_len=config.max_model_len)
    results = {}
    for beam in args.beam_sizes:
        params = (SamplingParams(temperature=0, max_tokens=224) if beam == 1 else
                  BeamSearchParams(beam_width=beam, max_tokens=224).sampling_params())
        setup = make_setup(tokenizer, prompt_ids, params, report_no_speech=False)  # as json

        def run_long(batch: list[np.ndarray], setup=setup) -> list[str]:
            return [join_texts([tokenizer.decode(s.token_ids) for s in segments])
                    for segments in transcribe_offline(llm, batch, setup)]

        results[f"this engine, offline long-form{_beam_label(beam)}"] = timed(
            run_long, [c[:30 * RATE] for c in clips[:2]], clips, args.repeats, reset)
    return results


def run_server(args, work: Workload) -> Results:
    """All files uploaded at once to POST /v1/audio/transcriptions of a `vllm serve` this
    starts (upload, decoding and HTTP included); long form: once per `--beam-sizes` entry
    (`use_beam_search` with `best_of` beams)."""
    import httpx

    paths = work.paths
    from tests.server_utils import RemoteServer

    server = RemoteServer(None, ["--task", "transcription", "--dtype", args.dtype,
                                 "--kv-cache-memory-bytes", str(args.kv_cache_bytes),
                                 "--max-num-seqs", str(args.max_num_seqs)],
                          # dev mode: /reset_prefix_cache before each timed run, else a file
                          # uploaded again hits its cached encoder output and decoder blocks
                          env={"VLLM_SERVER_DEV_MODE": "1"})

    def reset() -> None:
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=60).raise_for_status()

    def upload_all(batch: list[Path], form: dict[str, str]) -> list[str]:
        async def all_files() -> list[str]:
            limits = httpx.Limits(max_connections=len(batch))
            async with httpx.AsyncClient(base_url=server.url, timeout=3600,
                                         limits=limits) as http:
                async def one(path: Path) -> str:
                    response = await http.post("/v1/audio/transcriptions",
                                               data={"model": SERVED_NAME, **form},
                                               files={"file": (path.name, path.read_bytes())})
                    response.raise_for_status()
                    return response.json()["text"]

                return list(await asyncio.gather(*(one(p) for p in batch)))

        return asyncio.run(all_files())

    label = ("this engine, vllm serve (all files at once)" if args.long_form else
             "this engine, vllm serve (HTTP uploads)")
    beams = args.beam_sizes if args.long_form else [1]
    try:
        results = {}
        for beam in beams:
            form = {} if beam == 1 else {"use_beam_search": "true", "best_of": str(beam)}
            results[label + _beam_label(beam)] = timed(
                lambda batch, form=form: upload_all(batch, form), paths[:2], paths, args.repeats,
                reset)
        return results
    finally:
        server.stop()


def _beam_label(beam: int) -> str:
    return "" if beam == 1 else f", beam {beam}"


def faster_whisper_modes(args) -> dict[str, str]:
    """faster_whisper_driver.py's modes of this run, with their names in the report."""
    batch = args.fw_batch_size
    if args.long_form:
        modes = {f"long:{c}:{b}": f"faster-whisper {c} beam {b}"
                 for b in (1, 5) for c in ("float32", "int8")}
        modes.update({f"longbatched:{c}:{batch}": f"faster-whisper batched {c} (batch {batch})"
                      for c in ("float32", "int8")})
    else:
        modes = {f"sequential:{c}": f"faster-whisper {c}" for c in ("float32", "int8")}
        modes.update({f"batched:{c}:{batch}": f"faster-whisper batched {c} (batch {batch})"
                      for c in ("float32", "int8")})
    if args.fw_modes:
        unknown = [m for m in args.fw_modes if m not in modes]
        if unknown:
            raise SystemExit(f"--fw-modes: unknown {unknown}; this run's modes: {list(modes)}")
        modes = {m: modes[m] for m in args.fw_modes}
    return modes


def run_faster_whisper(args, work: Workload) -> Results:
    """faster-whisper's modes in its own environment (faster_whisper_driver.py)."""
    modes = faster_whisper_modes(args)
    command = [args.faster_whisper_python, str(ROOT / "benchmarks" / "faster_whisper_driver.py"),
               default_whisper_model_path(), str(work.directory), *modes,
               "--threads", str(torch.get_num_threads()), "--repeats", str(args.repeats)]
    out = subprocess.run(command, check=True, stdout=subprocess.PIPE, text=True).stdout
    results = json.loads(str(out).strip().splitlines()[-1])
    return {modes[m]: (r["seconds"], r["texts"]) for m, r in results.items()}


def run_transformers(args, work: Workload) -> Results:
    from benchmark_encoder_decoder import load_hf, run_hf

    from vllm.transformers_utils.tokenizer import get_tokenizer

    model = load_hf(default_whisper_model_path(), torch.float32)
    tokenizer = get_tokenizer(default_whisper_model_path())
    run_hf(model, work.clips[:2], 224, args.hf_batch_size)
    elapsed, tokens = run_hf(model, work.clips, 224, args.hf_batch_size)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    return {f"transformers generate (batch {args.hf_batch_size})": (elapsed, texts)}


# ---- report -------------------------------------------------------------------------


def report(results: Results, references: list[str], audio_seconds: float,
           load_before: float) -> None:
    """One line per system; `ours / it` is the first system's (this engine's, greedy) speed
    over that system's."""
    print(f"\n{len(references)} clips, {audio_seconds:.1f} s of audio, "
          f"{torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')} (every system), load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'system':<50} {'wall s':>8} {'audio s/s':>10} {'WER %':>7} {'ours / it':>10}")
    base = audio_seconds / next(iter(results.values()))[0] if results else 0.0
    for name, (elapsed, texts) in results.items():
        speed = audio_seconds / elapsed
        print(f"{name:<50} {elapsed:>8.1f} {speed:>10.2f} "
              f"{100 * corpus_wer(references, texts):>7.2f} {base / speed:>9.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=str(__doc__).splitlines()[0])
    parser.add_argument("--num-clips", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads of every system (default: torch's, the cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="this engine's dtype (auto: bfloat16 where the CPU multiplies it "
                             "natively, AVX512-BF16 or AMX, else float32)")
    parser.add_argument("--kv-cache-bytes", type=int, default=2 * 1024**3)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--faster-whisper-python", default=None,
                        help="python of an environment with faster-whisper installed "
                             "(skipped when not given)")
    parser.add_argument("--fw-batch-size", type=int, default=16)
    parser.add_argument("--fw-modes", nargs="*", default=None,
                        help="faster_whisper_driver.py modes to run (default: all of this "
                             "mode's, e.g. longbatched:int8:16 long:int8:5)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--long-form", action="store_true",
                        help="the long-form set instead of the short clips (see above)")
    parser.add_argument("--minutes", type=float, nargs="+", default=[1.0, 2.0, 3.0, 5.0],
                        help="long-form recordings' lengths")
    parser.add_argument("--beam-sizes", type=int, nargs="+", default=[1, 5],
                        help="long form: this engine's beam widths (1: greedy)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per system; the fastest is reported")
    parser.add_argument("--skip", nargs="*", default=[],
                        choices=["offline", "server", "faster-whisper", "transformers"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the server's engine-core process
    if args.long_form:
        from tests.longform_audio import long_form_set

        recordings = long_form_set(tuple(args.minutes))
        clips, references = [r.samples for r in recordings], [r.text for r in recordings]
    else:
        clips, references = build_workload(args.num_clips, args.seed)
    systems: dict[str, Callable[[Any, Workload], Results]] = {
        "server": run_server, "offline": run_offline}
    if args.faster_whisper_python:
        systems["faster-whisper"] = run_faster_whisper
    if not args.long_form:
        systems["transformers"] = run_transformers
    load_before = os.getloadavg()[0]
    results: Results = {}
    with tempfile.TemporaryDirectory(prefix="transcription-bench-") as tmp:
        work = Workload(clips, write_clips(clips, Path(tmp)), Path(tmp))
        for name, run in systems.items():
            if name not in args.skip:
                results.update(run(args, work))
    report(results, references, sum(len(c) for c in clips) / RATE, load_before)


if __name__ == "__main__":
    main()
