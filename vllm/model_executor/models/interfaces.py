"""What the model runner needs of a model class, as protocols the type checker holds every
model in the registry to, and the checks that tell which optional parts a model has."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeGuard

import torch
from torch import nn

if TYPE_CHECKING:
    from vllm.model_executor.layers.quantization.gguf_blocks import FusedWeights
    from vllm.model_executor.model_loader.weight_utils import PackedModulesMapping
    from vllm.model_executor.models.encoder_decoder import CrossAttention
    from vllm.v1.attention.backends.abstract import FusedAttention
    from vllm.v1.messages import EncoderInput


class VllmModel(Protocol):
    """Every model: built as `cls(hf_config, attention backend, max_model_len, dtype)`,
    then loaded with `load_weights`."""

    # checkpoint projections -> the fused layer holding them, in order (`load_weights`,
    # LoRA's targets); {} where no layer fuses several
    packed_modules_mapping: ClassVar[PackedModulesMapping]

    def __call__(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the scheduled tokens, [num_tokens, hidden_size]: from
        `input_ids`, or from `inputs_embeds` rows when given."""
        ...

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads checkpoint tensors; returns the names of the parameters it set."""
        ...


class EncoderDecoderModel(VllmModel, Protocol):
    """An encoder/decoder model (BART, Whisper): the runner's encoder pass encodes a step's
    new encoder inputs and writes every layer's cross-attention K/V into the cross blocks."""

    def encode(self, inputs: list[EncoderInput]) -> torch.Tensor:
        """Encoder outputs of the inputs, concatenated: [sum of lengths, d_model]."""
        ...

    def cross_attention_layers(self) -> list[CrossAttention]: ...


class GraphModel(VllmModel, Protocol):
    """A model whose forward graph capture may compile (`supports_graph_capture = True`):
    the same forward as pieces along its seams, `prepare` -> each of `layers` -> `finish`,
    which the CPU graphs compile one by one."""

    layers: nn.ModuleList

    def prepare(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]: ...

    def finish(self, h: torch.Tensor) -> torch.Tensor: ...

    def row_switch_tokens(self) -> int:
        """The most tokens at which a layer picks its kernel by row count (GGUF's quantized
        kernels: `gguf_blocks.MAX_ROWS`), 0 where none does: graphs with a symbolic size
        take only larger steps, so that they never guard on that branch."""
        ...


@dataclass(slots=True)
class FusedExperts:
    """A mixture-of-experts block as the fused decoder computes it: a dense router, GGUF
    blocks of the experts (as `moe_experts` reads them) and, where the family has one, a
    shared expert."""

    router: torch.Tensor  # [num_experts, hidden] in the model dtype
    w1: torch.Tensor  # gate [E, I, row bytes] uint8
    w3: torch.Tensor  # up [E, I, row bytes]
    w2: torch.Tensor  # down [E, H, row bytes]
    types: tuple[int, int, int]  # their ggml block types
    top_k: int
    renormalize: bool
    # A shared expert behind a sigmoid gate (Qwen2-MoE): its gate_up and down, and the
    # gate [1, hidden] in the model dtype; None where the block has none
    shared: tuple[FusedWeights, FusedWeights, torch.Tensor] | None = None


@dataclass(slots=True)
class FusedDecodeLayer:
    """One decoder layer as the fused decoder computes it: norm, q/k/v (q/k norms per
    head), rotary, paged attention, o, (norm,) residual; norm, gate_up, act(gate) * up,
    down, (norm,) residual."""

    # Pre-norm layers (Llama): [input, post-attention]; sandwich norms (Gemma): [input,
    # attention output, pre-feedforward, post-feedforward]
    norms: list[torch.Tensor]
    # qkv, o, gate_up, down (qkv, o with `experts`): this rank's whole weights
    projections: list[FusedWeights]
    biases: list[torch.Tensor | None]  # each projection's (None: none)
    attention: FusedAttention  # its backend's declaration (`fused_decode_attention`)
    kv_cache_layer: int  # its index into the KV caches
    norm_eps: float  # its norms' epsilon
    qk_norms: list[torch.Tensor]  # [q norm, k norm] weights per head, or [] (none)
    rope: int = 0  # its rotary table's index in `FusedDecodeSpec.ropes`
    experts: FusedExperts | None = None  # its feed-forward block, where a mixture of experts


@dataclass(slots=True)
class FusedLookups:
    """The ends of a step the fused decoder may also run, where the model computes them as
    plain lookups and products: its embedding (`embed_tokens`) as rows of GGUF blocks, each
    rounded to the model dtype and times `scale` (Gemma's normalizer; None: none), and its
    `compute_logits` as one linear layer's product (this rank's whole weight, the first
    `vocab_size` rows, nothing applied after)."""

    table: tuple[torch.Tensor, int] | None = None  # uint8 [vocab, row bytes], ggml type
    scale: float | None = None
    head: FusedWeights | None = None
    head_bias: torch.Tensor | None = None
    vocab_size: int = 0


@dataclass(slots=True)
class FusedDecodeSpec:
    """A decoder as the native fused decoder (`v1/worker/fused_decode.py`) runs its small
    steps: plain tensors in layer order, every layer of one form (`FusedDecodeLayer`), then
    the final norm. Norms are RMSNorm, `weight * rnd(x / rms(x))`, or with
    `one_plus_norms` Gemma's `rnd(x / rms(x) * (1 + weight))` in float32; rotary is full
    width in rotate-half form."""

    embed_tokens: Callable[[torch.Tensor], torch.Tensor]  # ids [n] -> rows [n, hidden_size]
    layers: list[FusedDecodeLayer]
    final_norm: torch.Tensor
    final_norm_eps: float
    ropes: list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) [max_positions, head_dim]
    num_heads: int  # this rank's
    num_kv_heads: int
    head_dim: int
    one_plus_norms: bool = False
    activation: str = "silu"  # an `ACTIVATIONS` name: "silu" or "gelu_pytorch_tanh"
    lookups: FusedLookups | None = None  # the embedding and LM head, where it runs them


class FusedDecodeModel(VllmModel, Protocol):
    """A decoder the native fused decoder may run (the Llama family's plain layers, Qwen2/3's
    and their mixtures of experts, Gemma 2 / 3's)."""

    def fused_decode_spec(self) -> FusedDecodeSpec | str:
        """The description the fused decoder runs from, or why this model (as built and
        loaded) is not one it computes exactly."""
        ...


class MultiModalModel(VllmModel, Protocol):
    """A model whose prompts take images or audio (LLaVA, Qwen2-Audio): the engine core asks
    for their rows."""

    def embed_media(self, modality: str, data: list[torch.Tensor]) -> list[torch.Tensor]:
        """Items of one modality (`MediaInput.data`: images [3, H, W], audio log-mel
        features [num_mel_bins, frames + 2]) -> each item's rows [num_tokens, hidden_size]."""
        ...


def supports_media(model: VllmModel) -> TypeGuard[MultiModalModel]:
    return callable(getattr(model, "embed_media", None))


def is_encoder_decoder(model: VllmModel) -> TypeGuard[EncoderDecoderModel]:
    return callable(getattr(model, "encode", None)) and callable(
        getattr(model, "cross_attention_layers", None))


def supports_graph_capture(model: VllmModel) -> TypeGuard[GraphModel]:
    return bool(getattr(model, "supports_graph_capture", False))


def supports_fused_decode(model: VllmModel) -> TypeGuard[FusedDecodeModel]:
    return callable(getattr(model, "fused_decode_spec", None))
