"""Engine configuration: small dataclasses resolved once, then left alone.

`EngineArgs` (vllm/engine/arg_utils.py) turns user keyword arguments into a `VllmConfig`;
each component takes the sub-config it needs.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from vllm.platforms.cpu import choose_cpu_dtype, read_cpu_flags
from vllm.transformers_utils.config import (
    head_dim_of,
    is_encoder_decoder_config,
    num_kv_heads_of,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_groups import KVCacheGroupSpec

logger = logging.getLogger(__name__)

_STR_TO_DTYPE = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

PromptEmbedsBatching = Literal["mixed", "separate"]


class InputKind(enum.Enum):
    """What a model step takes in: token ids (the embedding lookup runs inside the model)
    or prompt-embeds rows. Under `separate` batching the scheduler gives each step one kind;
    graph capture keeps one graph set per kind."""

    TOKEN_IDS = "ids"
    EMBEDS = "embeds"

    @property
    def other(self) -> InputKind:
        return InputKind.EMBEDS if self is InputKind.TOKEN_IDS else InputKind.TOKEN_IDS


def resolve_dtype(dtype: str | torch.dtype, device: str,
                  cpu_flags: Iterable[str] | None = None) -> torch.dtype:
    """An explicit dtype is honoured. `auto` on CPU follows the processor
    (`choose_cpu_dtype`: bfloat16 only where it multiplies bfloat16 natively, float32
    elsewhere; `cpu_flags` default to this machine's), and is float16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating type, got {dtype}.")
        return dtype
    if dtype == "auto":
        if device != "cpu":
            return torch.float16
        choice = choose_cpu_dtype(read_cpu_flags() if cpu_flags is None else cpu_flags)
        logger.info("dtype auto -> %s on CPU: %s.", str(choice.dtype).removeprefix("torch."),
                    choice.reason)
        return choice.dtype
    if dtype not in _STR_TO_DTYPE:
        raise ValueError(f"Unknown dtype {dtype!r}; choose one of auto, "
                         f"{', '.join(sorted(_STR_TO_DTYPE))}.")
    return _STR_TO_DTYPE[dtype]


@dataclass(slots=True)
class ModelConfig:
    model: str  # local HF directory or .gguf file
    tokenizer: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    seed: int = 0
    enable_prompt_embeds: bool = False
    # Most media items per prompt by modality (`limit_mm_per_prompt`); see `mm_limit`.
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    # Image models: prompts may carry precomputed image embeddings (`image_embeds`).
    enable_mm_embeds: bool = False
    # Where chat `image_url` parts may read from besides data: URLs (`MediaConnector`): the
    # directory `file:` URLs may name ("": none), the hosts fetched (None: no fetching).
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    # Requests may ask for their last hidden states; the engine then keeps them per token
    # in a CPU tensor beside the KV cache (its bytes come out of the KV budget).
    enable_return_hidden_states: bool = False
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False
    # "int8": int8 linear layers; "gguf": a GGUF file's blocks kept (CPU); None: dtype
    quantization: str | None = None
    enforce_eager: bool = False  # no captured graphs
    # A registered attention backend (`vllm.v1.attention.backends`); None: the default, or
    # the environment's `VLLM_ATTENTION_BACKEND`.
    attention_backend: str | None = None
    # Sampling defaults the model ships (generation_config.json: temperature, top_p, ...),
    # for requests that do not set them; empty with `generation_config="vllm"`.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def is_gguf(self) -> bool:
        return self.model.endswith(".gguf")

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def hf_text_config(self) -> Any:
        """The language model's config: a vision-language model's `text_config`, else the
        whole config."""
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    @property
    def hidden_size(self) -> int:
        return self.hf_text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    @property
    def mm_modalities(self) -> tuple[str, ...]:
        """The media the model's prompts take (`multi_modal_data`): ("image",) for LLaVA,
        ("audio",) for Qwen2-Audio, () for text models (and Whisper, whose audio is its
        encoder's input, not part of a prompt)."""
        from vllm.model_executor.models.registry import input_modalities

        return input_modalities(self.architecture)

    @property
    def is_multimodal_model(self) -> bool:
        return bool(self.mm_modalities)

    @property
    def is_image_model(self) -> bool:
        """The model takes images (`multi_modal_data={"image": ...}`) into its prompt."""
        return "image" in self.mm_modalities

    @property
    def bidirectional_media(self) -> bool:
        """The positions of one media item attend to each other both ways (Gemma 3's
        images); the rest of the prompt is causal."""
        from vllm.model_executor.models.registry import bidirectional_media

        return bidirectional_media(self.architecture)

    def mm_limit(self, modality: str) -> int:
        """The most items of `modality` one prompt may carry."""
        from vllm.multimodal import DEFAULT_MM_LIMIT

        return self.limit_mm_per_prompt.get(modality, DEFAULT_MM_LIMIT)

    @property
    def uses_mrope(self) -> bool:
        """The language model's rotary takes three positions per token (temporal, height,
        width: Qwen2-VL's M-RoPE, `mrope_section` in its rope parameters)."""
        from vllm.model_executor.layers.rotary_embedding import mrope_section_of

        return mrope_section_of(self.hf_text_config) is not None

    @property
    def uses_prompt_embeds(self) -> bool:
        """Steps may carry embeds rows (the runner's embeds graphs): user prompt embeds,
        or a multimodal model's media rows."""
        return self.enable_prompt_embeds or self.is_multimodal_model

    @property
    def audio_frames_per_encoder_token(self) -> int | None:
        """Log-mel frames per encoder position when the model's encoder takes audio
        (Whisper: 2, so 3,000 frames -> 1,500 positions); None for text models."""
        from vllm.model_executor.models.registry import audio_frames_per_encoder_token

        return audio_frames_per_encoder_token(self.architecture)

    @property
    def is_audio_model(self) -> bool:
        return self.audio_frames_per_encoder_token is not None

    @property
    def is_encoder_decoder(self) -> bool:
        return is_encoder_decoder_config(self.hf_config)

    @property
    def num_layers(self) -> int:
        """Layers holding KV cache: the decoder's (its self- and cross-attention share one
        cache tensor per layer; the encoder keeps none)."""
        if self.is_encoder_decoder:
            return self.hf_config.decoder_layers
        return self.hf_text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_text_config
        if self.is_encoder_decoder:
            return cfg.decoder_attention_heads
        return num_kv_heads_of(cfg)

    def get_num_kv_heads(self, tensor_parallel_size: int) -> int:
        """KV heads one tensor-parallel rank holds (a replicated one where the ranks
        outnumber them)."""
        from vllm.distributed.utils import kv_heads_per_rank

        return kv_heads_per_rank(self.num_kv_heads, tensor_parallel_size)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_text_config
        if self.is_encoder_decoder:
            return cfg.d_model // cfg.decoder_attention_heads
        return head_dim_of(cfg)

    @property
    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        """The attention layers' KV cache groups (one unless some layers use a sliding
        window; see `vllm/v1/core/kv_cache_groups.py`)."""
        from vllm.transformers_utils.config import layer_sliding_windows
        from vllm.v1.core.kv_cache_groups import make_kv_cache_groups

        windows: list[int | None] = (
            [None] * self.num_layers if self.is_encoder_decoder
            else layer_sliding_windows(self.hf_text_config, self.num_layers))
        return make_kv_cache_groups(windows)

    @property
    def max_encoder_len(self) -> int:
        """The longest encoder input, in encoder tokens (0 for decoder-only models)."""
        if not self.is_encoder_decoder:
            return 0
        cfg = self.hf_config
        return (getattr(cfg, "max_source_positions", None)
                or getattr(cfg, "max_position_embeddings", None) or 1024)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Bytes of KV cache to allocate (the CPU has no memory profiling pass).
    kv_cache_memory_bytes: int = 2 * 1024**3
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    num_blocks: int = 0  # resolved by the engine core once the cache is allocated


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    prompt_embeds_batching: PromptEmbedsBatching = "mixed"
    # Encoder input tokens per step (encoder/decoder models); an input is never split.
    max_num_encoder_input_tokens: int = 2048
    # LoRA: distinct adapters one step may hold (the slots); None: LoRA is off.
    max_loras: int | None = None
    # Speculative decoding: drafts a request verifies per step (k; 0: off), and KV slots
    # allocated past a step's tokens for a draft model's proposals.
    num_spec_tokens: int = 0
    num_lookahead_tokens: int = 0


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA serving (`enable_lora`): `max_loras` slots per layer (distinct adapters in one
    step), ranks up to `max_lora_rank`, up to `max_cpu_loras` loaded adapters kept on the
    CPU (at least `max_loras`)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1


@dataclass(slots=True)
class DeviceConfig:
    device: str = "cpu"


DistributedExecutorBackend = Literal["uni", "mp", "ray"]
EXECUTOR_BACKENDS: tuple[str, ...] = ("uni", "mp", "ray")


@dataclass(slots=True)
class ParallelConfig:
    """vLLM's names. `tensor_parallel_size` ranks shard every model (one process each
    unless `uni`); `data_parallel_size` engine cores sit behind one API server, each with
    its own ranks. `distributed_executor_backend` is resolved by `EngineArgs` (unset: `uni`
    for one rank, `mp` for more; `ray` is the way across machines)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: DistributedExecutorBackend = "uni"
    # Set per engine core by the data-parallel client: this engine's index, and on CPU the
    # cores it (all of its tensor-parallel ranks together) runs on; None: unbound.
    data_parallel_rank: int = 0
    cpu_ids: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True, slots=True)
class CompilationConfig:
    """vLLM's knobs: `level` 0 runs eagerly (as `enforce_eager=True` does), 3 captures
    graphs; `cudagraph_capture_sizes` are the padded sizes (tokens per step) captured, on
    CPU as on CUDA. None picks `default_capture_sizes`."""

    level: int = 3
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    @staticmethod
    def from_user(value: CompilationConfig | dict | int | None) -> CompilationConfig:
        if value is None:
            return CompilationConfig()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return CompilationConfig(level=value)
        if isinstance(value, dict):
            unknown = set(value) - {"level", "mode", "cudagraph_capture_sizes"}
            if unknown:
                raise ValueError(f"Unknown compilation_config keys: {sorted(unknown)}; "
                                 "known: level (or mode), cudagraph_capture_sizes.")
            level = value.get("level", value.get("mode", 3))
            sizes = value.get("cudagraph_capture_sizes")
            if sizes is not None:
                sizes = tuple(sizes)
                if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1
                                    for s in sizes):
                    raise ValueError("compilation_config cudagraph_capture_sizes must be a "
                                     f"non-empty list of positive integers, got {value!r}.")
            return CompilationConfig(level=int(level), cudagraph_capture_sizes=sizes)
        raise ValueError(f"compilation_config must be a dict, an int level or None, "
                         f"got {type(value).__name__}.")


SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model")
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "model", "quantization")


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: `method` "ngram" (drafts copied from the request's own
    context: the longest suffix n-gram, `prompt_lookup_max` down to `prompt_lookup_min`
    tokens, found earlier in it) or "draft_model" (`model`, a smaller model or the same
    one quantized harder, optionally with its own `quantization`), each proposing
    `num_speculative_tokens` (k) tokens a step, verified in one forward of the target."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # draft_model only: the drafter's path
    quantization: str | None = None
    # draft_model: the drafter's resolved config (set by `EngineArgs`).
    draft_model_config: ModelConfig | None = None

    @staticmethod
    def from_user(value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """Checks a user's dict with vLLM's rules (k >= 1; ngram lookup sizes >= 1 with
        min <= max, one given alone sets both, neither: 5 and 5)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict such as {\"method\": "
                             "\"ngram\", \"num_speculative_tokens\": 3}, got "
                             f"{type(value).__name__}.")
        unknown = sorted(set(value) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"Unknown speculative_config keys: {unknown}; known: "
                             f"{', '.join(_SPEC_KEYS)}.")
        method = value.get("method") or ("draft_model" if value.get("model") else None)
        if method not in SPEC_METHODS:
            raise ValueError(f"Unknown speculative_config method {method!r}; choose one of "
                             f"{', '.join(SPEC_METHODS)}.")
        k = _positive_int(value.get("num_speculative_tokens"), "num_speculative_tokens")
        if method == "draft_model":
            if not value.get("model"):
                raise ValueError("speculative_config method 'draft_model' needs 'model': "
                                 "the drafter's path.")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if value.get(key) is not None:
                    raise ValueError(f"speculative_config {key} is for method 'ngram', not "
                                     "'draft_model'.")
            return SpeculativeConfig(method, k, model=value["model"],
                                     quantization=value.get("quantization"))
        for key in ("model", "quantization"):
            if value.get(key) is not None:
                raise ValueError(f"speculative_config {key} is for method 'draft_model', not "
                                 "'ngram'.")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5
        lo = _positive_int(hi if lo is None else lo, "prompt_lookup_min")
        hi = _positive_int(lo if hi is None else hi, "prompt_lookup_max")
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= "
                             f"prompt_lookup_max ({hi}).")
        return SpeculativeConfig(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi)


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"speculative_config {name} must be an integer >= 1, got {value!r}.")
    return value


@dataclass(slots=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig | None = None  # None: LoRA is off
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding


def default_device() -> str:
    if os.environ.get("VLLM_DEVICE"):
        return os.environ["VLLM_DEVICE"]
    return "cuda" if torch.cuda.is_available() else "cpu"
