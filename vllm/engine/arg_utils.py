"""`EngineArgs`: user-facing engine knobs with vLLM's names, resolved into a `VllmConfig`."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from vllm.config import (
    EXECUTOR_BACKENDS,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    default_device,
    resolve_dtype,
)
from vllm.model_executor.layers.quantization import NO_QUANTIZATION, QUANTIZATION_METHODS
from vllm.multimodal import MODALITIES
from vllm.transformers_utils.config import (
    get_config,
    get_generation_defaults,
    is_encoder_decoder_config,
    resolve_model_path,
)

# Default per-step encoder budget of encoder/decoder models, in whole longest inputs.
ENCODER_INPUTS_PER_STEP = 8


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_num_encoder_input_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    enable_prompt_embeds: bool = False
    enable_return_hidden_states: bool = False
    prompt_embeds_batching: str = "mixed"
    seed: int = 0
    served_model_name: str | None = None
    device: str | None = None
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    enforce_eager: bool = False
    compilation_config: CompilationConfig | dict | int | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    attention_backend: str | None = None
    # Default sampling parameters: "auto" from the model's generation_config.json, "vllm"
    # SamplingParams' own, or a folder holding a generation_config.json.
    generation_config: str = "auto"
    # LoRA adapters (vLLM's names and defaults; max_cpu_loras None: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Speculative decoding (vLLM's dict: method "ngram" or "draft_model", ...).
    speculative_config: SpeculativeConfig | dict | None = None
    # Most media items of each modality in one prompt (vLLM's `limit_mm_per_prompt`, e.g.
    # {"image": 2}); a modality not named keeps `DEFAULT_MM_LIMIT`.
    limit_mm_per_prompt: dict[str, int] | None = None
    # Image models: accept precomputed image embeddings (vLLM's `enable_mm_embeds`).
    enable_mm_embeds: bool = False
    # Chat image URLs: `file:` URLs under this directory (vLLM's name), and `http(s):` URLs
    # of these hosts (None: remote URLs are refused).
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(unknown)}.")
        return cls(**kwargs)

    def _check_knobs(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.prompt_embeds_batching not in ("mixed", "separate"):
            raise ValueError("prompt_embeds_batching must be 'mixed' or 'separate', got "
                             f"{self.prompt_embeds_batching!r}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        limits = self.limit_mm_per_prompt or {}
        if not isinstance(limits, dict) or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in limits.values()):
            raise ValueError("limit_mm_per_prompt must map modalities to counts >= 0, e.g. "
                             f"{{'image': 2}}; got {limits!r}.")
        unknown = sorted(set(limits) - set(MODALITIES))
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: unknown modality {unknown[0]!r} "
                             f"({', '.join(MODALITIES)}).")

    def _local_media_path(self) -> str:
        """`allowed_local_media_path` resolved (symlinks followed): an existing directory."""
        path = self.allowed_local_media_path
        if not path:
            return ""
        if not isinstance(path, str) or not os.path.isdir(path):
            raise ValueError(f"allowed_local_media_path must be an existing directory, got "
                             f"{path!r}.")
        return os.path.realpath(path)

    def _media_domains(self) -> list[str] | None:
        domains = self.allowed_media_domains
        if domains is None:
            return None
        if isinstance(domains, str) or not all(isinstance(d, str) and d for d in domains):
            raise ValueError("allowed_media_domains must be a list of host names, e.g. "
                             f"['upload.wikimedia.org']; got {domains!r}.")
        return [d.lower() for d in domains]

    def _quantization(self, device: str, model: str) -> str | None:
        return self._resolve_quantization(self.quantization, device, model)

    @staticmethod
    def _resolve_quantization(quantization: str | None, device: str, model: str
                              ) -> str | None:
        """The weights' form: a GGUF file keeps its own block types on CPU unless asked
        otherwise (as llama.cpp and Ollama run it); `"none"` widens every tensor to `dtype`
        at load. An unknown method, one the device cannot run, or `"gguf"` for another kind
        of checkpoint is an error naming it."""
        is_gguf = model.endswith(".gguf")
        if quantization is None:
            return "gguf" if is_gguf and device == "cpu" else None
        if quantization == NO_QUANTIZATION:
            return None
        if quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"Unknown quantization {quantization!r}; choose one of "
                             f"{', '.join((*QUANTIZATION_METHODS, NO_QUANTIZATION))}.")
        if device != "cpu":
            raise ValueError(f"quantization={quantization!r} runs on CPU only.")
        if quantization == "gguf" and not is_gguf:
            raise ValueError("quantization='gguf' keeps a GGUF file's quantized tensors; "
                             f"{model!r} is not a .gguf file.")
        return quantization

    def _lora_config(self, model_config: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        max_cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if not isinstance(max_cpu, int) or isinstance(max_cpu, bool) or max_cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu!r}) must be an integer >= max_loras "
                             f"({self.max_loras}).")
        if model_config.is_encoder_decoder:
            raise ValueError("enable_lora: LoRA adapters are supported on decoder-only "
                             "models, not encoder/decoder ones.")
        if model_config.is_multimodal_model:
            raise ValueError(f"enable_lora: LoRA adapters are not supported on "
                             f"{model_config.architecture} yet.")
        return LoRAConfig(self.max_loras, self.max_lora_rank, max_cpu)

    def _parallel_config(self, hf_config, device: str) -> ParallelConfig:
        """Sizes and backend checked against the model and the machine before anything
        starts: a head count the ranks cannot split, more CPU ranks than cores, or an
        executor backend that is unknown or not installed is an error naming the numbers."""
        from vllm.distributed.utils import check_cpu_ranks, check_tp_divisibility

        tp, dp = self.tensor_parallel_size, self.data_parallel_size
        for name, value in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        backend = self.distributed_executor_backend or ("uni" if tp == 1 else "mp")
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"Unknown distributed_executor_backend {backend!r}; choose one "
                             f"of {', '.join(EXECUTOR_BACKENDS)}.")
        if backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in this "
                             f"process; tensor_parallel_size={tp} needs 'mp' or 'ray'.")
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError("distributed_executor_backend='ray' needs Ray, which is not "
                                 "installed here: pip install 'ray[default]' (or use 'mp' "
                                 "on one machine).")
        check_tp_divisibility(hf_config, tp)
        if device == "cpu" and backend != "ray":  # Ray ranks may sit on other machines
            check_cpu_ranks(tp * dp)
        return ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp,
                              distributed_executor_backend=backend)  # type: ignore[arg-type]

    def _max_num_batched_tokens(self, max_model_len: int) -> int:
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if max_batched < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_batched}.")
        if not self.enable_chunked_prefill and max_batched < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={max_batched} is smaller than max_model_len="
                f"{max_model_len}; with chunked prefill disabled a whole prompt must fit "
                "in one step.")
        return max_batched

    def _max_num_encoder_input_tokens(self, max_batched: int, max_encoder_len: int) -> int:
        """vLLM's default is the token budget; here at least `ENCODER_INPUTS_PER_STEP`
        whole encoder inputs (never split): with one Whisper window (1500 tokens) per step,
        every encoder run also paid a decode step of all running requests, and 64 requests
        ran 2.9x slower than with 8 per step (benchmark_encoder_decoder.py, caching off)."""
        budget = self.max_num_encoder_input_tokens
        if budget is None:
            return max(max_batched, ENCODER_INPUTS_PER_STEP * max_encoder_len)
        if budget < max_encoder_len:
            raise ValueError(f"max_num_encoder_input_tokens={budget} is smaller than the "
                             f"model's longest encoder input ({max_encoder_len} tokens), "
                             "which is never split across steps.")
        return budget

    def create_engine_config(self) -> VllmConfig:
        model = resolve_model_path(self.model)
        hf_config = get_config(model)
        text_config = getattr(hf_config, "text_config", None) or hf_config  # VLMs: the LM's
        device = self.device or default_device()
        max_pos = max_decoder_positions(text_config)
        max_model_len = self.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model's "
                             f"maximum number of (decoder) positions, {max_pos}.")
        self._check_knobs()
        quantization = self._quantization(device, model)
        parallel_config = self._parallel_config(text_config, device)
        from vllm.v1.attention.backends import get_attn_backend

        get_attn_backend(self.attention_backend)  # an unknown name (or env value) fails here
        max_batched = self._max_num_batched_tokens(max_model_len)
        _check_media_runs_fit(hf_config, max_batched)
        model_config = ModelConfig(
            model=model,
            tokenizer=self.tokenizer or model,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, device),
            max_model_len=max_model_len,
            seed=self.seed,
            enable_prompt_embeds=self.enable_prompt_embeds,
            limit_mm_per_prompt=dict(self.limit_mm_per_prompt or {}),
            enable_mm_embeds=self.enable_mm_embeds,
            allowed_local_media_path=self._local_media_path(),
            allowed_media_domains=self._media_domains(),
            enable_return_hidden_states=self.enable_return_hidden_states,
            served_model_name=self.served_model_name,
            skip_tokenizer_init=self.skip_tokenizer_init,
            quantization=quantization,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            generation_defaults=get_generation_defaults(
                model if os.path.isdir(model) else os.path.dirname(model),
                self.generation_config),
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        if self.kv_cache_memory_bytes is not None:
            cache_config.kv_cache_memory_bytes = self.kv_cache_memory_bytes
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            prompt_embeds_batching=self.prompt_embeds_batching,  # type: ignore[arg-type]
            max_num_encoder_input_tokens=self._max_num_encoder_input_tokens(
                max_batched, model_config.max_encoder_len),
        )
        lora_config = self._lora_config(model_config)
        if lora_config is not None:
            scheduler_config.max_loras = lora_config.max_loras
        spec = self._speculative_config(model_config, scheduler_config, parallel_config, device)
        if spec is not None:
            scheduler_config.num_spec_tokens = spec.num_speculative_tokens
            if spec.method == "draft_model":
                scheduler_config.num_lookahead_tokens = spec.num_speculative_tokens
        return VllmConfig(model_config, cache_config, scheduler_config, DeviceConfig(device),
                          CompilationConfig.from_user(self.compilation_config),
                          parallel_config, lora_config, spec)

    def _speculative_config(self, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                            parallel_config: ParallelConfig, device: str
                            ) -> SpeculativeConfig | None:
        spec = SpeculativeConfig.from_user(self.speculative_config)
        if spec is None:
            return None
        k = spec.num_speculative_tokens
        if 1 + k > scheduler_config.max_num_batched_tokens or k >= model_config.max_model_len:
            raise ValueError(
                f"speculative_config num_speculative_tokens={k} is out of range: a "
                f"verification step of 1 + k tokens must fit max_num_batched_tokens="
                f"{scheduler_config.max_num_batched_tokens} and k must be below "
                f"max_model_len={model_config.max_model_len}.")
        if model_config.is_encoder_decoder:
            raise ValueError("speculative_config: speculative decoding is supported on "
                             "decoder-only models, not encoder/decoder ones.")
        if spec.method == "draft_model":
            from vllm.v1.spec_decode.draft_model import draft_model_config

            if parallel_config.tensor_parallel_size > 1:
                raise ValueError("speculative_config method 'draft_model' runs with "
                                 "tensor_parallel_size=1 only; 'ngram' works with any.")
            # A copy: the user's config keeps what they asked for ("none" stays "none").
            spec = dataclasses.replace(spec, quantization=self._resolve_quantization(
                spec.quantization, device, spec.model or ""))
            spec.draft_model_config = draft_model_config(spec, model_config)
        return spec


def max_decoder_positions(hf_config) -> int:
    """Positions the (decoder) model has: Whisper names them `max_target_positions`. Rope
    scalings that stretch the trained length (linear, dynamic: `max_position_embeddings`
    x factor; yarn: the original length x factor) reach that far; llama3 and longrope
    configs already give the stretched length."""
    from vllm.model_executor.layers.rotary_embedding import rope_parameters_of

    positions = (getattr(hf_config, "max_target_positions", None)
                 or getattr(hf_config, "max_position_embeddings", None) or 2048)
    if is_encoder_decoder_config(hf_config):
        return positions
    rope = rope_parameters_of(hf_config)
    factor = rope.get("factor")
    if rope["rope_type"] in ("linear", "dynamic") and factor:
        return int(positions * factor)
    if rope["rope_type"] == "yarn" and factor:
        return int(rope.get("original_max_position_embeddings", positions) * factor)
    return positions


def _check_media_runs_fit(hf_config: Any, max_batched: int) -> None:
    """A model whose images attend bidirectionally computes each image's run in one step:
    the run must fit the token budget."""
    from vllm.model_executor.models.registry import bidirectional_media

    archs = getattr(hf_config, "architectures", None) or [""]
    run = getattr(hf_config, "mm_tokens_per_image", None)
    if bidirectional_media(archs[0]) and run is not None and run > max_batched:
        raise ValueError(f"max_num_batched_tokens={max_batched} is smaller than one image's "
                         f"run of {run} positions, which {archs[0]} computes in one step "
                         "(its positions attend to each other both ways).")
